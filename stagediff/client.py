"""The Python SDK: `AsyncClient` and its blocking twin `Client`.

    from stagediff import Client
    with Client("localhost:50051") as client:
        result = client.generate("a red fox in the snow", height=64, width=64, num_frames=9, seed=7)
        result.save("fox.mp4")

`generate` streams the job's events and assembles the frames as they arrive;
progress comes through `on_progress` or, one event at a time, from `stream`.
Every generate call carries a request id, so a call retried after UNAVAILABLE
(the orchestrator restarting, a dropped connection) attaches to the same job
instead of starting another. A job that failed is not retried: its error is
raised as `StageDiffError` with the status code the server gave.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagediff._tracing import trace_context_interceptors
from stagediff.media import ImageLike, encode_image
from stagediff.protocol import API_KEY_ENV, JOB_FAILED_METADATA_KEY
from stagediff.status_details import retry_after
from stagediff.tensor_codec import TensorAssembler
from stagediff.v1 import generation_pb2, generation_pb2_grpc, image_pb2

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    # An orchestrator that restarts is back within seconds: reconnect within a second of it, not after
    # grpc's default backoff (which grows to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# How long cancelling an abandoned job may take before the caller's interrupt or cancel goes on.
CANCEL_TIMEOUT_S = 5.0


class StageDiffError(Exception):
    """A call failed; `code` is the gRPC status, `message` the server's explanation.

    `retry_after` is the server's RetryInfo in seconds (RESOURCE_EXHAUSTED: a full queue, a quota, a
    rate limit), or None when it gave none.
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after

    @classmethod
    def from_rpc_error(cls, error: grpc.aio.AioRpcError) -> StageDiffError:
        return cls(error.code(), error.details() or "", retry_after(error))


@dataclass
class Queued:
    job_id: str
    position: int


@dataclass
class Progress:
    job_id: str
    stage: str
    step: int
    total: int


@dataclass
class FramesReceived:
    job_id: str
    first_frame: int
    count: int


@dataclass
class GenerationResult:
    job_id: str
    frames: np.ndarray  # uint8 [F, H, W, 3]
    fps: float
    timings: dict[str, float] = field(default_factory=dict)
    # Transformer passes (one per step and guidance branch) the DiT ran in full, and those its step cache skipped.
    passes_run: int = 0
    passes_skipped: int = 0

    def save(self, path: str | Path) -> Path:
        """Writes .mp4 (H.264), .png (one frame) or .npz (lossless `frames` and `fps`)."""
        from stagediff.media import save_frames

        return save_frames(path, self.frames, self.fps)


Event = Queued | Progress | FramesReceived | GenerationResult


@dataclass
class RetryPolicy:
    """Exponential backoff for UNAVAILABLE: initial, initial*multiplier, ... capped at maximum.

    The default waits about 24 s in all (0.5, 1, 2, 4, 8, 8), enough to ride out an orchestrator restart.
    """

    max_attempts: int = 7
    initial_backoff_s: float = 0.5
    multiplier: float = 2.0
    max_backoff_s: float = 8.0

    def delays(self) -> Iterator[float]:
        delay = self.initial_backoff_s
        for _ in range(self.max_attempts - 1):
            yield delay
            delay = min(delay * self.multiplier, self.max_backoff_s)


def build_request(
    prompt: str,
    *,
    model: str = "",
    negative_prompt: str = "",
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    num_inference_steps: int | None = None,
    guidance_scale: float | None = None,
    seed: int | None = None,
    fps: float | None = None,
    interp_exp: int = 0,
    interp_scale: float = 0.0,
    interp_model_path: str = "",
    request_id: str | None = None,
    image: ImageLike | None = None,
    last_image: ImageLike | None = None,
    reference_images: Sequence[ImageLike] = (),
    cache: str | None = None,
    cache_threshold: float | None = None,
    loras: Mapping[str, float] | Sequence[str | tuple[str, float]] = (),
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest; arguments left None take the model's defaults on the server.

    `loras` are LoRA adapters applied to this request only: {name: scale}, or names (scale 1) and (name, scale)
    pairs, from those ListModels shows the tenant (`ModelLimits.loras`).

    `cache` is the DiT's step cache for this request ("none", or a method the model lists in
    `ModelLimits.cache_methods`: "first_block", "mag", "teacache"), `cache_threshold` its threshold (higher
    skips more); left None, the server's defaults.

    `image` is the first frame of image-to-video (or, for an editing model, the image to edit: the
    model's first role), `last_image` the last frame where the model takes one, `reference_images` the
    images of a model that takes references. Each is a path, bytes, a PIL image or a uint8 array.
    """
    request = generation_pb2.GenerateRequest(
        model=model, prompt=prompt, negative_prompt=negative_prompt, request_id=request_id or uuid.uuid4().hex
    )
    for value, role in (
        (image, image_pb2.IMAGE_ROLE_UNSPECIFIED),
        (last_image, image_pb2.IMAGE_ROLE_LAST_FRAME),
        *((reference, image_pb2.IMAGE_ROLE_REFERENCE) for reference in reference_images),
    ):
        if value is not None:
            request.images.add(data=encode_image(value), role=role)
    for name, value in (
        ("height", height),
        ("width", width),
        ("num_frames", num_frames),
        ("num_inference_steps", num_inference_steps),
        ("guidance_scale", guidance_scale),
        ("seed", seed),
        ("fps", fps),
    ):
        if value is not None:
            setattr(request, name, value)
    if cache is not None:
        request.cache.method = cache
    if cache_threshold is not None:
        request.cache.threshold = cache_threshold
    for lora in loras.items() if isinstance(loras, Mapping) else loras:
        name, scale = (lora, None) if isinstance(lora, str) else lora
        adapter = request.loras.add(name=name)
        if scale is not None:
            adapter.scale = scale
    if interp_exp:
        request.interpolation.enable = True
        request.interpolation.exp = interp_exp
        request.interpolation.scale = interp_scale
        request.interpolation.model_path = interp_model_path
    return request


class _ResultBuilder:
    """Turns a job's event stream into typed events and, at the end, a GenerationResult."""

    def __init__(self) -> None:
        self.assembler = TensorAssembler()
        self.pieces: dict[int, np.ndarray] = {}
        self.fps = 0.0

    def consume(self, event: generation_pb2.GenerateEvent) -> Event | None:
        kind = event.WhichOneof("event")
        if kind == "queued":
            return Queued(event.job_id, event.queued.position)
        if kind == "progress":
            return Progress(event.job_id, event.progress.stage, event.progress.step, event.progress.total)
        if kind == "result":
            self.fps = event.result.fps
            tensor = self.assembler.feed(event.result.tensor)
            if tensor is None:
                return None
            self.pieces[tensor.index] = tensor.array
            return FramesReceived(event.job_id, tensor.index, tensor.shape[0])
        if kind == "completed":
            self.assembler.finish()
            frames = [self.pieces[index] for index in sorted(self.pieces)]
            video = np.concatenate(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8)
            if video.shape[0] != event.completed.num_frames:
                raise StageDiffError(
                    grpc.StatusCode.DATA_LOSS,
                    f"received {video.shape[0]} frames, the server reported {event.completed.num_frames}",
                )
            completed = event.completed
            return GenerationResult(
                event.job_id,
                video,
                completed.fps,
                dict(completed.timings),
                passes_run=completed.transformer_passes.run,
                passes_skipped=completed.transformer_passes.skipped,
            )
        return None


def _is_job_outcome(error: grpc.aio.AioRpcError) -> bool:
    metadata = error.trailing_metadata() or ()
    return any(key == JOB_FAILED_METADATA_KEY for key, _ in metadata)


def _read_optional(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


class AsyncClient:
    """asyncio client of a StageDiff cluster's Generation API."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        metadata: list[tuple[str, str]] | None = None,
        api_key: str | None = None,
        tls: bool = False,
        ca_cert: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
    ) -> None:
        """`api_key` (default: $STAGEDIFF_API_KEY) goes with every call as `authorization: Bearer <key>`.
        With `tls` (implied by `ca_cert`) the channel is TLS, verified against `ca_cert` or the system's
        roots, presenting `client_cert`/`client_key` when the server asks for a client certificate."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.metadata = list(metadata or [])
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        if api_key:
            self.metadata.append(("authorization", f"Bearer {api_key}"))
        # Each call carries the caller's trace context (W3C traceparent), so its trace spans every stage.
        interceptors = trace_context_interceptors()
        if tls or ca_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_optional(ca_cert),
                private_key=_read_optional(client_key),
                certificate_chain=_read_optional(client_cert),
            )
            self._channel = grpc.aio.secure_channel(
                endpoint, credentials, options=CHANNEL_OPTIONS, interceptors=interceptors
            )
        else:
            self._channel = grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS, interceptors=interceptors)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None = None) -> Any:
        """Calls a unary method, retrying UNAVAILABLE with backoff."""
        delays = self.retry.delays()
        while True:
            try:
                return await method(request, timeout=timeout or self.timeout, metadata=self.metadata)
            except grpc.aio.AioRpcError as error:
                delay = next(delays, None) if error.code() == grpc.StatusCode.UNAVAILABLE else None
                if delay is None:
                    raise StageDiffError.from_rpc_error(error) from None
                await asyncio.sleep(delay)

    async def _follow(self, open_call: Callable[[], Any]) -> AsyncIterator[Event]:
        """Yields the typed events of a job's event stream (Generate or WatchJob).

        When the orchestrator is briefly UNAVAILABLE (a restart) the stream is opened again with backoff;
        a job's log replays from its first event, so the result is rebuilt whole. A job's own failure
        (marked in trailing metadata) is raised at once.
        """
        delays = self.retry.delays()
        while True:
            builder = _ResultBuilder()
            try:
                async for event in open_call():
                    typed = builder.consume(event)
                    if typed is not None:
                        yield typed
                return
            except grpc.aio.AioRpcError as error:
                retryable = error.code() == grpc.StatusCode.UNAVAILABLE and not _is_job_outcome(error)
                delay = next(delays, None) if retryable else None
                if delay is None:
                    raise StageDiffError.from_rpc_error(error) from None
                await asyncio.sleep(delay)

    async def stream(self, prompt: str, *, timeout: float | None = None, **arguments: Any) -> AsyncIterator[Event]:
        """Generates and yields Queued, Progress and FramesReceived events, then the GenerationResult.

        A dropped connection is retried with the same request id, which attaches to the same job (the
        orchestrator keeps it running for a grace period). When the caller stops instead (the task is
        cancelled, or the stream is closed before the result), the job is cancelled with CancelJob, so
        its stages stop at once.
        """
        request = build_request(prompt, **arguments)
        job_id = ""
        try:
            async for event in self._follow(
                lambda: self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self.metadata)
            ):
                job_id = event.job_id
                if isinstance(event, GenerationResult):
                    job_id = ""  # finished: nothing to cancel
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            if job_id:
                await self._cancel_abandoned(job_id)
            raise

    async def _cancel_abandoned(self, job_id: str) -> None:
        """Cancels a job its caller stopped waiting for; best effort (the server's grace period is the backstop)."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.CancelJob(
                generation_pb2.CancelJobRequest(job_id=job_id), timeout=CANCEL_TIMEOUT_S, metadata=self.metadata
            )

    @staticmethod
    async def _result(events: AsyncIterator[Event], on_progress: Callable[[Event], None] | None) -> GenerationResult:
        async for event in events:
            if isinstance(event, GenerationResult):
                return event
            if on_progress is not None:
                on_progress(event)
        raise StageDiffError(grpc.StatusCode.DATA_LOSS, "the stream ended without a result")

    async def generate(
        self,
        prompt: str,
        *,
        on_progress: Callable[[Event], None] | None = None,
        timeout: float | None = None,
        **arguments: Any,
    ) -> GenerationResult:
        """Generates a video (or image) and returns it once every frame has arrived."""
        return await self._result(self.stream(prompt, timeout=timeout, **arguments), on_progress)

    async def submit(self, prompt: str, **arguments: Any) -> generation_pb2.Job:
        """Queues a job and returns at once; the request id makes a retried submit return the same job."""
        return await self._unary(self._stub.Submit, build_request(prompt, **arguments))

    async def wait(
        self, job_id: str, *, on_progress: Callable[[Event], None] | None = None, timeout: float | None = None
    ) -> GenerationResult:
        """Follows a submitted job to its end and returns its result; reattaches (from the job's first event)
        when the orchestrator is briefly UNAVAILABLE, e.g. while it restarts."""
        request = generation_pb2.WatchJobRequest(job_id=job_id)
        events = self._follow(
            lambda: self._stub.WatchJob(request, timeout=timeout or self.timeout, metadata=self.metadata)
        )
        return await self._result(events, on_progress)

    async def get_job(self, job_id: str) -> generation_pb2.Job:
        return await self._unary(self._stub.GetJob, generation_pb2.GetJobRequest(job_id=job_id))

    async def cancel(self, job_id: str) -> generation_pb2.Job:
        return await self._unary(self._stub.CancelJob, generation_pb2.CancelJobRequest(job_id=job_id))

    async def list_jobs(self, state: int = 0, limit: int = 0) -> list[generation_pb2.Job]:
        response = await self._unary(self._stub.ListJobs, generation_pb2.ListJobsRequest(state=state, limit=limit))
        return list(response.jobs)

    async def list_models(self) -> list[generation_pb2.ModelDescription]:
        response = await self._unary(self._stub.ListModels, generation_pb2.ListModelsRequest())
        return list(response.models)

    async def cluster_info(self) -> generation_pb2.ClusterInfo:
        return await self._unary(self._stub.GetClusterInfo, generation_pb2.GetClusterInfoRequest())

    async def health(self, service: str = "") -> str:
        """The orchestrator's grpc.health.v1 status name, e.g. SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = await self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class Client:
    """Blocking client: runs an AsyncClient on a private event-loop thread."""

    def __init__(self, endpoint: str, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stagediff-client", daemon=True)
        self._thread.start()
        self._async = self._call(self._make(endpoint, options))

    @staticmethod
    async def _make(endpoint: str, options: dict[str, Any]) -> AsyncClient:
        return AsyncClient(endpoint, **options)

    def _call(self, coroutine: Any) -> Any:
        """Runs `coroutine` on the client's loop; an interrupt (Ctrl-C) cancels it and waits for its cleanup,
        so that a job the call started is cancelled on the server before the interrupt goes on."""
        finished = threading.Event()

        async def run() -> Any:
            try:
                return await coroutine
            finally:
                finished.set()

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            finished.wait(CANCEL_TIMEOUT_S)
            raise

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self._async.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt: str, **arguments: Any) -> GenerationResult:
        return self._call(self._async.generate(prompt, **arguments))

    def stream(self, prompt: str, **arguments: Any) -> Iterator[Event]:
        """Yields events as they arrive (the progress iterator), the GenerationResult last."""
        agen = self._async.stream(prompt, **arguments)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            # Closed early by the caller: the async stream cancels its job.
            self._call(agen.aclose())

    def submit(self, prompt: str, **arguments: Any) -> generation_pb2.Job:
        return self._call(self._async.submit(prompt, **arguments))

    def wait(self, job_id: str, **options: Any) -> GenerationResult:
        return self._call(self._async.wait(job_id, **options))

    def get_job(self, job_id: str) -> generation_pb2.Job:
        return self._call(self._async.get_job(job_id))

    def cancel(self, job_id: str) -> generation_pb2.Job:
        return self._call(self._async.cancel(job_id))

    def list_jobs(self, state: int = 0, limit: int = 0) -> list[generation_pb2.Job]:
        return self._call(self._async.list_jobs(state, limit))

    def list_models(self) -> list[generation_pb2.ModelDescription]:
        return self._call(self._async.list_models())

    def cluster_info(self) -> generation_pb2.ClusterInfo:
        return self._call(self._async.cluster_info())

    def health(self, service: str = "") -> str:
        return self._call(self._async.health(service))
