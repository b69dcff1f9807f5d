"""Fake text encoder, DiT and VAE services on real aio servers, and the requests and calls that drive an
orchestrator chain through them (no model runs)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.orchestrator.jobs import JobManager
from services.orchestrator.model_catalog import ModelCatalog
from services.orchestrator.pipeline import Pipeline, restore_intermediates
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.servicer import GenerationServicer
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.store import JobStore
from services.orchestrator.tenant_auth import TenantAuthInterceptor
from services.orchestrator.tenants import TenantRegistry
from services.stage_priority import PRIORITY_METADATA
from stagediff.tensor_codec import TensorAssembler, WireTensor, encode_tensor
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2, stages_pb2_grpc, tensor_pb2

MODEL = "tiny"
LIMITS = stages_pb2.ModelLimits(
    height_multiple=16,
    width_multiple=16,
    temporal_factor=4,
    max_height=256,
    max_width=256,
    max_frames=33,
    max_inference_steps=50,
    max_sequence_length=16,
    max_prompt_chars=1000,
    default_height=32,
    default_width=32,
    default_num_frames=9,
    default_inference_steps=2,
    default_guidance_scale=5.0,
    default_fps=16.0,
)


class FakeTextEncoder(stages_pb2_grpc.TextEncoderServicer):
    """Each text's embeddings, named as the DiT takes them, in several chunks; remembers what it sent."""

    def __init__(self) -> None:
        self.sent: list[tensor_pb2.TensorChunk] = []
        self.priorities: list[str | None] = []  # each call's stagediff-priority metadata

    async def Encode(self, request, context):
        self.priorities.append(dict(context.invocation_metadata()).get(PRIORITY_METADATA))
        for i, role in enumerate(("prompt", "negative_prompt")[: len(request.texts)]):
            embeds = np.full((1, 4, 8), i + 1, np.float32)
            for chunk in encode_tensor(f"{role}_embeds", embeds, chunk_bytes=48):
                self.sent.append(chunk)
                yield stages_pb2.EncodeResponse(tensor=chunk)


class FakeDenoiser(stages_pb2_grpc.DenoiserServicer):
    """Takes params and the conditioning chunks (remembered as received), then sends one latent frame per
    latent time step, filled with its index."""

    def __init__(self) -> None:
        self.received: list[list[tensor_pb2.TensorChunk]] = []
        self.priorities: list[str | None] = []  # each call's stagediff-priority metadata

    async def Denoise(self, request_iterator, context):
        self.priorities.append(dict(context.invocation_metadata()).get(PRIORITY_METADATA))
        params = None
        received: list[tensor_pb2.TensorChunk] = []
        async for request in request_iterator:
            if request.HasField("params"):
                params = request.params
            else:
                received.append(request.tensor)
        self.received.append(received)
        yield stages_pb2.DenoiseResponse(progress=stages_pb2.DenoiseProgress(step=1, total=1))
        for t in range((params.num_frames - 1) // LIMITS.temporal_factor + 1):
            latent = np.full((1, 4, 1, params.height // 8, params.width // 8), t, np.float32)
            for chunk in encode_tensor("latents", latent, index=t):
                yield stages_pb2.DenoiseResponse(tensor=chunk)


class FakeVae(stages_pb2_grpc.VaeDecoderServicer):
    """Latent frame t -> its video frames (1 for the first, then temporal_factor each), filled with `fill`: t."""

    def __init__(self) -> None:
        self.calls = 0
        self.priorities: list[str | None] = []  # each call's stagediff-priority metadata

    def fill(self, latent: WireTensor) -> int:
        return latent.index

    async def Decode(self, request_iterator, context):
        self.calls += 1
        self.priorities.append(dict(context.invocation_metadata()).get(PRIORITY_METADATA))
        assembler = TensorAssembler()
        async for request in request_iterator:
            if request.HasField("params"):
                continue
            latent = assembler.feed(request.tensor)
            if latent is None:
                continue
            t = latent.index
            count = 1 if t == 0 else LIMITS.temporal_factor
            first = 0 if t == 0 else 1 + LIMITS.temporal_factor * (t - 1)
            _, _, _, height, width = latent.shape
            frames = np.full((count, height * 8, width * 8, 3), self.fill(latent), np.uint8)
            for chunk in encode_tensor("frames", frames, index=first):
                yield stages_pb2.DecodeResponse(tensor=chunk)


class FakeControl(stages_pb2_grpc.StageControlServicer):
    def __init__(self, info: stages_pb2.StageInfo) -> None:
        self.info = info

    async def GetStageInfo(self, request, context):
        return self.info


async def serve_stage(
    name: str,
    servicer,
    limits: stages_pb2.ModelLimits = LIMITS,
    port: int = 0,
    info: stages_pb2.StageInfo | None = None,
) -> tuple[grpc.aio.Server, str]:
    """Serves a fake stage on 127.0.0.1 (`port`, or a free one), SERVING at once; returns it and its endpoint.
    `info`: what it reports (default: the one Wan model's)."""
    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    info = info or stages_pb2.StageInfo(stage=name, model=MODEL, family="wan-t2v", limits=limits)
    stages_pb2_grpc.add_StageControlServicer_to_server(FakeControl(info), server)
    add = {
        "text-encoder": stages_pb2_grpc.add_TextEncoderServicer_to_server,
        "dit": stages_pb2_grpc.add_DenoiserServicer_to_server,
        "vae": stages_pb2_grpc.add_VaeDecoderServicer_to_server,
    }[name]
    add(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


class FakeStages:
    """The fake text encoder, DiT and VAE, each its own server."""

    def __init__(self) -> None:
        self.text_encoder = FakeTextEncoder()
        self.denoiser = FakeDenoiser()
        self.vae = FakeVae()
        self.servers: list[grpc.aio.Server] = []
        self.endpoints: dict[str, str] = {}

    async def start(self) -> FakeStages:
        for name, servicer in (("text-encoder", self.text_encoder), ("dit", self.denoiser), ("vae", self.vae)):
            server, self.endpoints[name] = await serve_stage(name, servicer)
            self.servers.append(server)
        return self

    async def stop(self) -> None:
        for server in self.servers:
            await server.stop(None)


def generate_request(**fields) -> generation_pb2.GenerateRequest:
    base: dict = dict(prompt="a fox", negative_prompt="blurry", height=32, width=32, num_frames=9, seed=1)
    return generation_pb2.GenerateRequest(**(base | fields))


async def generate(
    endpoint: str, request: generation_pb2.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()
) -> list[generation_pb2.GenerateEvent]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [event async for event in stub.Generate(request, timeout=60, metadata=tuple(metadata))]


async def refusal(
    endpoint: str, request: generation_pb2.GenerateRequest, metadata: Sequence[tuple[str, str]] = ()
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await generate(endpoint, request, metadata)
    return caught.value


class ChainOrchestrator:
    """The orchestrator's servicer, pipeline, jobs and stage pool, served on 127.0.0.1."""

    def __init__(
        self,
        endpoints: Mapping[str, str | list[str]],
        state_dir: Path,
        keep_outputs_after_s: float = 1.0,
        tenants: TenantRegistry | None = None,
        replica_wait_s: float = 5.0,
        cold_start_s: float = 0.0,
    ) -> None:
        self.pool = StagePool(endpoints, probe_interval_s=0.1, replica_wait_s=replica_wait_s, cold_start_s=cold_start_s)
        self.store = JobStore.open(state_dir)
        self.catalog = ModelCatalog(self.store, self.pool.routes)
        pipeline = Pipeline(
            self.pool, retry_backoff_s=0.01, store=self.store, keep_outputs_after_s=keep_outputs_after_s
        )
        self.jobs = JobManager(pipeline.run, FairScheduler(), self.store, restore_job=restore_intermediates)
        tenants = tenants or TenantRegistry.open()
        self.servicer = GenerationServicer(self.pool, self.jobs, tenants)
        self.server = grpc.aio.server(interceptors=[TenantAuthInterceptor(tenants)])
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def start(self) -> None:
        await self.catalog.load()
        self.pool.on_models = self.catalog.saw
        await self.server.start()
        self.starting = asyncio.get_running_loop().create_task(self.servicer.start())

    async def stop(self) -> None:
        self.starting.cancel()
        await self.server.stop(None)
        await self.jobs.shutdown()
        await self.catalog.close()
        await self.pool.close()
        self.store.close()
