"""One job's trip through the stages: text encoder, DiT, VAE, interpolator.

The DiT, VAE and interpolator calls run at the same time, joined by queues:
each latent-frame chunk the DiT sends is forwarded to the VAE as it arrives,
each frame chunk the VAE sends goes on to the interpolator (or straight to the
client), and nothing waits for the whole video.

Frames go to disk, not to memory. The result's shape is known when the job
starts, so its file is preallocated in the store, and the final stage's frame
chunks are written at their frame offsets as they arrive (`ResultPublisher`);
each piece, once whole, is announced in the job's log as a `ResultPiece` that
watchers read back from the file. At the end the file is fsynced and renamed
into place with the row that marks the job SUCCEEDED, before the completion
event. A job that fails or is cancelled deletes its partial file.

Every stage call runs on one replica of its stage, chosen by the stage pool
(the serving replica with the fewest calls in flight). Finished stages leave
their output in `job.intermediates` (the embeddings, the latent chunks), so when
a later stage fails with UNAVAILABLE the job is retried from there, without
recomputing earlier stages. Frames already published are not written or
published again on a retry: stages are deterministic, so the frame index says
what a retry may skip, and a piece cut half-way was never published, so the
retry writes it again from its first byte.

Retries: a call that fails with UNAVAILABLE takes its replica out of rotation.
If another replica of that stage is serving, the job fails over to it at once
and that retry is free: it does not spend `stage_retries`, which is the budget
for waiting on a stage with no serving replica. Free failovers are bounded per
job and stage by the stage's replica count. Otherwise the retry spends one of
`stage_retries` (after a short backoff), and the next call waits a bounded time
for a replica to come back before the job fails with UNAVAILABLE naming the stage.

Durability: each finished stage's output (the embeddings, the final latents)
is written to the `JobStore` as the stage ends, and the frames as they stream,
so that an orchestrator restarted at any point resumes the job after its last
finished stage, or serves its stored result. A store failure (the volume full,
say) fails the job with RESOURCE_EXHAUSTED or INTERNAL, naming what could not
be written. `run` needs a store; a pipeline without one serves only tests that
call single stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import torch

from services.metrics import OrchestratorMetrics
from services.orchestrator.cache_namespace import cache_namespace_key, tenant_cache_namespace
from services.orchestrator.jobs import Job, JobState, result_shape, store_failure
from services.orchestrator.stage_clients import StageError, StagePool
from services.orchestrator.store import (
    InvalidTransition,
    JobStore,
    ResultWriter,
    StoreError,
    pack_wire_tensors,
    unpack_wire_tensors,
)
from services.tensor_codec import TensorAssembler, WireError, encode_tensor
from stagediff.v1 import generation_pb2, stages_pb2, tensor_pb2

logger = logging.getLogger(__name__)

_END = None  # closes a relay queue


def _first_stage_error(group: BaseExceptionGroup) -> BaseException:
    """Picks the error to report from a TaskGroup failure: a stage's error over anything else."""
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        else:
            leaves.append(error)

    collect(group)
    return next((e for e in leaves if isinstance(e, StageError)), leaves[0])


class ResultPublisher:
    """Writes the final stage's frame chunks into the job's result file and announces each whole piece.

    Tensors reach the orchestrator in frame order: everything below
    `frames_published` (in the job's intermediates, so it outlives a retried
    attempt) was written and announced, and a retried stage's tensors that end
    there are skipped. A tensor cut half-way by a failed attempt was never
    announced; the retry writes it again from its first byte. Each chunk is
    checked against the result's shape before it is written: a stage that
    sends frames out of order, of another shape or dtype, or more bytes than
    its header announced fails the job (WireError).
    """

    def __init__(self, job: Job, writer: ResultWriter, fps: float, metrics: OrchestratorMetrics | None = None) -> None:
        self.job = job
        self.writer = writer
        self.fps = fps
        self.metrics = metrics
        self.piece: tuple[int, int] | None = None  # (first frame, count) of the tensor being received
        self.skipping = False
        self.received = 0  # bytes of that tensor written so far

    async def publish(self, chunk: tensor_pb2.TensorChunk) -> None:
        published = self.job.intermediates.get("frames_published", 0)
        if chunk.HasField("header"):
            self.piece = self._check_header(chunk.header, published)
            self.received = 0
            self.skipping = sum(self.piece) <= published
        elif self.piece is None:
            raise WireError("a frame chunk arrived before any tensor header")
        if self.skipping:
            return
        first, count = self.piece
        size = count * self.writer.frame_bytes
        end = self.received + len(chunk.data)
        if chunk.offset != self.received or end > size or chunk.last != (end == size):
            raise WireError(
                f"frames {first}..{first + count - 1}: chunk at byte {chunk.offset} of {len(chunk.data)} bytes "
                f"(last={chunk.last}) does not follow byte {self.received} of {size}"
            )
        await asyncio.to_thread(self.writer.write, first, chunk.offset, chunk.data)
        self.received = end
        if not chunk.last:
            return
        self.writer.add_piece(first, count)
        self.job.intermediates["frames_published"] = first + count
        self.piece = None
        if self.metrics is not None:
            self.metrics.add_frames(self.job.tenant, first + count - published)
        await self.job.publish_piece(first, count, self.fps)

    def _check_header(self, header: tensor_pb2.TensorHeader, published: int) -> tuple[int, int]:
        """(first frame, count) of a frame tensor that fits the result; raises WireError otherwise."""
        total, height, width, channels = self.writer.shape
        shape = list(header.shape)
        count = shape[0] if shape else 0
        first = header.index
        if header.datatype != "UINT8" or shape[1:] != [height, width, channels] or count < 1:
            raise WireError(
                f"frames: a {header.datatype} tensor of shape {shape} does not fit the result, "
                f"uint8 [F, {height}, {width}, {channels}]"
            )
        if first < 0 or first + count > total:
            raise WireError(f"frames {first}..{first + count - 1}: the result has {total} frames")
        if first + count > published and first != published:
            raise WireError(f"frames {first}..{first + count - 1}: frame {published} was expected next")
        return first, count


def restore_intermediates(job: Job, stored: dict[str, dict[str, torch.Tensor]]) -> None:
    """Puts the stage outputs a store kept for an unfinished job back where `_run_once` resumes from them."""
    encoded = stored.get("text-encoder")
    if encoded is not None:
        job.intermediates["embeds"] = encoded["embeds"]
        if "embeds_mask" in encoded:
            job.intermediates["embeds_mask"] = encoded["embeds_mask"]
        denoised = stored.get("dit")
        if denoised is not None:
            job.intermediates["latent_chunks"] = unpack_wire_tensors(denoised)
            job.intermediates["latents_complete"] = True


class Pipeline:
    def __init__(
        self,
        stages: StagePool,
        stage_retries: int = 1,
        retry_backoff_s: float = 0.5,
        store: JobStore | None = None,
        metrics: OrchestratorMetrics | None = None,
        cluster_secret: str | None = None,
    ) -> None:
        self.stages = stages
        # Keys each tenant's namespace in the text encoder's embedding cache (services/orchestrator/cache_namespace.py).
        self.cache_namespace_key = cache_namespace_key(cluster_secret)
        self.store = store
        self.metrics = metrics
        # Retries of a stage with no other serving replica; failovers to another replica are free.
        self.stage_retries = stage_retries
        self.retry_backoff_s = retry_backoff_s

    async def run(self, job: Job) -> None:
        """Runs a job to its end and records the outcome on it (never raises, except when cancelled)."""
        if self.store is None:
            raise RuntimeError("Pipeline.run needs a JobStore to write the result into")
        committed = False
        try:
            committed = await self._run_and_store(job)
        finally:
            if job.result is not None and not committed:
                await asyncio.to_thread(job.result.discard)

    async def _run_and_store(self, job: Job) -> bool:
        """The job's run; True once its result is committed to the store."""
        started = time.perf_counter()
        try:
            deadline = asyncio.timeout_at(job.deadline) if job.deadline is not None else contextlib.nullcontext()
            async with deadline:
                job.result = await asyncio.to_thread(self.store.create_result, job.job_id, result_shape(job.request))
                await self._run_with_retries(job)
        except TimeoutError:
            stage = job.current_stage or "the queue"
            await job.finish(
                JobState.JOB_STATE_FAILED, grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded in {stage}"
            )
            return False
        except StageError as error:
            logger.warning("job %s failed: %s", job.job_id, error)
            await job.finish(JobState.JOB_STATE_FAILED, error.code, str(error))
            return False
        except WireError as error:
            await job.finish(JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, f"a stage sent bad data: {error}")
            return False
        except StoreError as error:  # InvalidTransition included: the store no longer holds the job as running
            code, message = store_failure(error, "could not write the job's data")
            logger.error("job %s failed: %s", job.job_id, message)
            await job.finish(JobState.JOB_STATE_FAILED, code, message)
            return False
        job.timings["total"] = time.perf_counter() - started
        job.num_frames_out = int(job.intermediates.get("frames_published", 0))
        if not await self._commit_result(job):
            return False
        await job.publish(
            generation_pb2.GenerateEvent(
                completed=generation_pb2.JobCompleted(
                    timings=job.timings, num_frames=job.num_frames_out, fps=job.fps_out
                )
            )
        )
        await job.finish(JobState.JOB_STATE_SUCCEEDED)
        return True

    async def _commit_result(self, job: Job) -> bool:
        """Completes the result file and marks the job SUCCEEDED in the store, before any client hears it."""
        try:
            await asyncio.to_thread(self.store.commit_result, job.result, job.fps_out, timings=job.timings)
        except InvalidTransition:  # cancelled while the file was being completed
            raise asyncio.CancelledError from None
        except StoreError as error:
            code, message = store_failure(error, "could not store the result")
            logger.error("job %s failed: %s", job.job_id, message)
            await job.finish(JobState.JOB_STATE_FAILED, code, message)
            return False
        except ValueError as error:  # the stages sent fewer frames than the request makes
            await job.finish(
                JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, f"could not store the result: {error}"
            )
            return False
        return True

    async def _stage_done(self, job: Job, stage: str, tensors: dict[str, torch.Tensor]) -> None:
        if self.store is not None:
            await asyncio.to_thread(self.store.mark_stage_done, job.job_id, stage, tensors)

    async def _run_with_retries(self, job: Job) -> None:
        attempt = 0
        failovers: dict[str, int] = {}
        while True:
            try:
                await self._run_once(job)
                return
            except BaseExceptionGroup as group:
                error = _first_stage_error(group)
            except StageError as stage_error:
                error = stage_error
            if not isinstance(error, StageError) or error.code != grpc.StatusCode.UNAVAILABLE:
                raise error
            stage = self.stages[error.stage]
            others = [replica for replica in stage.serving() if replica.endpoint != error.endpoint]
            if others and failovers.get(stage.name, 0) < len(stage.replicas):
                failovers[stage.name] = failovers.get(stage.name, 0) + 1
                if self.metrics is not None:
                    self.metrics.stage_failover(stage.name, error.endpoint)
                logger.info("job %s: %s; failing over to another replica", job.job_id, error)
                continue
            if attempt >= self.stage_retries:
                raise error
            attempt += 1
            if self.metrics is not None:
                self.metrics.stage_retry(stage.name)
            logger.info("job %s: %s; retry %d from the last finished stage", job.job_id, error, attempt)
            await asyncio.sleep(self.retry_backoff_s * attempt)

    def _remaining(self, job: Job) -> float | None:
        if job.deadline is None:
            return None
        return max(0.0, job.deadline - asyncio.get_running_loop().time())

    async def _run_once(self, job: Job) -> None:
        request = job.request
        interpolate = request.interpolation.enable and request.interpolation.exp > 0
        job.fps_out = request.fps * (2**request.interpolation.exp if interpolate else 1)
        if "embeds" not in job.intermediates:
            await self._encode(job)
        latents: asyncio.Queue = asyncio.Queue()
        frames: asyncio.Queue | None = asyncio.Queue() if interpolate else None
        publisher = ResultPublisher(job, job.result, job.fps_out, self.metrics)
        async with asyncio.TaskGroup() as group:
            if job.intermediates.get("latents_complete"):
                for chunk in job.intermediates["latent_chunks"]:
                    latents.put_nowait(chunk)
                latents.put_nowait(_END)
            else:
                group.create_task(self._denoise(job, latents))
            group.create_task(self._decode(job, latents, frames, publisher))
            if frames is not None:
                group.create_task(self._interpolate(job, frames, publisher))

    async def _encode(self, job: Job) -> None:
        request = job.request
        stage = self.stages["text-encoder"]
        texts = [request.prompt]
        if request.guidance_scale > 1.0:
            texts.append(request.negative_prompt)
        job.current_stage = "text-encoder"
        started = time.perf_counter()
        assembler = TensorAssembler()
        tensors: dict[str, torch.Tensor] = {}
        async with stage.call() as replica:
            call = replica.text_encoder.Encode(
                stages_pb2.EncodeRequest(
                    model=request.model,
                    texts=texts,
                    cache_namespace=tenant_cache_namespace(self.cache_namespace_key, job.tenant),
                ),
                timeout=self._remaining(job),
            )
            async for response in call:
                tensor = assembler.feed(response.tensor)
                if tensor is not None:
                    tensors[tensor.name] = tensor.to_torch()
        assembler.finish()
        if "embeds" not in tensors:
            raise StageError("text-encoder", replica.endpoint, grpc.StatusCode.INTERNAL, "sent no embeddings")
        # Families with variable-length embeddings (Qwen-Image) also send their padding mask.
        if "embeds_mask" in tensors:
            job.intermediates["embeds_mask"] = tensors["embeds_mask"]
        job.intermediates["embeds"] = tensors["embeds"]
        job.timings["text-encoder"] = time.perf_counter() - started
        await self._stage_done(
            job, "text-encoder", {name: tensors[name] for name in ("embeds", "embeds_mask") if name in tensors}
        )
        await job.publish(
            generation_pb2.GenerateEvent(progress=generation_pb2.StageProgress(stage="text-encoder", step=1, total=1))
        )

    async def _denoise(self, job: Job, latents: asyncio.Queue) -> None:
        request = job.request
        stage = self.stages["dit"]
        embeds = job.intermediates["embeds"]
        mask = job.intermediates.get("embeds_mask")

        async def requests():
            yield stages_pb2.DenoiseRequest(
                params=stages_pb2.DenoiseParams(
                    model=request.model,
                    height=request.height,
                    width=request.width,
                    num_frames=request.num_frames,
                    num_inference_steps=request.num_inference_steps,
                    guidance_scale=request.guidance_scale,
                    seed=request.seed,
                )
            )
            names = ["prompt_embeds", "negative_prompt_embeds"][: embeds.shape[0]]
            for i, name in enumerate(names):
                for chunk in encode_tensor(name, embeds[i : i + 1]):
                    yield stages_pb2.DenoiseRequest(tensor=chunk)
                if mask is not None:
                    for chunk in encode_tensor(f"{name}_mask", mask[i : i + 1]):
                        yield stages_pb2.DenoiseRequest(tensor=chunk)

        job.current_stage = "dit"
        started = time.perf_counter()
        received: list[tensor_pb2.TensorChunk] = []
        async with stage.call() as replica:
            async for response in replica.denoiser.Denoise(requests(), timeout=self._remaining(job)):
                if response.HasField("progress"):
                    progress = response.progress
                    if self.metrics is not None:
                        self.metrics.add_denoising_steps(job.tenant)
                    await job.publish(
                        generation_pb2.GenerateEvent(
                            progress=generation_pb2.StageProgress(stage="dit", step=progress.step, total=progress.total)
                        )
                    )
                else:
                    received.append(response.tensor)
                    latents.put_nowait(response.tensor)
        job.intermediates["latent_chunks"] = received
        job.intermediates["latents_complete"] = True
        job.timings["dit"] = time.perf_counter() - started
        latents.put_nowait(_END)  # first, so the VAE does not wait for the store
        await self._stage_done(job, "dit", pack_wire_tensors(received))

    async def _decode(
        self, job: Job, latents: asyncio.Queue, frames: asyncio.Queue | None, publisher: ResultPublisher
    ) -> None:
        request = job.request
        stage = self.stages["vae"]
        temporal = stage.info.limits.temporal_factor if stage.info else 4
        num_latent_frames = (request.num_frames - 1) // temporal + 1

        async def requests():
            yield stages_pb2.DecodeRequest(
                params=stages_pb2.DecodeParams(model=request.model, num_latent_frames=num_latent_frames)
            )
            while (chunk := await latents.get()) is not _END:
                yield stages_pb2.DecodeRequest(tensor=chunk)

        started = None
        decoded = 0
        async with stage.call() as replica:
            async for response in replica.vae.Decode(requests(), timeout=self._remaining(job)):
                if started is None:
                    started = time.perf_counter()
                    job.current_stage = "vae"
                if frames is not None:
                    frames.put_nowait(response.tensor)
                else:
                    await publisher.publish(response.tensor)
                if response.tensor.last:
                    decoded += 1
                    await job.publish(
                        generation_pb2.GenerateEvent(
                            progress=generation_pb2.StageProgress(stage="vae", step=decoded, total=num_latent_frames)
                        )
                    )
        job.timings["vae"] = time.perf_counter() - (started or time.perf_counter())
        if frames is not None:
            frames.put_nowait(_END)

    async def _interpolate(self, job: Job, frames: asyncio.Queue, publisher: ResultPublisher) -> None:
        request = job.request
        stage = self.stages["interp"]
        total = (request.num_frames - 1) * 2**request.interpolation.exp + 1

        async def requests():
            yield stages_pb2.InterpolateRequest(
                params=stages_pb2.InterpolateParams(
                    exp=request.interpolation.exp,
                    scale=request.interpolation.scale,
                    model_path=request.interpolation.model_path,
                )
            )
            while (chunk := await frames.get()) is not _END:
                yield stages_pb2.InterpolateRequest(tensor=chunk)

        started = None
        sent = 0
        async with stage.call() as replica:
            async for response in replica.interpolator.Interpolate(requests(), timeout=self._remaining(job)):
                if started is None:
                    started = time.perf_counter()
                    job.current_stage = "interp"
                await publisher.publish(response.tensor)
                if response.tensor.HasField("header"):
                    sent = response.tensor.header.index + response.tensor.header.shape[0]
                if response.tensor.last:
                    await job.publish(
                        generation_pb2.GenerateEvent(
                            progress=generation_pb2.StageProgress(stage="interp", step=sent, total=total)
                        )
                    )
        job.timings["interp"] = time.perf_counter() - (started or time.perf_counter())
