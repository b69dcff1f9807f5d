"""Stage replicas in miniature (health, GetStageInfo, an Encode that fails as told), for the stage pool tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from stagediff.v1 import stages_pb2, stages_pb2_grpc

# Bounds on waiting for something asynchronous to happen; never asserted as durations.
SETTLE_S = 30.0


async def eventually(condition: Callable[[], bool], what: str) -> None:
    """Waits (bounded) for a condition that the background probes make true."""
    give_up_at = time.monotonic() + SETTLE_S
    while not condition():
        assert time.monotonic() < give_up_at, f"never happened: {what}"
        await asyncio.sleep(0.02)


class FakeReplica(stages_pb2_grpc.StageControlServicer, stages_pb2_grpc.TextEncoderServicer):
    """A stage replica in miniature: health, GetStageInfo, and an Encode that fails with `encode_code` (None:
    answers one empty response)."""

    def __init__(self, version: str = "v1") -> None:
        self.version = version
        self.info_calls = 0
        self.encode_code: grpc.StatusCode | None = grpc.StatusCode.UNAVAILABLE
        self.port = 0
        self.server: grpc.aio.Server | None = None
        self.health = health_aio.HealthServicer()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeReplica:
        """Serves on the replica's port (a free one the first time, the same one after a stop)."""
        self.server = grpc.aio.server()
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        stages_pb2_grpc.add_StageControlServicer_to_server(self, self.server)
        stages_pb2_grpc.add_TextEncoderServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        await self.set_serving(True)
        return self

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(None)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)

    async def GetStageInfo(self, request, context):
        self.info_calls += 1
        return stages_pb2.StageInfo(stage="text-encoder", model="fake", version=self.version)

    async def Encode(self, request, context):
        if self.encode_code is not None:
            await context.abort(self.encode_code, "refused by the fake replica")
        yield stages_pb2.EncodeResponse()


@contextlib.asynccontextmanager
async def replicas(count: int) -> AsyncIterator[list[FakeReplica]]:
    started = [await FakeReplica().start() for _ in range(count)]
    try:
        yield started
    finally:
        for replica in started:
            await replica.stop()
