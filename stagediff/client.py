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

This module holds the blocking `Client` and names the SDK's public surface (`__all__`); `AsyncClient` is in
async_client.py, `RetryPolicy` in retries.py, `resolve_api_key` in api_keys.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any, Unpack

from stagediff.api_keys import resolve_api_key
from stagediff.async_client import CANCEL_TIMEOUT_S, AsyncClient
from stagediff.errors import (
    AuthenticationError,
    Cancelled,
    ConnectionFailed,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    InvalidEndpoint,
    NotFound,
    PermissionDenied,
    RateLimitError,
    StageDiffError,
    Unavailable,
)
from stagediff.interrupts import interrupts_ignored
from stagediff.request import RequestOptions, build_request
from stagediff.results import (
    BytesReceived,
    Event,
    FramesReceived,
    GenerationResult,
    Notice,
    Paused,
    Progress,
    Queued,
    Resumed,
)
from stagediff.retries import RetryPolicy
from stagediff.v1 import generation_pb2

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "BytesReceived",
    "Cancelled",
    "Client",
    "ConnectionFailed",
    "DeadlineExceeded",
    "Event",
    "FailedPrecondition",
    "FramesReceived",
    "GenerationResult",
    "InternalError",
    "InvalidArgument",
    "InvalidEndpoint",
    "NotFound",
    "Notice",
    "Paused",
    "PermissionDenied",
    "Progress",
    "Queued",
    "Resumed",
    "RateLimitError",
    "RetryPolicy",
    "StageDiffError",
    "Unavailable",
    "RequestOptions",
    "build_request",
    "resolve_api_key",
]


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
        """Runs `coroutine` on the client's loop; an interrupt (Ctrl-C) cancels it and waits for its cleanup
        (at most CANCEL_TIMEOUT_S, further interrupts ignored meanwhile), so that a job the call started is
        cancelled on the server before the interrupt goes on."""
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
            # A second Ctrl-C must not abandon the cancel (the job would run on for the server's grace period).
            with interrupts_ignored():
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

    def cancel(self, job_id: str, *, timeout: float | None = None) -> generation_pb2.Job:
        return self._call(self._async.cancel(job_id, timeout=timeout))

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
