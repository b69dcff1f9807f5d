"""A job's denoising on the DiT stage: its slot at the DiT gate, its Denoise calls, and its state between them.

A job takes a slot at the DiT gate (services/orchestrator/dit_gate.py) and runs one Denoise call on the slot's
replica with its conditioning. On a replica that steps requests (StageInfo.step_scheduling) the call may end before
its latents, at a step boundary, with the request's state ("denoise_state", opaque bytes) and a `DenoiseYielded`:
- preempted (the gate asked the replica to `Yield` for a job of a higher class): the job counts the preemption, its
  watchers see `JobPaused` (reason "preempted"), and it waits at the gate again with its state;
- handed off (the replica is draining): the replica leaves the rotation, the watchers see `JobPaused` (reason
  "handoff"), and the job continues on another replica at once.

Either way the next call sends the state back after the conditioning, and the watchers see `JobResumed`; the
replica continues from the state's step exactly as the uninterrupted run would (stagekit/denoise_steps.py).

With checkpoints (`CheckpointPolicy`: --checkpoint-every K, for jobs of at least --checkpoint-min-steps steps) the
replica also sends the state every K steps while the call goes on (the tensor's header index is its step). Each
state received replaces the job's last (`job.intermediates["outputs"]["dit-state"]`) and is written to the store
behind the job as the other kept outputs are (counted in the tenant's bytes), so a retry after a replica died, or a
restarted orchestrator, continues from it: a dead replica costs at most the K steps since. A replica that does not
step requests is sent no state: the job runs there from its first step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from services.input_images import ROLE_NAMES
from services.orchestrator.dit_gate import DitGate, Slot
from services.orchestrator.job import Job
from services.orchestrator.kept_outputs import PendingWrite
from services.orchestrator.preemption import CheckpointPolicy
from services.orchestrator.routes import ModelRoute
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.step_times import ShapeKey, StepTimes
from services.orchestrator.store import JobStore
from services.orchestrator.store_retry import store_call
from services.stage_priority import call_metadata
from stagediff.v1 import generation_pb2, image_pb2, stages_pb2, tensor_pb2

logger = logging.getLogger(__name__)

# The job's last denoising state, kept as the stages' outputs are (and restored with them after a restart).
DIT_STATE = "dit-state"
STATE_TENSOR = "denoise_state"  # the name the DiT sends it under (stagekit.denoise_steps.STATE_TENSOR)
Emit = Callable[[tensor_pb2.TensorChunk], Awaitable[None]]


@dataclass(frozen=True)
class Yielded:
    """A call that ended at a step boundary with the job's state (kept before this is returned)."""

    step: int
    total: int
    draining: bool


def shape_key(request: generation_pb2.GenerateRequest, cfg: bool) -> ShapeKey:
    """What a step's time depends on: the model, the latents' size and whether CFG doubles the passes."""
    return ShapeKey(request.model, request.height, request.width, request.num_frames, cfg)


def denoise_params(
    job: Job, batch_group: bytes, call_id: str = "", checkpoint_every: int = 0
) -> stages_pb2.DenoiseParams:
    request = job.request
    return stages_pb2.DenoiseParams(
        model=request.model,
        height=request.height,
        width=request.width,
        num_frames=request.num_frames,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        embedded_guidance_scale=(
            request.embedded_guidance_scale if request.HasField("embedded_guidance_scale") else None
        ),
        seed=request.seed,
        fps=request.fps,
        cache=request.cache,
        loras=request.loras,
        batch_group=batch_group,
        image_roles=[ROLE_NAMES[image.role] for image in request.images],
        image_sizes=[image_pb2.ImageSize(width=image.width, height=image.height) for image in request.images],
        call_id=call_id,
        checkpoint_every=checkpoint_every,
    )


class Denoising:
    """Runs jobs' DiT stage through the gate, keeping and resending their states (see the module docstring)."""

    def __init__(
        self,
        stages: StagePool,
        store: JobStore | None,
        gate: DitGate | None,
        checkpoints: CheckpointPolicy,
        step_times: StepTimes,
        keep_after_s: float,
        on_progress: Callable[[Job, stages_pb2.DenoiseResponse], Awaitable[None]],
    ) -> None:
        """`on_progress(job, response)`: the caller's handling of a progress, passes or yielded message (events,
        metrics)."""
        self.stages = stages
        self.store = store
        self.gate = gate
        self.checkpoints = checkpoints
        self.step_times = step_times
        self.keep_after_s = keep_after_s
        self.on_progress = on_progress

    async def run(
        self,
        job: Job,
        route: ModelRoute,
        conditioning: asyncio.Queue,
        emit: Emit,
        batch_group: bytes,
        remaining: Callable[[], float | None],
    ) -> None:
        """The job's DiT stage to its end: its latents go to `emit` as they arrive."""
        chunks: list[tensor_pb2.TensorChunk] = []
        while (chunk := await conditioning.get()) is not None:
            chunks.append(chunk)
        outputs = job.intermediates.setdefault("outputs", {})
        try:
            while True:
                async with self._slot(job, route) as slot:
                    state = outputs.get(DIT_STATE)
                    if state:  # the state's header index is its step
                        step, total = state[0].header.index, job.request.num_inference_steps
                        await job.publish(
                            generation_pb2.GenerateEvent(
                                resumed=generation_pb2.JobResumed(stage="dit", step=step, total=total)
                            )
                        )
                    yielded = await self._call(job, route, slot, chunks, state, emit, batch_group, remaining)
                if yielded is None:
                    return
                await self._paused(job, yielded)
        finally:
            if self.gate is not None:
                self.gate.forget(job.job_id)

    def _slot(self, job: Job, route: ModelRoute) -> contextlib.AbstractAsyncContextManager[Slot]:
        return self.gate.slot(job, route) if self.gate is not None else _ungated(job)

    async def _paused(self, job: Job, yielded: Yielded) -> None:
        reason = "handoff" if yielded.draining else "preempted"
        if not yielded.draining:
            job.preemptions += 1
            if self.store is not None:
                await store_call(self.store.count_preemption, job.job_id)
        await job.publish(
            generation_pb2.GenerateEvent(
                paused=generation_pb2.JobPaused(
                    stage="dit",
                    step=yielded.step,
                    total=yielded.total,
                    reason=reason,
                    preemptions=job.preemptions,
                )
            )
        )

    async def _call(
        self,
        job: Job,
        route: ModelRoute,
        slot: Slot,
        conditioning: list[tensor_pb2.TensorChunk],
        state: list[tensor_pb2.TensorChunk] | None,
        emit: Emit,
        batch_group: bytes,
        remaining: Callable[[], float | None],
    ) -> Yielded | None:
        """One Denoise call; returns how it yielded, or None once the latents were all emitted."""
        stage = self.stages["dit"]
        request = job.request
        async with stage.call(route.accepts("dit"), route.model, slot.replica) as replica:
            slot.replica = replica
            steps = replica.info is not None and replica.info.step_scheduling
            every = self.checkpoints.every_for(request.num_inference_steps) if steps else 0
            params = denoise_params(job, batch_group, slot.call_id if steps else "", every)
            resend = state if steps and state else []
            logger.info(
                "job %s: denoising on %s from step %d",
                job.job_id,
                replica.endpoint,
                resend[0].header.index if resend else 0,
            )

            async def requests() -> AsyncIterator[stages_pb2.DenoiseRequest]:
                yield stages_pb2.DenoiseRequest(params=params)
                for chunk in [*conditioning, *resend]:
                    yield stages_pb2.DenoiseRequest(tensor=chunk)

            tensor = ""  # the name of the tensor whose chunks arrive
            received: list[tensor_pb2.TensorChunk] = []
            last_step = time.perf_counter()
            cfg = request.guidance_scale > route.family.cfg_threshold
            calls = replica.denoiser.Denoise(requests(), timeout=remaining(), metadata=call_metadata(job.priority))
            async for response in calls:
                if response.HasField("progress"):
                    now = time.perf_counter()
                    self.step_times.observe(shape_key(request, cfg), now - last_step)
                    last_step = now
                    slot.step, slot.total = response.progress.step, response.progress.total
                    await self.on_progress(job, response)
                elif response.HasField("passes"):
                    await self.on_progress(job, response)
                elif response.HasField("yielded"):
                    await self.on_progress(job, response)
                    yielded = response.yielded
                    if yielded.draining:  # the next call goes to another replica
                        stage.mark_down(replica, "NOT_SERVING", "draining: handed its jobs off")
                    return Yielded(yielded.step, yielded.total, yielded.draining)
                else:
                    chunk = response.tensor
                    if chunk.HasField("header"):
                        tensor = chunk.header.name
                    if tensor != STATE_TENSOR:
                        await emit(chunk)
                        continue
                    received.append(chunk)
                    if chunk.last:
                        self._keep_state(job, received)
                        received = []
        return None

    def _keep_state(self, job: Job, chunks: list[tensor_pb2.TensorChunk]) -> None:
        """Keeps the job's newest state in the job and, behind it, in the store (the newer write replaces a
        waiting older one, and waits for one under way, so that the store ends with the newest)."""
        job.intermediates.setdefault("outputs", {})[DIT_STATE] = chunks
        if self.store is None:
            return
        store, job_id = self.store, job.job_id
        previous = job.intermediates.get("state_write")
        before = None
        if previous is not None:
            previous.drop()
            before = previous.task if previous.begun else None

        async def write() -> bool:
            if before is not None:
                await asyncio.gather(before, return_exceptions=True)
            return await store_call(store.mark_stage_done, job_id, DIT_STATE, chunks)

        pending = PendingWrite(write, self.keep_after_s, name=f"save-{job_id}-{DIT_STATE}")
        job.intermediates["state_write"] = pending
        job.intermediates.setdefault("saving", []).append(pending)


@contextlib.asynccontextmanager
async def _ungated(job: Job) -> AsyncIterator[Slot]:
    """A slot without a gate (a pipeline without one): no replica chosen ahead, never asked to yield."""
    yield Slot(job, None, call_id=secrets.token_hex(16))
