"""A fake Generation service on a real aio server in its own thread, for the SDK and client command tests."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np

from stagediff.protocol import JOB_FAILED_METADATA_KEY
from stagediff.tensor_codec import encode_tensor
from stagediff.v1 import generation_pb2, generation_pb2_grpc

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
