"""The Python SDK: `AsyncClient` and its blocking twin `Client`.

    from stagediff import Client
    with Client("localhost:50051") as client:
        result = client.generate("a red fox in the snow", height=64, width=64, num_frames=9, seed=7)
        result.save("fox.mp4")

`generate` streams the job's events and assembles the result as it arrives (raw frames, or the file the
server encoded when the request names an `output_format`); progress comes through `on_progress` or, one
event at a time, from `stream`. Every generate call carries a request id, so a call retried after
UNAVAILABLE (the orchestrator restarting, a dropped connection) or after RESOURCE_EXHAUSTED (a rate limit,
a full queue: after the wait the server asks for) attaches to the same job instead of starting another. A
job that failed is not retried: its error is raised as a `StageDiffError` subclass chosen by the status
code the server gave (stagediff/errors.py). docs/sdk.md is the reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagediff._tracing import trace_context_interceptors
from stagediff.errors import (
    AuthenticationError,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    RateLimitError,
    StageDiffError,
    Unavailable,
)
from stagediff.protocol import API_KEY_ENV, API_KEY_FILE_ENV, DEFAULT_API_KEY_FILE, JOB_FAILED_METADATA_KEY
from stagediff.request import RequestOptions, build_request
from stagediff.results import (
    BytesReceived,
    Event,
    FramesReceived,
    GenerationResult,
    Progress,
    Queued,
    ResultBuilder,
)
from stagediff.status_details import retry_after
from stagediff.uploads import with_uploads
from stagediff.v1 import generation_pb2, generation_pb2_grpc, image_pb2

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "BytesReceived",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "Event",
    "FailedPrecondition",
    "FramesReceived",
    "GenerationResult",
    "InternalError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "Progress",
    "Queued",
    "RateLimitError",
    "RetryPolicy",
    "StageDiffError",
    "Unavailable",
    "RequestOptions",
    "build_request",
    "resolve_api_key",
]

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


@dataclass
class RetryPolicy:
    """When a call is tried again.

    UNAVAILABLE (the orchestrator restarting, a dropped connection): exponential backoff, initial,
    initial*multiplier, ... capped at maximum, for `max_attempts` tries in all. The default waits about 24 s
    in all (0.5, 1, 2, 4, 8, 8), enough to ride out an orchestrator restart.

    RESOURCE_EXHAUSTED (a rate limit, a full queue): up to `rate_limit_retries` more tries, each after the
    server's RetryInfo delay (or, where it gave none, the backoff above), as long as the waits add up to at
    most `rate_limit_max_wait_s`; a delay that would go past it ends the retries at once and raises
    RateLimitError with the server's `retry_after`. 0 retries disables them.

    Generate, Submit and the job calls are retried only when safe: a generate call carries a request id,
    so a retry attaches to the job the first try made. A job's own failure is never retried.
    """

    max_attempts: int = 7
    initial_backoff_s: float = 0.5
    multiplier: float = 2.0
    max_backoff_s: float = 8.0
    rate_limit_retries: int = 3
    rate_limit_max_wait_s: float = 60.0

    def delays(self) -> Iterator[float]:
        """The backoff before each UNAVAILABLE retry: max_attempts - 1 delays."""
        delay = self.initial_backoff_s
        for _ in range(self.max_attempts - 1):
            yield delay
            delay = min(delay * self.multiplier, self.max_backoff_s)


class _Retries:
    """The retries left to one call under a RetryPolicy."""

    def __init__(self, policy: RetryPolicy, allowed: bool = True) -> None:
        self.policy = policy
        self.allowed = allowed
        self.unavailable_delays = policy.delays()
        self.rate_limit_tries = 0
        self.rate_limit_waited = 0.0

    def delay(self, error: grpc.aio.AioRpcError) -> float | None:
        """Seconds to wait before trying the call again after `error`, or None to give up and raise it."""
        if not self.allowed or _is_job_outcome(error):
            return None
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            return next(self.unavailable_delays, None)
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return None
        if self.rate_limit_tries >= self.policy.rate_limit_retries:
            return None
        wait = retry_after(error)
        if wait is None:
            backoff = self.policy.initial_backoff_s * self.policy.multiplier**self.rate_limit_tries
            wait = min(backoff, self.policy.max_backoff_s)
        if self.rate_limit_waited + wait > self.policy.rate_limit_max_wait_s:
            return None
        self.rate_limit_tries += 1
        self.rate_limit_waited += wait
        return wait


def resolve_api_key(api_key: str | None = None, api_key_file: str | Path | None = None) -> str | None:
    """The API key a client sends, from the first of: `api_key`; the file `api_key_file`; $STAGEDIFF_API_KEY;
    the file $STAGEDIFF_API_KEY_FILE names; ~/.config/stagediff/api-key when it exists. None when there is none.

    A file holds the key alone (surrounding whitespace and a final newline are ignored).
    """
    if api_key is not None:
        return api_key or None
    if api_key_file is not None:
        return _read_api_key(Path(api_key_file).expanduser(), "api_key_file")
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV]
    if os.environ.get(API_KEY_FILE_ENV):
        return _read_api_key(Path(os.environ[API_KEY_FILE_ENV]).expanduser(), f"${API_KEY_FILE_ENV}")
    default = Path(DEFAULT_API_KEY_FILE).expanduser()
    return _read_api_key(default, DEFAULT_API_KEY_FILE) if default.is_file() else None


def _read_api_key(path: Path, name: str) -> str:
    try:
        key = path.read_text().strip()
    except OSError as error:
        raise ValueError(f"{name}: cannot read the API key file {path}: {error.strerror or error}") from None
    if not key or any(character.isspace() for character in key):
        raise ValueError(f"{name}: {path} must hold the API key alone, on one line")
    return key


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
        api_key_file: str | Path | None = None,
        tls: bool = False,
        ca_cert: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
    ) -> None:
        """`timeout` is every call's deadline in seconds (None: none); `retry` when calls are tried again.

        The API key (`api_key`, else read from `api_key_file`, else as `resolve_api_key` finds one:
        $STAGEDIFF_API_KEY, $STAGEDIFF_API_KEY_FILE, ~/.config/stagediff/api-key) goes with every call as
        `authorization: Bearer <key>`. With `tls` (implied by `ca_cert`) the channel is TLS, verified against
        `ca_cert` or the system's roots, presenting `client_cert`/`client_key` when the server asks for a client
        certificate."""
        self.endpoint = endpoint
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.metadata = list(metadata or [])
        key = resolve_api_key(api_key, api_key_file)
        if key:
            self.metadata.append(("authorization", f"Bearer {key}"))
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

    async def _unary(
        self, method: Callable[..., Any], request: Any, timeout: float | None = None, retry: bool = True
    ) -> Any:
        """Calls a unary method, retrying UNAVAILABLE and RESOURCE_EXHAUSTED as the RetryPolicy says (only
        with `retry`: a call that is safe to repeat)."""
        retries = _Retries(self.retry, retry)
        while True:
            try:
                return await method(request, timeout=timeout or self.timeout, metadata=self.metadata)
            except grpc.aio.AioRpcError as error:
                delay = retries.delay(error)
                if delay is None:
                    raise StageDiffError.from_rpc_error(error) from None
                await asyncio.sleep(delay)

    async def _follow(self, open_call: Callable[[], Any], retry: bool = True) -> AsyncIterator[Event]:
        """Yields the typed events of a job's event stream (Generate or WatchJob).

        When the orchestrator is briefly UNAVAILABLE (a restart) the stream is opened again with backoff;
        a job's log replays from its first event, so the result is rebuilt whole. RESOURCE_EXHAUSTED (the
        call refused for load, before any job event) is tried again after the server's retry_after. A job's
        own failure (marked in trailing metadata) is raised at once.
        """
        retries = _Retries(self.retry, retry)
        while True:
            builder = ResultBuilder()
            try:
                async for event in open_call():
                    for typed in builder.consume(event):
                        yield typed
                return
            except grpc.aio.AioRpcError as error:
                delay = retries.delay(error)
                if delay is None:
                    raise StageDiffError.from_rpc_error(error) from None
                await asyncio.sleep(delay)

    async def _with_uploads(
        self, request: generation_pb2.GenerateRequest, timeout: float | None
    ) -> generation_pb2.GenerateRequest:
        """`request` with its large images sent ahead through UploadImage (stagediff/uploads.py)."""

        async def upload(chunks: list[image_pb2.ImageUploadChunk]) -> image_pb2.UploadedImage:
            return await self._unary(lambda sent, **call: self._stub.UploadImage(iter(sent), **call), chunks, timeout)

        return await with_uploads(request, upload)

    async def _submit_request(
        self, request: generation_pb2.GenerateRequest, timeout: float | None
    ) -> generation_pb2.Job:
        request = await self._with_uploads(request, timeout)
        return await self._unary(self._stub.Submit, request, timeout, retry=bool(request.request_id))

    async def _stream_request(
        self, request: generation_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[Event]:
        """Runs Generate for `request`, yielding its events; a caller that stops early cancels the job."""
        job_id = ""
        request = await self._with_uploads(request, timeout)
        try:
            async for event in self._follow(
                lambda: self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self.metadata),
                retry=bool(request.request_id),
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
        raise InternalError(grpc.StatusCode.DATA_LOSS, "the stream ended without a result")

    async def stream(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncIterator[Event]:
        """Generates and yields Queued, Progress, FramesReceived and BytesReceived events, then the
        GenerationResult. `options` are the request's keywords (RequestOptions, stagediff/request.py); `timeout` is this
        call's deadline in seconds (default: the client's).

        A dropped connection is retried with the same request id, which attaches to the same job (the
        orchestrator keeps it running for a grace period). When the caller stops instead (the task is
        cancelled, or the stream is closed before the result), the job is cancelled with CancelJob, so
        its stages stop at once.
        """
        request = build_request(prompt, **options)
        async for event in self._stream_request(request, timeout):
            yield event

    async def generate(
        self,
        prompt: str,
        *,
        on_progress: Callable[[Event], None] | None = None,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> GenerationResult:
        """Generates a video (or image) and returns it once the whole result has arrived.

        `options` are the request's keywords (RequestOptions, stagediff/request.py). `on_progress` is called
        with every Queued, Progress, FramesReceived and BytesReceived event; `timeout` is this call's deadline in
        seconds (default: the client's). Raises a StageDiffError subclass when the call or the job fails.
        """
        request = build_request(prompt, **options)
        return await self._result(self._stream_request(request, timeout), on_progress)

    async def submit(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> generation_pb2.Job:
        """Queues a job and returns it at once (follow it with `wait`, `get_job`); the request's keywords are
        `build_request`'s. The request id makes a retried submit return the same job."""
        return await self._submit_request(build_request(prompt, **options), timeout)

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
        """The job: its state, the request with every default filled in, its progress, timings or error."""
        return await self._unary(self._stub.GetJob, generation_pb2.GetJobRequest(job_id=job_id))

    async def cancel(self, job_id: str) -> generation_pb2.Job:
        """Cancels a queued or running job (a finished one is left as it is); returns the job."""
        return await self._unary(self._stub.CancelJob, generation_pb2.CancelJobRequest(job_id=job_id))

    async def delete(self, job_id: str) -> bool:
        """Cancels the job if it is queued or running, then deletes it and its result on the server.
        Returns False when the job was already gone."""
        response = await self._unary(self._stub.DeleteJob, generation_pb2.DeleteJobRequest(job_id=job_id))
        return response.deleted

    async def list_jobs(self, state: int = 0, limit: int = 0) -> list[generation_pb2.Job]:
        """The tenant's jobs, newest first: those in `state` (a JobState; 0 for every state), at most `limit`
        (0 means 100)."""
        response = await self._unary(self._stub.ListJobs, generation_pb2.ListJobsRequest(state=state, limit=limit))
        return list(response.jobs)

    async def list_models(self) -> list[generation_pb2.ModelDescription]:
        """The served models with their limits and the LoRA adapters the caller's tenant may use."""
        response = await self._unary(self._stub.ListModels, generation_pb2.ListModelsRequest())
        return list(response.models)

    async def cluster_info(self) -> generation_pb2.ClusterInfo:
        """Every stage of the cluster: its replicas, their health, model, device and parallel configuration."""
        return await self._unary(self._stub.GetClusterInfo, generation_pb2.GetClusterInfoRequest())

    async def health(self, service: str = "") -> str:
        """The orchestrator's grpc.health.v1 status name, e.g. SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = await self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class Client:
    """Blocking client: runs an AsyncClient on a private event-loop thread. Its methods are AsyncClient's."""

    def __init__(self, endpoint: str, **options: Any) -> None:
        """The options are AsyncClient's (timeout, retry, metadata, api_key, api_key_file, tls, ca_cert,
        client_cert, client_key)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stagediff-client", daemon=True)
        self._thread.start()
        try:
            self._async = self._call(self._make(endpoint, options))
        except BaseException:
            self._stop_loop()
            raise

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

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self._async.close())
            self._stop_loop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompt: str,
        *,
        on_progress: Callable[[Event], None] | None = None,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> GenerationResult:
        """Generates a video (or image) and returns it once the whole result has arrived (AsyncClient.generate).
        `on_progress` is called on the client's own thread."""
        request = build_request(prompt, **options)
        return self._call(self._async._result(self._async._stream_request(request, timeout), on_progress))

    def stream(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> Iterator[Event]:
        """Yields events as they arrive (the progress iterator), the GenerationResult last (AsyncClient.stream).
        Closing the iterator before the result cancels the job."""
        request = build_request(prompt, **options)
        agen = self._async._stream_request(request, timeout)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            # Closed early by the caller: the async stream cancels its job.
            self._call(agen.aclose())

    def submit(
        self,
        prompt: str,
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> generation_pb2.Job:
        """Queues a job and returns it at once (AsyncClient.submit)."""
        return self._call(self._async._submit_request(build_request(prompt, **options), timeout))

    def wait(
        self, job_id: str, *, on_progress: Callable[[Event], None] | None = None, timeout: float | None = None
    ) -> GenerationResult:
        """Follows a submitted job to its end and returns its result (AsyncClient.wait)."""
        return self._call(self._async.wait(job_id, on_progress=on_progress, timeout=timeout))

    def get_job(self, job_id: str) -> generation_pb2.Job:
        return self._call(self._async.get_job(job_id))

    def cancel(self, job_id: str) -> generation_pb2.Job:
        return self._call(self._async.cancel(job_id))

    def delete(self, job_id: str) -> bool:
        return self._call(self._async.delete(job_id))

    def list_jobs(self, state: int = 0, limit: int = 0) -> list[generation_pb2.Job]:
        return self._call(self._async.list_jobs(state, limit))

    def list_models(self) -> list[generation_pb2.ModelDescription]:
        return self._call(self._async.list_models())

    def cluster_info(self) -> generation_pb2.ClusterInfo:
        return self._call(self._async.cluster_info())

    def health(self, service: str = "") -> str:
        return self._call(self._async.health(service))
