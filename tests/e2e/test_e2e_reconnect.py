"""A dropped connection does not burn a job: the SDK's retry attaches to the same job and gets every frame.

A TCP proxy between the SDK and the orchestrator (what a load balancer is) resets every connection in the
middle of the job's denoising. The orchestrator sees the Generate stream end without a cancel from the
client and keeps the job running for its grace period; the SDK retries Generate with the same request id,
attaches to the job and receives its whole log. The frames equal an uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from stagediff import Client
from stagediff.client import GenerationResult, Progress, RetryPolicy
from stagediff.v1 import generation_pb2

pytestmark = pytest.mark.e2e

JOB = dict(height=32, width=32, num_frames=9, num_inference_steps=12, guidance_scale=5.0, seed=21)
RETRY = RetryPolicy(max_attempts=10, initial_backoff_s=0.2, max_backoff_s=1.0)


class DroppingProxy:
    """Forwards TCP connections to `target`; `drop()` resets every open connection (new ones still pass)."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.writers: list[asyncio.StreamWriter] = []
        self.connections = 0
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)

    async def _start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.target_port)
        self.writers += [client_writer, upstream_writer]

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # A reset by `drop` (or by either end) ends the pipe; the other direction sees it too.
            with contextlib.suppress(ConnectionError, OSError):
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer))

    def drop(self) -> None:
        async def reset() -> None:
            for writer in self.writers:
                writer.transport.abort()
            self.writers.clear()

        asyncio.run_coroutine_threadsafe(reset(), self.loop).result(timeout=10)

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            for writer in self.writers:
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture
def proxy(cluster) -> Iterator[DroppingProxy]:
    proxy = DroppingProxy(cluster.endpoint)
    yield proxy
    proxy.close()


def test_a_connection_reset_mid_job_is_retried_into_the_same_job(cluster, proxy: DroppingProxy) -> None:
    with Client(cluster.endpoint) as direct:
        expected = direct.generate("a lighthouse on a cliff", **JOB)

    request_id = "reconnect-after-reset"
    dropped = False
    result = None
    with Client(f"127.0.0.1:{proxy.port}", retry=RETRY) as client:
        for event in client.stream("a lighthouse on a cliff", request_id=request_id, **JOB):
            if isinstance(event, Progress) and event.stage == "dit" and not dropped:
                dropped = True
                proxy.drop()  # mid-denoising: the orchestrator sees the stream end without a cancel
            if isinstance(event, GenerationResult):
                result = event
        assert dropped and proxy.connections >= 2, "the connection was not reset and re-opened"
        assert result is not None
        jobs = [job for job in client.list_jobs() if job.request.request_id == request_id]
    assert len(jobs) == 1 and jobs[0].state == generation_pb2.JOB_STATE_SUCCEEDED, "the retry made another job"
    assert result.job_id == jobs[0].job_id
    np.testing.assert_array_equal(result.frames, expected.frames)
