"""`AsyncClient`: the asyncio client of a StageDiff cluster's Generation API.

Every generate call carries a request id, so a call retried after UNAVAILABLE or RESOURCE_EXHAUSTED (as its
`RetryPolicy` says, stagediff/retries.py) attaches to the same job instead of starting another; a job that
failed is not retried but raised as a `StageDiffError` subclass. A caller that stops waiting cancels its job.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Unpack, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagediff._tracing import trace_context_interceptors
from stagediff.api_keys import resolve_api_key
from stagediff.errors import InternalError, NotFound, StageDiffError, check_endpoint, connection_failure
from stagediff.request import RequestOptions, build_request
from stagediff.results import Event, GenerationResult, ResultBuilder
from stagediff.retries import Retries, RetryPolicy
from stagediff.status_details import retry_after
from stagediff.uploads import with_uploads
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
        """`endpoint` is HOST:PORT, or the addresses of several orchestrator replicas separated by commas (calls
        go to the next one when one is UNAVAILABLE); a URL (`http://...`) raises InvalidEndpoint. A call that
        reaches no StageDiff server raises ConnectionFailed, saying what to do. `timeout` is every call's deadline
        in seconds (None: none); `retry` when calls are tried again.

        The API key (`api_key`, else read from `api_key_file`, else as `resolve_api_key` finds one:
        $STAGEDIFF_API_KEY, $STAGEDIFF_API_KEY_FILE, ~/.config/stagediff/api-key) goes with every call as
        `authorization: Bearer <key>`. With `tls` (implied by `ca_cert`) the channel is TLS, verified against
        `ca_cert` or the system's roots, presenting `client_cert`/`client_key` when the server asks for a client
        certificate."""
        self.endpoint = endpoint
        self.endpoints = [part.strip() for part in endpoint.split(",") if part.strip()]
        if not self.endpoints:
            raise ValueError("endpoint: give HOST:PORT, or several separated by commas (orchestrator replicas)")
        for address in self.endpoints:
            check_endpoint(address)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.metadata = list(metadata or [])
        key = resolve_api_key(api_key, api_key_file)
        if key:
            self.metadata.append(("authorization", f"Bearer {key}"))
        # Each call carries the caller's trace context (W3C traceparent), so its trace spans every stage.
        interceptors = trace_context_interceptors()
        credentials = None
        if tls or ca_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_optional(ca_cert),
                private_key=_read_optional(client_key),
                certificate_chain=_read_optional(client_cert),
            )
        # One channel per orchestrator replica; calls go to one until it is UNAVAILABLE, then to the next.
        self._channels = [
            grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS, interceptors=interceptors)
            if credentials is not None
            else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
            for address in self.endpoints
        ]
        self._stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in self._channels]
        self._current = 0

    @property
    def _channel(self) -> grpc.aio.Channel:
        return self._channels[self._current]

    @property
    def _stub(self) -> generation_pb2_grpc.GenerationStub:
        return self._stubs[self._current]

    def _error(self, error: grpc.aio.AioRpcError) -> StageDiffError:
        """The StageDiffError for a failed call: ConnectionFailed, naming the address and what to do, when it
        reached no StageDiff server; otherwise the class its status code maps to."""
        return connection_failure(error, self.endpoints[self._current]) or StageDiffError.from_rpc_error(error)

    def _after_failure(self, error: grpc.aio.AioRpcError) -> None:
        """Moves on to the next replica's address after an UNAVAILABLE one that did not say when to retry (a
        replica down or leaving); one that did (a takeover under way) answers, and is tried again."""
        if error.code() == grpc.StatusCode.UNAVAILABLE and retry_after(error) is None:
            self._current = (self._current + 1) % len(self._stubs)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close(None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _unary(
        self, method: str | Callable[..., Any], request: Any, timeout: float | None = None, retry: bool = True
    ) -> Any:
        """Calls a unary method (by its name on the stub, or a callable taking the request), retrying UNAVAILABLE
        (on the next replica's address) and RESOURCE_EXHAUSTED as the RetryPolicy says (only with `retry`: a
        call that is safe to repeat)."""
        retries = Retries(self.retry, retry)
        while True:
            call = getattr(self._stub, method) if isinstance(method, str) else method
            try:
                return await call(request, timeout=timeout or self.timeout, metadata=self.metadata)
            except grpc.aio.AioRpcError as error:
                delay = retries.delay(error)
                if delay is None:
                    raise self._error(error) from None
                self._after_failure(error)
                await asyncio.sleep(delay)

    async def _follow(self, open_call: Callable[[], Any], retry: bool = True) -> AsyncIterator[Event]:
        """Yields the typed events of a job's event stream (Generate or WatchJob).

        When the orchestrator is briefly UNAVAILABLE (a restart) the stream is opened again with backoff;
        a job's log replays from its first event, so the result is rebuilt whole. RESOURCE_EXHAUSTED (the
        call refused for load, before any job event) is tried again after the server's retry_after. A job's
        own failure (marked in trailing metadata) is raised at once.
        """
        retries = Retries(self.retry, retry)
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
                    raise self._error(error) from None
                self._after_failure(error)
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
        return await self._unary("Submit", request, timeout, retry=bool(request.request_id))

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
        return await self._unary("GetJob", generation_pb2.GetJobRequest(job_id=job_id))

    async def cancel(self, job_id: str, *, timeout: float | None = None) -> generation_pb2.Job:
        """Cancels a queued or running job (a finished one is left as it is); returns the job. `timeout` is this
        call's deadline in seconds (default: the client's)."""
        return await self._unary("CancelJob", generation_pb2.CancelJobRequest(job_id=job_id), timeout)

    async def delete(self, job_id: str) -> bool:
        """Cancels the job if it is queued or running, then deletes it and its result on the server.
        Returns False when the job was already gone (the server knows no such job of the caller's tenant)."""
        try:
            response = await self._unary("DeleteJob", generation_pb2.DeleteJobRequest(job_id=job_id))
        except NotFound:
            return False
        return response.deleted

    async def list_jobs(self, state: int = 0, limit: int = 0) -> list[generation_pb2.Job]:
        """The tenant's jobs, newest first: those in `state` (a JobState; 0 for every state), at most `limit`
        (0 means 100)."""
        response = await self._unary(
            "ListJobs", generation_pb2.ListJobsRequest(state=cast(generation_pb2.JobState, state), limit=limit)
        )
        return list(response.jobs)

    async def list_models(self) -> list[generation_pb2.ModelDescription]:
        """The served models with their limits and the LoRA adapters the caller's tenant may use."""
        response = await self._unary("ListModels", generation_pb2.ListModelsRequest())
        return list(response.models)

    async def cluster_info(self) -> generation_pb2.ClusterInfo:
        """Every stage of the cluster: its replicas, their health, model, device and parallel configuration."""
        return await self._unary("GetClusterInfo", generation_pb2.GetClusterInfoRequest())

    async def health(self, service: str = "") -> str:
        """The orchestrator's grpc.health.v1 status name, e.g. SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = await self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
