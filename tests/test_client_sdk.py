"""The SDK against an in-process fake Generation service: retries, typed events, errors, trace context; and the
CLI's `generate` against the shared local cluster from a process that cannot import torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from stagediff import Client, StageDiffError
from stagediff.client import AsyncClient, FramesReceived, GenerationResult, Progress, Queued, RetryPolicy
from stagediff.media import read_video_frames
from stagediff.protocol import JOB_FAILED_METADATA_KEY
from stagediff.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2, generation_pb2_grpc
from tests.test_client_only import REPOSITORY, client_only_environment

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)
FRAMES = np.arange(3 * 4 * 5 * 3, dtype=np.uint8).reshape(3, 4, 5, 3)


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Fails the first `failures` Generate calls with `code`, then streams a fixed result."""

    def __init__(self, failures: int, code: grpc.StatusCode, job_failed: bool = False) -> None:
        self.failures = failures
        self.code = code
        self.job_failed = job_failed
        self.request_ids: list[str] = []

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        if len(self.request_ids) <= self.failures:
            if self.job_failed:
                context.set_trailing_metadata(((JOB_FAILED_METADATA_KEY, "1"),))
            await context.abort(self.code, "stage 'vae' at x:1 is unavailable: test")
        yield generation_pb2.GenerateEvent(job_id="j", queued=generation_pb2.JobQueued(position=0))
        yield generation_pb2.GenerateEvent(
            job_id="j", progress=generation_pb2.StageProgress(stage="dit", step=1, total=1)
        )
        for index, piece in ((0, FRAMES[:1]), (1, FRAMES[1:])):
            for chunk in encode_tensor("frames", piece, index=index, chunk_bytes=16):
                yield generation_pb2.GenerateEvent(job_id="j", result=generation_pb2.ResultChunk(tensor=chunk, fps=8))
        yield generation_pb2.GenerateEvent(
            job_id="j", completed=generation_pb2.JobCompleted(timings={"total": 1.0}, num_frames=3, fps=8)
        )


class FakeServer:
    """Runs an aio server with a servicer on its own thread and event loop."""

    def __init__(self, servicer: FakeGeneration) -> None:
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self) -> int:
        self.server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


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


def test_nothing_listening_is_unavailable() -> None:
    retry = RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
    with Client("127.0.0.1:1", retry=retry) as client, pytest.raises(StageDiffError) as raised:
        client.generate("a fox", timeout=5)
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE


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


@pytest.mark.e2e
def test_generate_writes_an_mp4_from_a_process_that_cannot_import_torch(cluster, tmp_path: Path) -> None:
    """`stagediff generate` as a plain install runs it: torch, the server packages and opentelemetry are not
    importable in its process."""
    env = client_only_environment(tmp_path / "client-only")
    out = tmp_path / "fox.mp4"
    command = [
        sys.executable, "-m", "stagediff.cli", "generate", "--endpoint", cluster.endpoint, "--prompt", "a red fox",
        "--height", "64", "--width", "64", "--frames", "9", "--steps", "2", "--seed", "3", "--quiet", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["out"] == str(out) and summary["frames"] == 9
    assert read_video_frames(out).shape == (9, 64, 64, 3)
