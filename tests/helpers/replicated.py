"""Orchestrator replicas as real processes on one PostgreSQL database and one S3 bucket, in front of fake stages
served from the test's event loop: a DiT that takes `step_s` per denoising step and latents (and so frames)
that depend on the request's seed, so a rerun is checkable frame by frame."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagediff.local.launch import free_ports
from stagediff.local.servers import S3Server
from stagediff.tensor_codec import WireTensor, encode_tensor
from stagediff.v1 import stages_pb2
from tests.helpers.fake_stages import LIMITS, FakeDenoiser, FakeStages, FakeVae

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0


class SeededDenoiser(FakeDenoiser):
    """One progress event per step, `step_s` apart; latent frame t is filled with (seed + t) % 256. Counts the
    calls per seed, so a test sees which jobs ran twice."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s
        self.calls: Counter[int] = Counter()
        self.denoising: set[int] = set()  # seeds of the calls in progress

    async def Denoise(self, request_iterator, context):
        params = None
        async for request in request_iterator:
            if request.HasField("params"):
                params = request.params
        assert params is not None
        self.calls[params.seed] += 1
        self.denoising.add(params.seed)
        try:
            for step in range(params.num_inference_steps):
                await asyncio.sleep(self.step_s)
                yield stages_pb2.DenoiseResponse(
                    progress=stages_pb2.DenoiseProgress(step=step + 1, total=params.num_inference_steps)
                )
            for t in range((params.num_frames - 1) // LIMITS.temporal_factor + 1):
                value = float((params.seed + t) % 256)
                latent = np.full((1, 4, 1, params.height // 8, params.width // 8), value, np.float32)
                for chunk in encode_tensor("latents", latent, index=t):
                    yield stages_pb2.DenoiseResponse(tensor=chunk)
        finally:
            self.denoising.discard(params.seed)


class SeededVae(FakeVae):
    """Latent frame t -> its video frames, filled with the latent's value."""

    def fill(self, latent: WireTensor) -> int:
        return int(latent.array.flat[0])


def expected_frames(seed: int, num_frames: int, height: int, width: int) -> np.ndarray:
    """What SeededDenoiser and SeededVae make of a request."""
    frames = np.empty((num_frames, height, width, 3), np.uint8)
    for index in range(num_frames):
        t = 0 if index == 0 else (index - 1) // LIMITS.temporal_factor + 1
        frames[index] = (seed + t) % 256
    return frames


async def seeded_stages(step_s: float) -> FakeStages:
    stages = FakeStages()
    stages.denoiser = SeededDenoiser(step_s)
    stages.vae = SeededVae()
    return await stages.start()


@dataclass
class Replica:
    """One `stagediff serve orchestrator` process."""

    name: str
    port: int
    args: list[str]
    log_path: Path
    process: asyncio.subprocess.Process | None = None
    stopped: bool = field(default=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> Replica:
        log = self.log_path.open("ab")
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.orchestrator.service",
            *self.args,
            cwd=REPO,
            stdout=log,
            stderr=log,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            start_new_session=True,
        )
        log.close()
        await self.wait_serving()
        return self

    async def wait_serving(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with grpc.aio.insecure_channel(self.endpoint) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                assert self.process is not None
                if self.process.returncode is not None:
                    raise AssertionError(f"{self.name} exited:\n{self.log()}")
                try:
                    answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise AssertionError(f"{self.name} was not SERVING within {timeout_s} s:\n{self.log()}")
                await asyncio.sleep(0.1)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signum)

    async def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.process is not None
        await self.process.wait()

    async def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then the exit code (SIGKILL after `timeout_s`)."""
        assert self.process is not None
        if self.process.returncode is None:
            self.signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout_s)
            except TimeoutError:
                self.signal(signal.SIGKILL)
                await self.process.wait()
        assert self.process.returncode is not None
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def replica_args(
    stages: FakeStages,
    *,
    port: int,
    state_dir: Path,
    database_url: str,
    s3: S3Server,
    prefix: str,
    tenants_file: Path,
    extra: list[str] = (),  # type: ignore[assignment]
) -> list[str]:
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--advertise",
        f"127.0.0.1:{port}",
        "--text-encoder",
        stages.endpoints["text-encoder"],
        "--dit",
        stages.endpoints["dit"],
        "--vae",
        stages.endpoints["vae"],
        "--state-dir",
        str(state_dir),
        "--store",
        database_url,
        "--blobs",
        f"s3://{s3.bucket}/{prefix}",
        "--blobs-endpoint",
        s3.endpoint,
        "--tenants",
        str(tenants_file),
        "--health-interval",
        "0.2",
        "--metrics-port",
        "0",
        *extra,
    ]


def s3_environment(s3: S3Server) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}


async def start_gateway(orchestrators: list[Replica], log_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    """`stagediff serve http` in front of every replica; returns the process and its base URL once ready."""
    import urllib.request

    (port,) = free_ports(1, "127.0.0.1")
    addresses = ",".join(replica.endpoint for replica in orchestrators)
    log = log_path.open("ab")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stagediff.cli", "serve", "http", "--host", "127.0.0.1", "--port", str(port),
        "--orchestrator", addresses, cwd=REPO, stdout=log, stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=1) as answer:
                if answer.status == 200:
                    return process, url
        except OSError:
            pass
        if process.returncode is not None or asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the gateway did not get ready:\n{log_path.read_text()[-4000:]}")
        await asyncio.sleep(0.2)
