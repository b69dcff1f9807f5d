"""The calls a job makes on each stage: text encoder, VAE encode, DiT, VAE decode, and interpolator.

Every stage call runs on one replica of its stage, chosen by the stage pool (the
serving replica with the fewest calls in flight), within the job's remaining
deadline. The orchestrator relays bytes: what a stage sends travels on as the
chunks it sent (the text encoder names its tensors as the DiT takes them), and
only their headers are read, never their data as tensors; torch is never
imported. The conditioning calls (text encoder, VAE encode of the input images)
run to their end and check that the stage sent every tensor the DiT needs from
it; the relayed calls (DiT, VAE decode, interpolator) read their input from a
queue closed by `END` and hand each chunk they receive to `emit`.

With `batch_per_tenant` (--batch-per-tenant) each Denoise call carries its
tenant's opaque batch group, so that a batched DiT puts it in a batch with the
same tenant's requests only. `keep_output` keeps a finished stage's output in
the job and in the store (behind the job: kept_outputs.py), so that a retry or a restart resumes after it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from families.base import Family
from services.metrics import OrchestratorMetrics
from services.orchestrator import notices as job_notices
from services.orchestrator.cache_namespace import tenant_cache_namespace
from services.orchestrator.denoise_call import Denoising
from services.orchestrator.dit_gate import DitGate
from services.orchestrator.job import Job
from services.orchestrator.kept_outputs import DEFAULT_AFTER_S, PendingWrite
from services.orchestrator.preemption import CheckpointPolicy
from services.orchestrator.routes import ModelRoute
from services.orchestrator.stage_clients import StageError, StagePool
from services.orchestrator.step_times import StepTimes
from services.orchestrator.store import AUDIO_TENSOR, JobStore
from services.orchestrator.store_retry import store_call
from services.stage_priority import call_metadata
from stagediff.tensor_codec import WireError
from stagediff.v1 import generation_pb2, image_pb2, stages_pb2, tensor_pb2

END = None  # closes a relay queue
# The VAE's Encode of a request's input images: a call on the VAE stage, kept under its own name.
VAE_ENCODE = "vae-encode"
# Where a relayed stage sends each chunk: the next stage's queue, or the result.
Emit = Callable[[tensor_pb2.TensorChunk], Awaitable[None]]


def _tensor_names(chunks: list[tensor_pb2.TensorChunk]) -> list[str]:
    return [chunk.header.name for chunk in chunks if chunk.HasField("header")]


def check_sent(
    family: Family,
    request: generation_pb2.GenerateRequest,
    stage: str,
    endpoint: str,
    chunks: list[tensor_pb2.TensorChunk],
) -> None:
    """Raises StageError (INTERNAL) when a conditioning stage left out a tensor the DiT needs from it."""
    sent = _tensor_names(chunks)
    guidance, images = request.guidance_scale > family.cfg_threshold, bool(request.images)
    needed = [slot.name for slot in family.conditioning if slot.source == stage and slot.is_needed(guidance, images)]
    missing = [name for name in needed if name not in sent]
    if missing or (chunks and not chunks[-1].last):
        detail = f"sent no {', '.join(missing)}" if missing else "its stream ended inside a tensor"
        raise StageError(stage, endpoint, grpc.StatusCode.INTERNAL, f"{detail} (sent {sent})")


class StageCalls:
    """One call on one stage for a job, each method a stage; the stages come from `stages`."""

    def __init__(
        self,
        stages: StagePool,
        store: JobStore | None,
        metrics: OrchestratorMetrics | None,
        cache_namespace_key: bytes,
        batch_per_tenant: bool,
        keep_outputs_after_s: float = DEFAULT_AFTER_S,
        gate: DitGate | None = None,
        checkpoints: CheckpointPolicy | None = None,
        step_times: StepTimes | None = None,
    ) -> None:
        """`gate`: the DiT gate (None: calls go straight to the least busy replica, never preempted);
        `checkpoints`: how often the DiT sends a job's state (None: never); `step_times`: where the DiT's step
        times are recorded (for deadlines)."""
        self.stages = stages
        self.store = store
        self.metrics = metrics
        # Keys each tenant's namespace in the text encoder's embedding cache (services/orchestrator/cache_namespace.py).
        self.cache_namespace_key = cache_namespace_key
        # Whether the DiT may batch one tenant's requests only with the same tenant's (DenoiseParams.batch_group).
        self.batch_per_tenant = batch_per_tenant
        # How long the job runs on past a finished stage before its output is written to the store.
        self.keep_outputs_after_s = keep_outputs_after_s
        self.step_times = step_times if step_times is not None else StepTimes()
        self.denoising = Denoising(
            stages,
            store,
            gate,
            checkpoints if checkpoints is not None else CheckpointPolicy(),
            self.step_times,
            keep_outputs_after_s,
            self._dit_progress,
        )

    async def keep_output(self, job: Job, stage: str, chunks: list[tensor_pb2.TensorChunk]) -> None:
        """Keeps a finished stage's output in the job, so that a retry resumes after it, and in the store once
        the job has run on `keep_outputs_after_s` past it (kept_outputs.py), so that a restart does too."""
        job.intermediates.setdefault("outputs", {})[stage] = chunks
        if self.store is not None:
            store, passes = self.store, job.transformer_passes
            kept = (passes.run, passes.skipped) if stage == "dit" else None

            def write() -> Awaitable[bool]:
                return store_call(store.mark_stage_done, job.job_id, stage, chunks, passes=kept)

            pending = PendingWrite(write, self.keep_outputs_after_s, name=f"save-{job.job_id}-{stage}")
            job.intermediates.setdefault("saving", []).append(pending)

    async def add_notices(self, job: Job, notices: list[stages_pb2.Notice]) -> None:
        """Adds a stage's notices to the job (those it has already, from an earlier run, once) and to its row."""
        merged = job_notices.merge(job.notices, notices)
        if merged == job.notices:
            return
        job.notices = merged
        if self.store is not None:
            await store_call(self.store.set_notices, job.job_id, merged)

    def remaining(self, job: Job) -> float | None:
        if job.deadline is None:
            return None
        return max(0.0, job.deadline - asyncio.get_running_loop().time())

    async def input_images(self, job: Job) -> list[image_pb2.InputImage]:
        """The job's input images with their bytes: from the store, where admission put them (the job itself
        holds their digests and sizes only); a pipeline without a store has them in the request."""
        if self.store is None:
            return list(job.request.images)
        return await asyncio.to_thread(self.store.load_input_images, job.job_id)

    async def encode(self, job: Job, route: ModelRoute) -> None:
        """Runs the text encoder to its end: the DiT's conditioning, as the chunks the text encoder sent."""
        request, family = job.request, route.family
        stage = self.stages["text-encoder"]
        texts = [request.prompt]
        if request.guidance_scale > family.cfg_threshold:
            texts.append(request.negative_prompt)
        job.current_stage = "text-encoder"
        started = time.perf_counter()
        chunks: list[tensor_pb2.TensorChunk] = []
        images = await self.input_images(job) if "text-encoder" in family.images.encoded_by else []
        async with stage.call(route.accepts("text-encoder", "encode"), route.model) as replica:
            call = replica.text_encoder.Encode(
                stages_pb2.EncodeRequest(
                    model=route.model_for(replica.info),
                    texts=texts,
                    # The model's, which a text encoder shared with another model (FLUX.1-schnell's 256 beside
                    # FLUX.1-dev's 512 T5 tokens) does not know.
                    max_sequence_length=route.info.limits.max_sequence_length,
                    cache_namespace=tenant_cache_namespace(self.cache_namespace_key, job.tenant),
                    images=images,
                ),
                timeout=self.remaining(job),
                metadata=call_metadata(job.priority),
            )
            notices: list[stages_pb2.Notice] = []
            async for response in call:
                chunks.append(response.tensor)
                notices.extend(response.notices)
        check_sent(family, request, "text-encoder", replica.endpoint, chunks)
        job.timings["text-encoder"] = time.perf_counter() - started
        await self.add_notices(job, notices)
        await self.keep_output(job, "text-encoder", chunks)
        await job.publish(
            generation_pb2.GenerateEvent(progress=generation_pb2.StageProgress(stage="text-encoder", step=1, total=1))
        )

    async def encode_images(self, job: Job, route: ModelRoute) -> None:
        """Runs the VAE's Encode of the input images to its end: the DiT's image latents."""
        request, family = job.request, route.family
        started = time.perf_counter()
        chunks: list[tensor_pb2.TensorChunk] = []
        images = await self.input_images(job)
        async with self.stages["vae"].call(route.accepts("vae", "encode"), route.model) as replica:
            call = replica.vae.Encode(
                stages_pb2.VaeEncodeRequest(
                    model=route.model_for(replica.info),
                    height=request.height,
                    width=request.width,
                    num_frames=request.num_frames,
                    images=images,
                ),
                timeout=self.remaining(job),
                metadata=call_metadata(job.priority),
            )
            async for response in call:
                chunks.append(response.tensor)
        check_sent(family, request, "vae", replica.endpoint, chunks)
        job.timings[VAE_ENCODE] = time.perf_counter() - started
        await self.keep_output(job, VAE_ENCODE, chunks)

    def batch_group(self, job: Job) -> bytes:
        """The job's DenoiseParams.batch_group: its tenant's opaque namespace with --batch-per-tenant, else empty."""
        return tenant_cache_namespace(self.cache_namespace_key, job.tenant) if self.batch_per_tenant else b""

    async def denoise(self, job: Job, route: ModelRoute, conditioning: asyncio.Queue, emit: Emit) -> None:
        """The DiT's Denoise, through the DiT gate (services/orchestrator/denoise_call.py): its latents go to
        `emit`; progress and passes become the job's events and metrics."""
        job.current_stage = "dit"
        started = time.perf_counter()
        await self.denoising.run(job, route, conditioning, emit, self.batch_group(job), lambda: self.remaining(job))
        job.timings["dit"] = time.perf_counter() - started

    async def _dit_progress(self, job: Job, response: stages_pb2.DenoiseResponse) -> None:
        """A DiT message for the job's events and metrics: a step's progress, the passes, or a yield."""
        request = job.request
        if response.HasField("yielded"):
            if self.metrics is not None:
                self.metrics.add_denoising_pause(job.tenant, "handoff" if response.yielded.draining else "preempted")
        elif response.HasField("progress"):
            progress = response.progress
            if self.metrics is not None:
                self.metrics.add_denoising_steps(job.tenant)
            await job.publish(
                generation_pb2.GenerateEvent(
                    progress=generation_pb2.StageProgress(stage="dit", step=progress.step, total=progress.total)
                )
            )
        elif response.HasField("passes"):
            job.transformer_passes.CopyFrom(response.passes)
            if self.metrics is not None:
                self.metrics.add_transformer_passes(job.tenant, request.cache.method, response.passes)

    async def decode(
        self, job: Job, route: ModelRoute, latents: asyncio.Queue, emit: Emit, emit_audio: Emit | None = None
    ) -> None:
        """The VAE's Decode: its frames tensors go to `emit` (the interpolator, or the result), its tensor "audio"
        (a model that makes video with sound) to `emit_audio`, straight to the result: interpolation changes the
        frame rate, never the video's length. Progress counts the frames tensors only."""
        request = job.request
        stage = self.stages["vae"]
        # The DiT's checkpoint and the VAE replica's hold the same VAE, so the DiT's limits say its factor.
        num_latent_frames = (request.num_frames - 1) // (route.info.limits.temporal_factor or 4) + 1

        async def requests(model: str) -> AsyncIterator[stages_pb2.DecodeRequest]:
            yield stages_pb2.DecodeRequest(
                params=stages_pb2.DecodeParams(model=model, num_latent_frames=num_latent_frames)
            )
            while (chunk := await latents.get()) is not END:
                yield stages_pb2.DecodeRequest(tensor=chunk)

        started = None
        decoded = 0
        tensor = ""  # the name of the tensor whose chunks arrive
        async with stage.call(route.accepts("vae", "decode"), route.model) as replica:
            call = replica.vae.Decode(
                requests(route.model_for(replica.info)),
                timeout=self.remaining(job),
                metadata=call_metadata(job.priority),
            )
            async for response in call:
                if started is None:
                    started = time.perf_counter()
                    job.current_stage = "vae"
                if response.tensor.HasField("header"):
                    tensor = response.tensor.header.name
                if tensor == AUDIO_TENSOR:
                    if emit_audio is None:
                        raise WireError("audio: the VAE sent sound where none is taken")
                    await emit_audio(response.tensor)
                    continue
                await emit(response.tensor)
                if response.tensor.last:
                    decoded += 1
                    await job.publish(
                        generation_pb2.GenerateEvent(
                            progress=generation_pb2.StageProgress(stage="vae", step=decoded, total=num_latent_frames)
                        )
                    )
        job.timings["vae"] = time.perf_counter() - (started or time.perf_counter())

    async def interpolate(self, job: Job, route: ModelRoute, frames: asyncio.Queue, emit: Emit) -> None:
        request = job.request
        stage = self.stages["interp"]
        total = (request.num_frames - 1) * 2**request.interpolation.exp + 1

        async def requests() -> AsyncIterator[stages_pb2.InterpolateRequest]:
            yield stages_pb2.InterpolateRequest(
                params=stages_pb2.InterpolateParams(
                    exp=request.interpolation.exp,
                    scale=request.interpolation.scale,
                    model_path=request.interpolation.model_path,
                )
            )
            while (chunk := await frames.get()) is not END:
                yield stages_pb2.InterpolateRequest(tensor=chunk)

        started = None
        sent = 0
        async with stage.call(route.accepts("interp"), route.model) as replica:
            calls = replica.interpolator.Interpolate(
                requests(), timeout=self.remaining(job), metadata=call_metadata(job.priority)
            )
            async for response in calls:
                if started is None:
                    started = time.perf_counter()
                    job.current_stage = "interp"
                await emit(response.tensor)
                if response.tensor.HasField("header"):
                    sent = response.tensor.header.index + response.tensor.header.shape[0]
                if response.tensor.last:
                    await job.publish(
                        generation_pb2.GenerateEvent(
                            progress=generation_pb2.StageProgress(stage="interp", step=sent, total=total)
                        )
                    )
        job.timings["interp"] = time.perf_counter() - (started or time.perf_counter())
