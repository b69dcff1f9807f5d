"""Channels and stubs to the four stages, and how their failures reach users.

Any failure of a stage call becomes a `StageError` that names the stage and its
endpoint, so a user who sees UNAVAILABLE knows which pool to look at.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.server import GRPC_OPTIONS
from stagediff.v1 import stages_pb2, stages_pb2_grpc

logger = logging.getLogger(__name__)

STAGE_ORDER = ("text-encoder", "dit", "vae", "interp")
HEALTH_TIMEOUT_S = 2.0


class StageError(Exception):
    """A stage call failed; `code` is the status the job ends with."""

    def __init__(self, stage: str, endpoint: str, code: grpc.StatusCode, detail: str) -> None:
        self.stage = stage
        self.endpoint = endpoint
        self.code = code
        self.detail = detail
        if code == grpc.StatusCode.UNAVAILABLE:
            message = f"stage '{stage}' at {endpoint} is unavailable: {detail}"
        else:
            message = f"stage '{stage}' at {endpoint} failed with {code.name}: {detail}"
        super().__init__(message)


@dataclass
class StageClient:
    name: str
    endpoint: str
    channel: grpc.aio.Channel = field(init=False)
    info: stages_pb2.StageInfo | None = None

    def __post_init__(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.endpoint, options=GRPC_OPTIONS)
        self.control = stages_pb2_grpc.StageControlStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.text_encoder = stages_pb2_grpc.TextEncoderStub(self.channel)
        self.denoiser = stages_pb2_grpc.DenoiserStub(self.channel)
        self.vae = stages_pb2_grpc.VaeDecoderStub(self.channel)
        self.interpolator = stages_pb2_grpc.InterpolatorStub(self.channel)

    def error(self, rpc_error: grpc.aio.AioRpcError) -> StageError:
        return StageError(self.name, self.endpoint, rpc_error.code(), rpc_error.details() or "")

    async def check_health(self) -> tuple[str, str]:
        """Returns (health, detail): SERVING, NOT_SERVING or UNKNOWN, and why when not serving."""
        try:
            response = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            return "NOT_SERVING", f"unreachable: {error.code().name}: {error.details()}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        if status == "SERVING":
            return status, ""
        if status == "NOT_SERVING":
            return status, "loading or draining"
        return "UNKNOWN", status

    async def fetch_info(self) -> stages_pb2.StageInfo:
        self.info = await self.control.GetStageInfo(stages_pb2.GetStageInfoRequest(), timeout=HEALTH_TIMEOUT_S)
        return self.info

    async def close(self) -> None:
        await self.channel.close()


class StagePool:
    """One client per stage (a later change turns each into a pool of replicas)."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        missing = [name for name in STAGE_ORDER if not endpoints.get(name)]
        if missing:
            raise ValueError(f"no endpoint for stage(s) {', '.join(missing)}")
        self.clients = {name: StageClient(name, endpoints[name]) for name in STAGE_ORDER}

    def __getitem__(self, name: str) -> StageClient:
        return self.clients[name]

    async def wait_until_serving(self, poll_s: float = 0.5) -> None:
        """Waits until every stage answers SERVING, then caches their info."""
        waiting_on: set[str] = set(STAGE_ORDER)
        while waiting_on:
            for name in list(waiting_on):
                health, detail = await self.clients[name].check_health()
                if health == "SERVING":
                    await self.clients[name].fetch_info()
                    waiting_on.discard(name)
                    logger.info("stage %s at %s is serving", name, self.clients[name].endpoint)
            if waiting_on:
                await asyncio.sleep(poll_s)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
