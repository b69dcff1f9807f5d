"""The SDK against an in-process fake Generation service: retries, typed events, errors, trace context."""

from __future__ import annotations

import asyncio
import http.server
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from stagediff import Client, ConnectionFailed, InvalidEndpoint, StageDiffError, Unavailable
from stagediff.client import AsyncClient, FramesReceived, GenerationResult, Progress, Queued, RetryPolicy
from stagediff.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers.fake_client_server import FRAMES, FakeGeneration, FakeServer

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture
def fake():
    servers: list[FakeServer] = []

    def make(failures: int, code=grpc.StatusCode.UNAVAILABLE, job_failed=False) -> FakeServer:
        servers.append(FakeServer(FakeGeneration(failures, code, job_failed)))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def test_unavailable_is_retried_with_the_same_request_id(fake) -> None:
    server = fake(failures=2)
    with Client(f"127.0.0.1:{server.port}", retry=FAST_RETRY) as client:
        result = client.generate("a fox")
    assert np.array_equal(result.frames, FRAMES) and result.fps == 8
    ids = server.servicer.request_ids
    assert len(ids) == 3 and len(set(ids)) == 1, "every retry carries the request id of the first call"


def test_retries_give_up_after_max_attempts(fake) -> None:
    server = fake(failures=10)
    with Client(f"127.0.0.1:{server.port}", retry=FAST_RETRY) as client, pytest.raises(StageDiffError) as raised:
        client.generate("a fox")
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE and "'vae'" in raised.value.message
    assert len(server.servicer.request_ids) == FAST_RETRY.max_attempts


def test_a_failed_job_is_not_retried(fake) -> None:
    server = fake(failures=1, job_failed=True)
    with Client(f"127.0.0.1:{server.port}", retry=FAST_RETRY) as client, pytest.raises(StageDiffError):
        client.generate("a fox")
    assert len(server.servicer.request_ids) == 1


def test_invalid_argument_is_not_retried(fake) -> None:
    server = fake(failures=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    with Client(f"127.0.0.1:{server.port}", retry=FAST_RETRY) as client, pytest.raises(StageDiffError) as raised:
        client.generate("a fox")
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(server.servicer.request_ids) == 1


def test_stream_yields_typed_events_and_callbacks_see_progress(fake) -> None:
    server = fake(failures=0)
    seen: list[object] = []
    with Client(f"127.0.0.1:{server.port}") as client:
        events = list(client.stream("a fox"))
        client.generate("a fox", on_progress=seen.append)
    assert [type(e) for e in events] == [Queued, Progress, FramesReceived, FramesReceived, GenerationResult]
    assert [(e.first_frame, e.count) for e in events if isinstance(e, FramesReceived)] == [(0, 1), (1, 2)]
    assert [type(e) for e in seen] == [Queued, Progress, FramesReceived, FramesReceived]


def test_async_client(fake) -> None:
    server = fake(failures=1)

    async def run() -> GenerationResult:
        async with AsyncClient(f"127.0.0.1:{server.port}", retry=FAST_RETRY) as client:
            return await client.generate("a fox", seed=3, height=64)

    result = asyncio.run(run())
    assert np.array_equal(result.frames, FRAMES) and result.timings == {"total": 1.0}


@pytest.fixture
def closed_port():
    """A port bound but not listening: a connection to it is refused."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield bound.getsockname()[1]


class QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Not on the test's stderr."""


@pytest.fixture
def http_port():
    """A plain HTTP/1 server's port, as the HTTP gateway's would be."""
    server = http.server.HTTPServer(("127.0.0.1", 0), QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_nothing_listening_is_a_connection_failure_naming_the_endpoint_and_what_to_do(closed_port) -> None:
    retry = RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
    endpoint = f"127.0.0.1:{closed_port}"
    with Client(endpoint, retry=retry) as client, pytest.raises(ConnectionFailed) as raised:
        client.generate("a fox", timeout=5)
    error = raised.value
    assert isinstance(error, Unavailable) and error.code == grpc.StatusCode.UNAVAILABLE and error.endpoint == endpoint
    assert error.message.startswith(f"nothing answers at {endpoint}: start a cluster with `stagediff up")
    assert "--endpoint" in error.message and "Connection refused" not in error.message


def test_an_http_port_is_recognised_as_not_the_grpc_api(http_port) -> None:
    client = Client(f"127.0.0.1:{http_port}", retry=RetryPolicy(max_attempts=1))
    with client, pytest.raises(ConnectionFailed) as raised:
        client.list_jobs()
    assert f"127.0.0.1:{http_port} answers HTTP/1, not gRPC: that is the HTTP gateway" in raised.value.message
    assert "the gRPC API is on the orchestrator's port (default localhost:50051)" in raised.value.message


@pytest.mark.parametrize("url", ["http://localhost:50051", "https://gpu-host:443/"])
def test_a_url_endpoint_is_refused_before_any_call(url: str) -> None:
    with pytest.raises(InvalidEndpoint) as raised:
        Client(url)
    message = str(raised.value)
    assert isinstance(raised.value, ValueError) and "a gRPC endpoint is HOST:PORT, not a URL" in message
    assert ("try gpu-host:443 with TLS" in message) if url.startswith("https") else ("try localhost:50051." in message)


class StageDown(generation_pb2_grpc.GenerationServicer):
    """An orchestrator whose DiT is down: its own UNAVAILABLE quotes gRPC's words for the stage it cannot reach."""

    async def ListJobs(self, request, context):
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            "stage 'dit' at 127.0.0.1:1: failed to connect to all addresses; last error: UNKNOWN: "
            "ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused",
        )


def test_a_stage_the_cluster_cannot_reach_is_not_a_connection_failure_of_the_client() -> None:
    server = FakeServer(StageDown())
    try:
        client = Client(f"127.0.0.1:{server.port}", retry=RetryPolicy(max_attempts=1))
        with client, pytest.raises(Unavailable) as raised:
            client.list_jobs()
    finally:
        server.stop()
    assert not isinstance(raised.value, ConnectionFailed)
    assert raised.value.message.startswith("stage 'dit' at 127.0.0.1:1:")


class Deleted(generation_pb2_grpc.GenerationServicer):
    """Knows no job, as the orchestrator answers for one already deleted."""

    async def DeleteJob(self, request, context):
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no job '{request.job_id}'")


def test_deleting_a_job_already_gone_returns_false() -> None:
    server = FakeServer(Deleted())

    async def delete_async() -> bool:
        async with AsyncClient(f"127.0.0.1:{server.port}") as client:
            return await client.delete("gone")

    try:
        with Client(f"127.0.0.1:{server.port}") as client:
            assert client.delete("gone") is False
        assert asyncio.run(delete_async()) is False
    finally:
        server.stop()


class SlowGeneration(generation_pb2_grpc.GenerationServicer):
    """Sends the first events of job "slow", then waits; records every CancelJob."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def Generate(self, request, context):
        yield generation_pb2.GenerateEvent(job_id="slow", queued=generation_pb2.JobQueued(position=0))
        await asyncio.sleep(30)

    async def CancelJob(self, request, context):
        self.cancelled.append(request.job_id)
        return generation_pb2.Job(job_id=request.job_id, state=generation_pb2.JOB_STATE_CANCELLED)


def test_closing_a_stream_early_cancels_its_job() -> None:
    """The orchestrator keeps a job whose stream was lost running for a retry; a caller that stops
    listening on purpose cancels it explicitly instead."""
    server = FakeServer(SlowGeneration())
    try:
        with Client(f"127.0.0.1:{server.port}") as client:
            events = client.stream("a fox")
            assert isinstance(next(events), Queued)
            events.close()
            assert server.servicer.cancelled == ["slow"]
    finally:
        server.stop()


class HeldCancel(SlowGeneration):
    """SlowGeneration whose CancelJob is answered (and recorded) only once `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = threading.Event()
        self.release = threading.Event()

    async def CancelJob(self, request, context):
        self.arrived.set()
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return await super().CancelJob(request, context)


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as on a terminal: a test run that a shell started in the background
    inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_second_interrupt_does_not_abandon_the_cancel_of_the_first(ctrl_c_raises) -> None:
    """Ctrl-C during generate cancels its job; Ctrl-C again while that cancel is under way leaves it to finish."""
    server = FakeServer(HeldCancel())
    queued = threading.Event()

    def press_ctrl_c_twice() -> None:
        queued.wait(30)
        os.kill(os.getpid(), signal.SIGINT)
        server.servicer.arrived.wait(30)
        os.kill(os.getpid(), signal.SIGINT)  # while the cancel is under way
        time.sleep(0.2)  # lets the second interrupt reach the main thread before the cancel can be answered
        server.servicer.release.set()

    presser = threading.Thread(target=press_ctrl_c_twice)
    presser.start()
    try:
        with Client(f"127.0.0.1:{server.port}") as client, pytest.raises(KeyboardInterrupt):
            client.generate("a fox", on_progress=lambda event: queued.set())
        assert server.servicer.cancelled == ["slow"]
    finally:
        server.servicer.release.set()
        presser.join()
        server.stop()


def test_cancelling_an_async_generate_cancels_its_job() -> None:
    server = FakeServer(SlowGeneration())

    async def run() -> None:
        async with AsyncClient(f"127.0.0.1:{server.port}") as client:
            seen = asyncio.Event()
            task = asyncio.create_task(client.generate("a fox", on_progress=lambda event: seen.set()))
            await asyncio.wait_for(seen.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    try:
        asyncio.run(run())
        assert server.servicer.cancelled == ["slow"]
    finally:
        server.stop()


class MetadataRecorder(generation_pb2_grpc.GenerationServicer):
    """Records the metadata of every ListModels and Generate call."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def ListModels(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return generation_pb2.ListModelsResponse()

    async def Generate(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        for chunk in encode_tensor("frames", FRAMES, index=0):
            yield generation_pb2.GenerateEvent(job_id="j", result=generation_pb2.ResultChunk(tensor=chunk, fps=8))
        yield generation_pb2.GenerateEvent(job_id="j", completed=generation_pb2.JobCompleted(num_frames=3, fps=8))


TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SPAN_ID = 0x00F067AA0BA902B7


def test_calls_carry_the_callers_trace_context() -> None:
    """Inside the caller's span, every call (the blocking client runs them on its own thread) sends its
    traceparent; outside any span, none."""
    server = FakeServer(MetadataRecorder())
    parent = SpanContext(trace_id=TRACE_ID, span_id=SPAN_ID, is_remote=False, trace_flags=TraceFlags(1))
    try:
        with Client(f"127.0.0.1:{server.port}") as client:
            client.list_models()
            token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(parent)))
            try:
                client.list_models()
                client.generate("a fox")
            finally:
                otel_context.detach(token)

        async def in_async_span() -> None:
            async with AsyncClient(f"127.0.0.1:{server.port}") as client:
                with trace.use_span(NonRecordingSpan(parent)):
                    await client.generate("a fox")

        asyncio.run(in_async_span())
    finally:
        server.stop()
    traceparent = f"00-{TRACE_ID:032x}-{SPAN_ID:016x}-01"
    assert [call.get("traceparent") for call in server.servicer.metadata] == [None, *[traceparent] * 3]
