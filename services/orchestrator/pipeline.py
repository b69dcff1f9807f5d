"""One job's trip through the stages of its family's chain: text encoder, DiT, VAE, and interpolator.

The stages a job runs are the served family's chain, less the optional stages
its request leaves off (services/orchestrator/chain.py): Wan runs the
interpolator only when a request asks for interpolation, Qwen-Image never. The
text encoder runs to its end first, so that no DiT replica is held while prompts
are encoded; for a request with input images, the VAE's Encode of them runs at
the same time as the text encoder (its output, "image_latents", joins the
conditioning, kept as the "vae-encode" output). The later stages run at the same time, joined by queues: each
chunk a stage sends is forwarded to the next stage as it arrives (latent frames
from the DiT to the VAE, frames from the VAE to the interpolator), the last
stage's frames go to the result, and nothing waits for the whole video.

The orchestrator relays bytes. What a stage sends travels on as the chunks it
sent: the text encoder names its tensors as the DiT takes them
("prompt_embeds", "negative_prompt_embeds", and their masks where the family
has them), so they go to the DiT verbatim, as the DiT's latent frames go to the
VAE. The orchestrator reads the chunks' headers, never their data as tensors,
and never imports torch; only the final frames are checked against the result's
shape as they are written.

Frames go to disk, not to memory. The result's shape is known when the job
starts, so its file is preallocated in the store, and the final stage's frame
chunks are written at their frame offsets as they arrive (`ResultPublisher`);
each piece, once whole, is announced in the job's log as a `ResultPiece` that
watchers read back from the file. At the end the file is fsynced and renamed
into place with the row that marks the job SUCCEEDED, before the completion
event. A job that fails or is cancelled deletes its partial file.

Every stage call runs on one replica of its stage, chosen by the stage pool
(the serving replica with the fewest calls in flight). With `batch_per_tenant`
(--batch-per-tenant) each Denoise call carries its tenant's opaque batch group,
so that a batched DiT puts it in a batch with the same tenant's requests only. Finished stages leave
their output in `job.intermediates` (the conditioning and the latent chunks), so when
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

Durability: each finished stage's output (the conditioning, the final latents)
is written to the `JobStore`, as the chunks the stage sent, as the stage ends, and the frames as they stream,
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
from collections.abc import Awaitable, Callable

import grpc

from families.base import Family
from services.encoding import RAW, output_format
from services.input_images import ROLE_NAMES
from services.metrics import OrchestratorMetrics
from services.orchestrator.cache_namespace import cache_namespace_key, tenant_cache_namespace
from services.orchestrator.chain import served_family, stages_for
from services.orchestrator.encoded_results import EncodedResult, EncodingError
from services.orchestrator.jobs import Job, JobState, result_shape, store_failure
from services.orchestrator.stage_clients import StageError, StagePool
from services.orchestrator.store import InvalidTransition, JobStore, ResultWriter, StoreError
from stagediff.tensor_codec import WireError
from stagediff.v1 import generation_pb2, image_pb2, stages_pb2, tensor_pb2

logger = logging.getLogger(__name__)

_END = None  # closes a relay queue
# Stages whose whole output a job keeps (in `job.intermediates["outputs"]` and in the store), so that a retry
# or a restart resumes after them: the conditioning and the latents, small next to the frames.
KEPT_OUTPUTS = ("text-encoder", "vae-encode", "dit")
# The VAE's Encode of a request's input images: a call on the VAE stage, kept under its own name.
VAE_ENCODE = "vae-encode"
# Where a relayed stage sends each chunk: the next stage's queue, or the result.
Emit = Callable[[tensor_pb2.TensorChunk], Awaitable[None]]


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

    def __init__(
        self,
        job: Job,
        writer: ResultWriter,
        fps: float,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
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
        if self.job.encoder is not None:  # an encoded output_format: each piece is encoded once written
            await self.job.encoder.add(first, count)

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


def restore_intermediates(job: Job, stored: dict[str, list[tensor_pb2.TensorChunk]]) -> None:
    """Puts the stage outputs a store kept for an unfinished job back where `_run_once` resumes from them."""
    job.intermediates["outputs"] = {stage: chunks for stage, chunks in stored.items() if stage in KEPT_OUTPUTS}


def _tensor_names(chunks: list[tensor_pb2.TensorChunk]) -> list[str]:
    return [chunk.header.name for chunk in chunks if chunk.HasField("header")]


def _check_sent(
    family: Family,
    request: generation_pb2.GenerateRequest,
    stage: str,
    endpoint: str,
    chunks: list[tensor_pb2.TensorChunk],
) -> None:
    """Raises StageError (INTERNAL) when a conditioning stage left out a tensor the DiT needs from it."""
    sent = _tensor_names(chunks)
    guidance, images = request.guidance_scale > 1.0, bool(request.images)
    needed = [slot.name for slot in family.conditioning if slot.source == stage and slot.is_needed(guidance, images)]
    missing = [name for name in needed if name not in sent]
    if missing or (chunks and not chunks[-1].last):
        detail = f"sent no {', '.join(missing)}" if missing else "its stream ended inside a tensor"
        raise StageError(stage, endpoint, grpc.StatusCode.INTERNAL, f"{detail} (sent {sent})")


class Pipeline:
    def __init__(
        self,
        stages: StagePool,
        stage_retries: int = 1,
        retry_backoff_s: float = 0.5,
        store: JobStore | None = None,
        metrics: OrchestratorMetrics | None = None,
        cluster_secret: str | None = None,
        batch_per_tenant: bool = False,
    ) -> None:
        self.stages = stages
        # Whether the DiT may batch one tenant's requests only with the same tenant's (DenoiseParams.batch_group).
        self.batch_per_tenant = batch_per_tenant
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
            if job.encoder is not None:
                job.encoder.close()
            if not committed:
                for file in (job.result, job.encoded):
                    if file is not None:
                        await asyncio.to_thread(file.discard)

    async def _run_and_store(self, job: Job) -> bool:
        """The job's run; True once its result is committed to the store."""
        started = time.perf_counter()
        try:
            deadline = asyncio.timeout_at(job.deadline) if job.deadline is not None else contextlib.nullcontext()
            async with deadline:
                job.result = await asyncio.to_thread(self.store.create_result, job.job_id, result_shape(job.request))
                output = output_format(job.request.output_format)
                if output.name != RAW:
                    job.encoded = await asyncio.to_thread(
                        self.store.create_encoded, job.job_id, output.extension, output.media_type
                    )
                    job.encoder = EncodedResult(job, job.result, job.encoded)
                await self._run_with_retries(job)
                if job.encoder is not None:
                    await job.encoder.finish()
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
        except EncodingError as error:
            logger.error("job %s failed: %s", job.job_id, error)
            await job.finish(JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, str(error))
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
                    timings=job.timings,
                    num_frames=job.num_frames_out,
                    fps=job.fps_out,
                    transformer_passes=job.transformer_passes,
                    media_type=job.encoded.media_type if job.encoded is not None else "",
                    encoded_bytes=job.encoded.size if job.encoded is not None else 0,
                    seed=job.request.seed,
                )
            )
        )
        await job.finish(JobState.JOB_STATE_SUCCEEDED)
        return True

    async def _commit_result(self, job: Job) -> bool:
        """Completes the result file and marks the job SUCCEEDED in the store, before any client hears it."""
        try:
            await asyncio.to_thread(
                self.store.commit_result,
                job.result,
                job.fps_out,
                encoded=job.encoded,
                keep_raw=job.request.keep_raw_frames,
                timings=job.timings,
            )
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

    async def _stage_done(self, job: Job, stage: str, chunks: list[tensor_pb2.TensorChunk]) -> None:
        """Keeps a finished stage's output, in the job and in the store, so that a retry resumes after it."""
        job.intermediates.setdefault("outputs", {})[stage] = chunks
        if self.store is not None:
            passes = job.transformer_passes
            kept = (passes.run, passes.skipped) if stage == "dit" else None
            await asyncio.to_thread(self.store.mark_stage_done, job.job_id, stage, chunks, passes=kept)

    def _family(self) -> Family:
        """The served family, as the DiT says; its chain is what a job runs through."""
        dit = self.stages["dit"]
        family = served_family(dit.info)
        if family is None:
            raise StageError(
                "dit", dit.endpoint, grpc.StatusCode.UNAVAILABLE, "no replica has said which model it serves yet"
            )
        return family

    def _checkpoint_model(self, request: generation_pb2.GenerateRequest) -> str:
        """The model id the stages besides the DiT serve: the request's, unless the DiT serves the checkpoint with
        adapters fused in under another id (--lora; its StageInfo.base_model names the checkpoint)."""
        info = self.stages["dit"].info
        return info.base_model if info is not None and info.base_model else request.model

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
        family = self._family()
        stages = stages_for(family, request)
        job.chain = tuple(stages)
        job.fps_out = request.fps * (2**request.interpolation.exp if "interp" in stages else 1)
        outputs: dict[str, list[tensor_pb2.TensorChunk]] = job.intermediates.setdefault("outputs", {})
        # The conditioning: the text encoder's, and the VAE's encode of the input images, at the same time.
        encode_images = bool(request.images) and "vae" in family.images.encoded_by
        async with asyncio.TaskGroup() as group:
            if "text-encoder" not in outputs:
                group.create_task(self._encode(job, family))
            if encode_images and VAE_ENCODE not in outputs:
                group.create_task(self._encode_images(job, family))
        if request.images and self.store is not None:
            # The conditioning is kept: a retry or a restart resumes from it, never from the images again.
            await asyncio.to_thread(self.store.drop_input_images, job.job_id)
        publisher = ResultPublisher(job, job.result, job.fps_out, self.metrics)
        # The DiT's input is the conditioning; each later stage's is the stage before's output.
        inbox: asyncio.Queue = asyncio.Queue()
        for chunk in [*outputs["text-encoder"], *(outputs[VAE_ENCODE] if encode_images else [])]:
            inbox.put_nowait(chunk)
        inbox.put_nowait(_END)
        relayed = stages[stages.index("dit") :]
        async with asyncio.TaskGroup() as group:
            for position, stage in enumerate(relayed):
                outbox = asyncio.Queue() if position < len(relayed) - 1 else None
                if stage in outputs and outbox is not None:  # finished before a retry or a restart
                    for chunk in outputs[stage]:
                        outbox.put_nowait(chunk)
                    outbox.put_nowait(_END)
                else:
                    group.create_task(self._relay(job, stage, inbox, outbox, publisher))
                inbox = outbox

    async def _relay(
        self,
        job: Job,
        stage: str,
        inbox: asyncio.Queue,
        outbox: asyncio.Queue | None,
        publisher: ResultPublisher,
    ) -> None:
        """Runs one stage call: its input from `inbox`, its output on to `outbox`, or, from the last stage of the
        job's chain, to the result. A stage in KEPT_OUTPUTS has its output kept once it is all sent."""
        kept: list[tensor_pb2.TensorChunk] | None = [] if stage in KEPT_OUTPUTS else None

        async def emit(chunk: tensor_pb2.TensorChunk) -> None:
            if kept is not None:
                kept.append(chunk)
            if outbox is not None:
                outbox.put_nowait(chunk)
            else:
                await publisher.publish(chunk)

        calls = {"dit": self._denoise, "vae": self._decode, "interp": self._interpolate}
        await calls[stage](job, inbox, emit)
        if outbox is not None:
            outbox.put_nowait(_END)  # first, so that the next stage does not wait for the store
        if kept is not None:
            await self._stage_done(job, stage, kept)

    async def _input_images(self, job: Job) -> list[image_pb2.InputImage]:
        """The job's input images with their bytes: from the store, where admission put them (the job itself
        holds their digests and sizes only); a pipeline without a store has them in the request."""
        if self.store is None:
            return list(job.request.images)
        return await asyncio.to_thread(self.store.load_input_images, job.job_id)

    async def _encode(self, job: Job, family: Family) -> None:
        """Runs the text encoder to its end: the DiT's conditioning, as the chunks the text encoder sent."""
        request = job.request
        stage = self.stages["text-encoder"]
        texts = [request.prompt]
        if request.guidance_scale > 1.0:
            texts.append(request.negative_prompt)
        job.current_stage = "text-encoder"
        started = time.perf_counter()
        chunks: list[tensor_pb2.TensorChunk] = []
        images = await self._input_images(job) if "text-encoder" in family.images.encoded_by else []
        async with stage.call() as replica:
            call = replica.text_encoder.Encode(
                stages_pb2.EncodeRequest(
                    model=self._checkpoint_model(request),
                    texts=texts,
                    cache_namespace=tenant_cache_namespace(self.cache_namespace_key, job.tenant),
                    images=images,
                ),
                timeout=self._remaining(job),
            )
            async for response in call:
                chunks.append(response.tensor)
        _check_sent(family, request, "text-encoder", replica.endpoint, chunks)
        job.timings["text-encoder"] = time.perf_counter() - started
        await self._stage_done(job, "text-encoder", chunks)
        await job.publish(
            generation_pb2.GenerateEvent(progress=generation_pb2.StageProgress(stage="text-encoder", step=1, total=1))
        )

    async def _encode_images(self, job: Job, family: Family) -> None:
        """Runs the VAE's Encode of the input images to its end: the DiT's image latents."""
        request = job.request
        started = time.perf_counter()
        chunks: list[tensor_pb2.TensorChunk] = []
        images = await self._input_images(job)
        async with self.stages["vae"].call() as replica:
            call = replica.vae.Encode(
                stages_pb2.VaeEncodeRequest(
                    model=self._checkpoint_model(request),
                    height=request.height,
                    width=request.width,
                    num_frames=request.num_frames,
                    images=images,
                ),
                timeout=self._remaining(job),
            )
            async for response in call:
                chunks.append(response.tensor)
        _check_sent(family, request, "vae", replica.endpoint, chunks)
        job.timings[VAE_ENCODE] = time.perf_counter() - started
        await self._stage_done(job, VAE_ENCODE, chunks)

    def _batch_group(self, job: Job) -> bytes:
        """The job's DenoiseParams.batch_group: its tenant's opaque namespace with --batch-per-tenant, else empty."""
        return tenant_cache_namespace(self.cache_namespace_key, job.tenant) if self.batch_per_tenant else b""

    async def _denoise(self, job: Job, conditioning: asyncio.Queue, emit: Emit) -> None:
        request = job.request
        stage = self.stages["dit"]

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
                    cache=request.cache,
                    loras=request.loras,
                    batch_group=self._batch_group(job),
                    image_roles=[ROLE_NAMES[image.role] for image in request.images],
                    image_sizes=[
                        image_pb2.ImageSize(width=image.width, height=image.height) for image in request.images
                    ],
                )
            )
            while (chunk := await conditioning.get()) is not _END:
                yield stages_pb2.DenoiseRequest(tensor=chunk)

        job.current_stage = "dit"
        started = time.perf_counter()
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
                elif response.HasField("passes"):
                    job.transformer_passes.CopyFrom(response.passes)
                    if self.metrics is not None:
                        self.metrics.add_transformer_passes(job.tenant, request.cache.method, response.passes)
                else:
                    await emit(response.tensor)
        job.timings["dit"] = time.perf_counter() - started

    async def _decode(self, job: Job, latents: asyncio.Queue, emit: Emit) -> None:
        request = job.request
        stage = self.stages["vae"]
        temporal = stage.info.limits.temporal_factor if stage.info else 4
        num_latent_frames = (request.num_frames - 1) // temporal + 1

        async def requests():
            yield stages_pb2.DecodeRequest(
                params=stages_pb2.DecodeParams(
                    model=self._checkpoint_model(request), num_latent_frames=num_latent_frames
                )
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
                await emit(response.tensor)
                if response.tensor.last:
                    decoded += 1
                    await job.publish(
                        generation_pb2.GenerateEvent(
                            progress=generation_pb2.StageProgress(stage="vae", step=decoded, total=num_latent_frames)
                        )
                    )
        job.timings["vae"] = time.perf_counter() - (started or time.perf_counter())

    async def _interpolate(self, job: Job, frames: asyncio.Queue, emit: Emit) -> None:
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
