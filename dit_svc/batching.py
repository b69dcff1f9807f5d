"""Request batching in the DiT stage: concurrent compatible requests denoised as one batch.

With `--max-batch-size N` (N > 1) a Denoise call whose request can share a batch (dit_svc/denoise.py `batch_key`:
the same latent shape, schedule and guidance branches; seeds, prompts and guidance scales may differ) waits in the
`RequestBatcher`. The batcher takes the oldest waiting request, waits at most `--batch-wait-ms` from its arrival
for partners of the same key, and runs them together on the stage's compute thread, one transformer pass per
step and branch; while a batch runs, the next one gathers.

Each request keeps its own stream (progress events, passes, latents), and is never told who shared its batch. A
request whose call ends (cancelled, deadline, client gone) is dropped before the next step; the others go on.
Requests with a step cache run alone (the cache decides from the request's own activations), and requests of
different batch groups (tenants, under the orchestrator's --batch-per-tenant) never share a batch.

One member cannot fail the others: members share adapters, shapes and schedule, so what could fail one fails each
alone, and a batch holds members only while their work (`request_work`: pixels x frames x guidance branches)
stays within that of the largest request the stage admits alone (`max_work`), so a batch never needs more
activation memory than one admitted request. A failed batch is not retried member by member, which would repeat
the failure N times on the one compute thread; its error fails every request in it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dit_svc.step_cache import CachePasses
from services.stage import StageRuntime
from stagediff.v1 import stages_pb2
from stagekit.denoise import DenoiseSpec
from stagekit.errors import Cancelled, RequestError

logger = logging.getLogger(__name__)

# (specs, conditionings, on_step(member, step, total), wanted() -> [bool]) -> [(latents or None, passes)]
RunBatch = Callable[..., list[tuple[torch.Tensor | None, CachePasses]]]
MAX_BATCH_SIZE = 64
MAX_BATCH_WAIT_MS = 10_000
# DenoiseParams.batch_group: an HMAC-SHA256 from the orchestrator; anything longer is refused.
MAX_BATCH_GROUP_BYTES = 64


def checked_batch_group(value: bytes) -> bytes:
    """A request's batch group; raises RequestError when it is longer than MAX_BATCH_GROUP_BYTES."""
    if len(value) > MAX_BATCH_GROUP_BYTES:
        raise RequestError(f"batch_group: {len(value)} bytes; at most {MAX_BATCH_GROUP_BYTES} are allowed")
    return value


def request_work(spec: DenoiseSpec) -> int:
    """What a request adds to its batch's activations: its pixels times frames, per guidance branch."""
    return spec.height * spec.width * spec.num_frames * (2 if spec.do_classifier_free_guidance else 1)


def max_work(limits: stages_pb2.ModelLimits) -> int:
    """The work of the largest request the model admits (its largest size, with guidance): a batch's bound."""
    return limits.max_height * limits.max_width * limits.max_frames * 2


@dataclass
class Waiting:
    """One request in the batcher: what it needs, and the queue of what its call streams back."""

    spec: DenoiseSpec
    conditioning: dict[str, torch.Tensor]
    key: tuple
    arrived: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)


class RequestBatcher:
    def __init__(
        self,
        runtime: StageRuntime,
        run_batch: RunBatch,
        max_batch_size: int,
        wait_ms: float,
        work_limit: int | None = None,
    ) -> None:
        """`work_limit`: the most `request_work` one batch holds in all (`max_work` of the model); None: no bound
        but `max_batch_size`."""
        self.runtime = runtime
        self.run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.work_limit = work_limit
        self.wait_s = wait_ms / 1000
        self.waiting: list[Waiting] = []
        self.arrival = asyncio.Event()
        self.dispatcher: asyncio.Task | None = None

    async def stream(self, spec: DenoiseSpec, conditioning: dict[str, torch.Tensor], key: tuple) -> AsyncIterator[Any]:
        """What the request's call streams, as `StageRuntime.stream` yields it: progress, passes, then latents."""
        loop = asyncio.get_running_loop()
        if self.dispatcher is None or self.dispatcher.done():
            self.dispatcher = loop.create_task(self._dispatch())
        waiting = Waiting(spec, conditioning, key, loop.time())
        self.waiting.append(waiting)
        self.arrival.set()
        try:
            while True:
                item = await waiting.events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, torch.Tensor):
                    return
        finally:
            # The call ended, however: a batch that still holds the request drops it before its next step.
            waiting.cancel.set()
            if waiting in self.waiting:
                self.waiting.remove(waiting)

    def _partners(self, key: tuple) -> list[Waiting]:
        """The requests waiting with `key`, oldest first, as many as one batch holds: at most max_batch_size,
        and within work_limit (the first always: a request alone is never refused here)."""
        members: list[Waiting] = []
        work = 0
        for waiting in self.waiting:
            if waiting.key != key or waiting.cancel.is_set():
                continue
            added = request_work(waiting.spec)
            if members and self.work_limit is not None and work + added > self.work_limit:
                break
            members.append(waiting)
            work += added
            if len(members) == self.max_batch_size:
                break
        return members

    def _room_for_more(self, key: tuple) -> bool:
        """Whether the batch of `key` could take another request like its first (so it waits for partners)."""
        members = self._partners(key)
        if len(members) >= self.max_batch_size:
            return False
        if self.work_limit is None or not members:
            return True
        return sum(request_work(m.spec) for m in members) + request_work(members[0].spec) <= self.work_limit

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.waiting:
                self.arrival.clear()
                await self.arrival.wait()
            first = self.waiting[0]
            deadline = first.arrived + self.wait_s
            while self._room_for_more(first.key) and loop.time() < deadline:
                self.arrival.clear()
                try:
                    await asyncio.wait_for(self.arrival.wait(), deadline - loop.time())
                except TimeoutError:
                    break
            members = self._partners(first.key)
            for member in members:
                self.waiting.remove(member)
            if first not in members and first in self.waiting:  # cancelled while it waited
                self.waiting.remove(first)
            if not members:
                continue
            try:
                await self.runtime.run(self._run, members, loop)
            except Exception as error:  # the compute thread could not take the batch (the stage is stopping)
                for member in members:
                    member.events.put_nowait(error)

    def _run(self, members: list[Waiting], loop: asyncio.AbstractEventLoop) -> None:
        """Runs one batch on the compute thread and hands each member its own results."""

        def post(member: Waiting, item: Any) -> None:
            loop.call_soon_threadsafe(member.events.put_nowait, item)

        def on_step(index: int, step: int, total: int) -> None:
            post(members[index], stages_pb2.DenoiseProgress(step=step, total=total))

        started = time.perf_counter()
        try:
            results = self.run_batch(
                [m.spec for m in members],
                [m.conditioning for m in members],
                on_step,
                lambda: [not m.cancel.is_set() for m in members],
            )
        except Exception as error:  # every member learns how its batch ended
            for member in members:
                post(member, error)
            return
        logger.info("denoised a batch of %d requests in %.2f s", len(members), time.perf_counter() - started)
        for member, (latents, passes) in zip(members, results, strict=True):
            if latents is None:
                post(member, Cancelled())
            else:
                post(member, passes)
                post(member, latents)
