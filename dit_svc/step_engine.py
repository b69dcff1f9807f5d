"""The DiT stage's step engine: requests denoised one step at a time, so that they can yield, checkpoint and share
steps with requests that arrive later.

On one rank, for a family whose loop is written as steps (stagekit/denoise_steps.py `runs_steps`), a request with
no step cache and no adapters becomes a `Member` of the `StepEngine`. The engine is an asyncio task that, while it
has members, hands the stage's compute thread ONE iteration at a time (`StageRuntime.run`), so other work queued on
that thread runs between iterations; an iteration queues there at the place of the highest-priority call it
serves (services/stage_priority.py). An iteration:

1. admits waiting members by their call's place (priority class, then arrival) while there are free `slots` and
   their work (`request_work`) stays within `work_limit`, and, with a `growth` bound (dit_svc/batch_growth.py),
   while their shape's batch stays within the size whose cost per row is lowest; a member alone is always admitted,
   and the growth bound never keeps a member waiting behind a member of its shape of a lower class: `begin` makes
   its run, from its state when it sent one (a state made for another request fails that member alone, with a
   RequestError naming denoise_state);
2. drops the members whose call ended, and retires those asked to yield (Yield, or the stage draining) whose run
   can be exported: their state, then `DenoiseYielded`, end their stream;
3. advances the others by one step, one `step` call per group that may share it (the same latent shape,
   guidance branches, batch group and conditioning shapes), each row at its own timestep, timing each call for
   `growth`;
4. per member: its progress; when done, its passes and latents (it retires); else its state every
   `checkpoint_every` steps.

The compute thread runs iterations back to back, without handing back to the event loop, while no waiting member
may join (`_admission`) and no other work waits for the thread (`StageRuntime.compute_queued`): between steps it
would only wake the loop to hand the next iteration back, a gap that costs the DiT several percent of its time on a
busy host.

With `slots` 1 the members run one after another in arrival order; with continuous batching (`slots` > 1) a new
member joins the running ones at the next step boundary and nobody waits for a batch to finish. An error inside a
`step` fails every member of that group (what fails one fails the others alike). A member's conditioning and run are
dropped when it retires. What a member's stream yields: `DenoiseProgress`, `StateBytes`, `CachePasses`,
`DenoiseYielded` (last) or the latents tensor (last); an exception ends it with that error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dit_svc.batch_growth import BatchGrowth, cost_key
from dit_svc.batching import request_work
from dit_svc.step_cache import CachePasses
from services.stage import StageRuntime
from services.stage_priority import current_place, running_as
from stagediff.v1 import stages_pb2
from stagekit.denoise import DenoiseSpec
from stagekit.denoise_steps import DenoiseRun, StepDenoiser, scheduler_exportable, state_from_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateBytes:
    """A member's state at a step boundary (`DenoiseState.to_bytes`), for its stream to send as "denoise_state"."""

    data: bytes
    step: int  # the steps done: sent as the tensor's header index, so that a receiver knows it without reading it


class EngineStopped(RuntimeError):
    """The engine stopped (the stage is shutting down) while the member was in it."""


@dataclass(eq=False)
class Member:
    """One request in the engine: what it needs, its run once admitted, what its call asked, and its stream's
    queue. `ended` and `yield_asked` are set on the event loop and read on the compute thread."""

    spec: DenoiseSpec
    conditioning: dict[str, torch.Tensor]
    state: bytes | None = None
    checkpoint_every: int = 0
    run: DenoiseRun | None = None
    steps_run: int = 0
    ended: bool = False
    yield_asked: bool = False
    retired: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Its call's place on the compute thread (services/stage_priority.py), taken where the member is made.
    place: tuple[int, int] = field(default_factory=current_place)
    # What its rows cost depends on (dit_svc/batch_growth.py), taken before its conditioning is dropped.
    shape: tuple = field(init=False)

    def __post_init__(self) -> None:
        self.shape = cost_key(self.spec, self.conditioning)

    @property
    def may_yield(self) -> bool:
        """Whether the member can still be exported at a later step boundary (not at or past its last step)."""
        run = self.run
        if self.retired:
            return False
        if run is None:
            return self.spec.num_inference_steps > 1
        return run.exportable or (run.step_index < run.total - 1 and scheduler_exportable(run.scheduler))


class StepEngine:
    def __init__(
        self,
        runtime: StageRuntime,
        denoiser: StepDenoiser,
        slots: int = 1,
        work_limit: int | None = None,
        growth: BatchGrowth | None = None,
    ) -> None:
        """`slots`: the most members stepped at once (1: one after another); `work_limit`: the most
        `request_work` of the members at once (`max_work` of the model; None: no bound but `slots`); `growth`:
        the measured bound on one shape's batch (None: `slots` alone)."""
        if slots < 1:
            raise ValueError(f"slots: {slots}; at least 1")
        self.runtime = runtime
        self.denoiser = denoiser
        self.slots = slots
        self.work_limit = work_limit
        self.waiting: list[Member] = []
        self.active: list[Member] = []  # touched by the compute thread only during an iteration
        self.draining = False
        self.stopping = False
        self.arrival = asyncio.Event()
        self.driver: asyncio.Task | None = None
        # Runs of a family with per-token timesteps step one at a time (Wan2.2 TI2V's expand_timesteps).
        self.one_per_step = bool(getattr(denoiser, "expand_timesteps", False))
        self.growth = None if self.one_per_step else growth

    def drain(self) -> None:
        """From now on every member that can be exported yields at its next step boundary (`draining` set)."""
        self.draining = True
        self.arrival.set()

    async def stream(self, member: Member) -> AsyncIterator[Any]:
        """What the member's call streams (see the module's docstring); the member leaves the engine when the
        call ends, however it ends."""
        if self.driver is None or self.driver.done():
            self.arrival = asyncio.Event()  # the driver's loop's
            self.driver = asyncio.get_running_loop().create_task(self._drive())
        self.waiting.append(member)
        self.arrival.set()
        try:
            while True:
                item = await member.events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, (torch.Tensor, stages_pb2.DenoiseYielded)):
                    return
        finally:
            member.ended = True  # an admitted member is dropped at the next step boundary
            if member in self.waiting:
                self.waiting.remove(member)

    async def stop(self) -> None:
        """Stops the driver; members still in the engine fail with EngineStopped."""
        self.stopping = True
        if self.driver is not None and not self.driver.done():
            self.driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.driver

    def _admissible(self) -> list[Member]:
        """The waiting members the next iteration admits (taken out of `waiting`, with those whose call ended)."""
        self.waiting = [member for member in self.waiting if not member.ended]
        admitted = self._admission()
        for member in admitted:
            self.waiting.remove(member)
        return admitted

    def _admission(self) -> list[Member]:
        """The waiting members that may join now, by place; reads only, so that the compute thread may ask it
        between iterations (the event loop only appends to `waiting` meanwhile)."""
        admitted: list[Member] = []
        work = sum(request_work(member.spec) for member in self.active)
        for member in sorted(list(self.waiting), key=lambda waiting: waiting.place):
            if member.ended:
                continue
            if len(self.active) + len(admitted) >= self.slots:
                break
            added = request_work(member.spec)
            if (self.active or admitted) and self.work_limit is not None and work + added > self.work_limit:
                break  # in order: a large request is not overtaken for ever by small ones
            if self.growth is not None:
                sharing = [other.place[0] for other in (*self.active, *admitted) if other.shape == member.shape]
                outranks = bool(sharing) and member.place[0] < max(sharing)
                if len(sharing) >= self.growth.limit(member.shape) and not outranks:
                    continue  # its shape's batch is as large as it pays; another shape may still join
            admitted.append(member)
            work += added
        return admitted

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                admitted = self._admissible()
                if not admitted and not self.active:
                    self.arrival.clear()
                    if not self.waiting:
                        await self.arrival.wait()
                    continue
                # An iteration serves its members: it queues on the compute thread at the place of the first of them.
                running_as(min(member.place for member in (*admitted, *self.active)))
                try:
                    await self.runtime.run(self._iterations, admitted, loop)
                except Exception as error:  # the compute thread could not take the iteration (the stage stops)
                    for member in {*admitted, *self.active}:
                        member.events.put_nowait(error)
                        self._retire(member)
        except asyncio.CancelledError:
            for member in [*self.waiting, *self.active]:
                member.events.put_nowait(EngineStopped("dit: the stage stopped while the request ran"))
                self._retire(member)
            self.waiting.clear()
            raise

    def _retire(self, member: Member) -> None:
        if member in self.active:
            self.active.remove(member)
        member.retired = True
        member.run = None
        member.conditioning = {}
        member.state = None

    def _iterations(self, admitted: list[Member], loop: asyncio.AbstractEventLoop) -> None:
        """Iterations on the compute thread, the first admitting `admitted`, while the next needs nothing from the
        event loop (see the module's docstring)."""
        self._iterate(admitted, loop)
        while self.active and not self.stopping and not self._admission() and not self.runtime.compute_queued():
            self._iterate([], loop)

    @torch.no_grad()
    def _iterate(self, admitted: list[Member], loop: asyncio.AbstractEventLoop) -> None:
        """One iteration on the compute thread (see the module's docstring)."""

        def post(member: Member, item: Any) -> None:
            loop.call_soon_threadsafe(member.events.put_nowait, item)

        for member in admitted:
            try:
                member.run = self._begin(member)
            except Exception as error:  # this member's own request or state: the others go on
                post(member, error)
                self._retire(member)
                continue
            self.active.append(member)
        for member in list(self.active):
            run = member.run
            assert run is not None
            if member.ended:
                logger.info("%s: request cancelled; compute stopped", self.runtime.stage)
                self._retire(member)
            elif (member.yield_asked or self.draining) and run.exportable:
                post(member, StateBytes(run.export().to_bytes(), run.step_index))
                post(member, stages_pb2.DenoiseYielded(step=run.step_index, total=run.total, draining=self.draining))
                self._retire(member)
        for group in self._groups():
            try:
                with self._measured(group):
                    self.denoiser.step([member.run for member in group if member.run is not None])
            except Exception as error:
                logger.exception("dit: a step of %d requests failed", len(group))
                for member in group:
                    post(member, error)
                    self._retire(member)
                continue
            for member in group:
                self._after_step(member, post)

    def _measured(self, group: list[Member]) -> contextlib.AbstractContextManager:
        """Times a group's step for `growth` (nothing without it)."""
        if self.growth is None:
            return contextlib.nullcontext()
        return self.growth.measure(group[0].shape, len(group))

    def _begin(self, member: Member) -> DenoiseRun:
        """The member's run: at step 0, or continued from the state it sent (checked against its request)."""
        run = self.denoiser.begin(member.spec, member.conditioning)
        if member.state is None:
            return run
        state = state_from_bytes(member.state, tuple(run.latents.shape), run.digest)
        member.state = None
        return self.denoiser.begin(member.spec, member.conditioning, state)

    def _groups(self) -> list[list[Member]]:
        """The active members by the step they may share: latent shape, guidance branches and batch group."""
        groups: dict[tuple, list[Member]] = {}
        for member in self.active:
            run = member.run
            assert run is not None
            # The conditioning's shapes too: rows of one pass stack their embeddings.
            shapes = tuple(sorted((name, tuple(t.shape), str(t.dtype)) for name, t in member.conditioning.items()))
            key: tuple = (tuple(run.latents.shape), member.spec.do_classifier_free_guidance, member.spec.batch_group)
            key += (shapes,)
            if self.one_per_step:
                key = (id(member),)
            groups.setdefault(key, []).append(member)
        return list(groups.values())

    def _after_step(self, member: Member, post: Any) -> None:
        run = member.run
        assert run is not None
        member.steps_run += 1
        post(member, stages_pb2.DenoiseProgress(step=run.step_index, total=run.total))
        if run.done:
            branches = 2 if member.spec.do_classifier_free_guidance else 1
            post(member, CachePasses(run=member.steps_run * branches))
            post(member, self.denoiser.result(run).float())
            self._retire(member)
        elif member.checkpoint_every > 0 and run.step_index % member.checkpoint_every == 0 and run.exportable:
            post(member, StateBytes(run.export().to_bytes(), run.step_index))
