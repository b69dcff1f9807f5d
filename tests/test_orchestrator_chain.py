"""The orchestrator runs the served family's chain with the stages it has endpoints for, and relays bytes.

Fake stages (text encoder, DiT, VAE) serve on 127.0.0.1 from the test's event loop and record what they
receive; the orchestrator's own GenerationServicer, Pipeline, JobManager and StagePool run against them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from families.registry import family_named
from services.orchestrator.chain import stages_for
from services.orchestrator.jobs import JobManager, JobState
from services.orchestrator.pipeline import Pipeline, restore_intermediates
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.service import GenerationServicer
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.store import JobRecord, JobStore
from services.orchestrator.tenant_auth import TenantAuthInterceptor
from services.orchestrator.tenants import TenantRegistry
from stagediff.tensor_codec import TensorAssembler, encode_tensor
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2, stages_pb2_grpc, tensor_pb2

REPO = Path(__file__).resolve().parents[1]
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

    async def Encode(self, request, context):
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

    async def Denoise(self, request_iterator, context):
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
    """Latent frame t -> its video frames (1 for the first, then temporal_factor each), filled with t."""

    def __init__(self) -> None:
        self.calls = 0

    async def Decode(self, request_iterator, context):
        self.calls += 1
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
            frames = np.full((count, height * 8, width * 8, 3), t, np.uint8)
            for chunk in encode_tensor("frames", frames, index=first):
                yield stages_pb2.DecodeResponse(tensor=chunk)


class FakeControl(stages_pb2_grpc.StageControlServicer):
    def __init__(self, info: stages_pb2.StageInfo) -> None:
        self.info = info

    async def GetStageInfo(self, request, context):
        return self.info


async def _serve_stage(name: str, servicer, limits: stages_pb2.ModelLimits = LIMITS) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    info = stages_pb2.StageInfo(stage=name, model=MODEL, family="wan-t2v", limits=limits)
    stages_pb2_grpc.add_StageControlServicer_to_server(FakeControl(info), server)
    add = {
        "text-encoder": stages_pb2_grpc.add_TextEncoderServicer_to_server,
        "dit": stages_pb2_grpc.add_DenoiserServicer_to_server,
        "vae": stages_pb2_grpc.add_VaeDecoderServicer_to_server,
    }[name]
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
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
            server, self.endpoints[name] = await _serve_stage(name, servicer)
            self.servers.append(server)
        return self

    async def stop(self) -> None:
        for server in self.servers:
            await server.stop(None)


class Orchestrator:
    """The orchestrator's servicer, pipeline, jobs and stage pool, served on 127.0.0.1."""

    def __init__(self, endpoints: dict[str, str], state_dir: Path) -> None:
        self.pool = StagePool(endpoints, probe_interval_s=0.1)
        self.store = JobStore.open(state_dir)
        pipeline = Pipeline(self.pool, retry_backoff_s=0.01, store=self.store)
        self.jobs = JobManager(pipeline.run, FairScheduler(), self.store, restore_job=restore_intermediates)
        tenants = TenantRegistry.open()
        self.servicer = GenerationServicer(self.pool, self.jobs, tenants)
        self.server = grpc.aio.server(interceptors=[TenantAuthInterceptor(tenants)])
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def start(self) -> None:
        await self.server.start()
        self.starting = asyncio.get_running_loop().create_task(self.servicer.start())

    async def stop(self) -> None:
        self.starting.cancel()
        await self.server.stop(None)
        await self.jobs.shutdown()
        await self.pool.close()
        self.store.close()


def _request(**fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt="a fox", negative_prompt="blurry", height=32, width=32, num_frames=9, seed=1, **fields
    )


def _frames(events) -> list:
    assembler = TensorAssembler()
    return [tensor for e in events if e.HasField("result") if (tensor := assembler.feed(e.result.tensor))]


async def _generate(endpoint: str, request: generation_pb2.GenerateRequest) -> list[generation_pb2.GenerateEvent]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [event async for event in stub.Generate(request, timeout=60)]


async def _refusal(endpoint: str, request: generation_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _generate(endpoint, request)
    return caught.value


def test_the_orchestrator_never_imports_torch() -> None:
    """Importing the orchestrator's service (and everything it imports) leaves torch out of the process."""
    script = (
        "import sys\n"
        "import services.orchestrator.service\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'diffusers', 'transformers'))\n"
        "print(' '.join(heavy))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"the orchestrator imported {run.stdout.strip()}"


def test_stages_for_follows_the_chain_and_the_request() -> None:
    wan, qwen = family_named("wan-t2v"), family_named("qwen-image")
    interpolated = _request(interpolation=generation_pb2.InterpolationParams(enable=True, exp=1))
    assert stages_for(wan, _request()) == ("text-encoder", "dit", "vae")
    assert stages_for(wan, interpolated) == ("text-encoder", "dit", "vae", "interp")
    # enable without exp asks for nothing.
    off = _request(interpolation=generation_pb2.InterpolationParams(enable=True, exp=0))
    assert stages_for(wan, off) == ("text-encoder", "dit", "vae")
    assert stages_for(qwen, interpolated) == ("text-encoder", "dit", "vae")


def test_without_an_interpolator_requests_run_without_interpolation_and_refuse_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        stages = await FakeStages().start()
        orchestrator = Orchestrator(stages.endpoints, tmp_path / "state")
        await orchestrator.start()
        try:
            await orchestrator.servicer.ready.wait()
            events = await _generate(orchestrator.endpoint, _request())
            frames = _frames(events)
            assert [(f.index, f.shape[0]) for f in frames] == [(0, 1), (1, 4), (5, 4)]
            assert [int(f.array[0, 0, 0, 0]) for f in frames] == [0, 1, 2]
            assert events[-1].completed.num_frames == 9 and events[-1].completed.fps == 16.0
            stages_run = {e.progress.stage for e in events if e.HasField("progress")}
            assert stages_run == {"text-encoder", "dit", "vae"}
            # The DiT got the text encoder's chunks as they were sent: names, headers, offsets and bytes.
            assert stages.denoiser.received == [stages.text_encoder.sent]
            names = [c.header.name for c in stages.text_encoder.sent if c.HasField("header")]
            assert names == ["prompt_embeds", "negative_prompt_embeds"]

            interpolated = _request(interpolation=generation_pb2.InterpolationParams(enable=True, exp=1))
            error = await _refusal(orchestrator.endpoint, interpolated)
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
            for words in ("interpolation:", "this deployment has no frame interpolator", "--interp"):
                assert words in error.details()
            assert len(stages.denoiser.received) == 1, "the refused request reached no stage"

            # Cluster info lists the stages this orchestrator has, and no interpolator.
            async with grpc.aio.insecure_channel(orchestrator.endpoint) as channel:
                info = await generation_pb2_grpc.GenerationStub(channel).GetClusterInfo(
                    generation_pb2.GetClusterInfoRequest()
                )
            assert [(s.info.stage, s.health) for s in info.stages] == [
                ("text-encoder", "SERVING"),
                ("dit", "SERVING"),
                ("vae", "SERVING"),
            ]
        finally:
            await orchestrator.stop()
            await stages.stop()

    asyncio.run(scenario())


def test_a_stage_the_chain_needs_without_an_endpoint_refuses_requests_naming_its_flag(tmp_path: Path) -> None:
    async def scenario() -> None:
        stages = await FakeStages().start()
        orchestrator = Orchestrator(
            {"text-encoder": stages.endpoints["text-encoder"], "dit": stages.endpoints["dit"]}, tmp_path / "state"
        )
        await orchestrator.start()
        try:
            await orchestrator.pool["dit"].wait_serving()
            error = await _refusal(orchestrator.endpoint, _request())
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
            for words in (
                "wan-t2v",
                "text-encoder -> dit -> vae -> [interp]",
                "no endpoint for vae",
                "--vae HOST:PORT",
            ):
                assert words in error.details()
            assert stages.denoiser.received == []
            assert not orchestrator.servicer.ready.is_set()
            async with grpc.aio.insecure_channel(orchestrator.endpoint) as channel:
                info = await generation_pb2_grpc.GenerationStub(channel).GetClusterInfo(
                    generation_pb2.GetClusterInfoRequest()
                )
            listed = {s.info.stage: s for s in info.stages}
            assert list(listed) == ["text-encoder", "dit", "vae"]
            assert listed["vae"].health == "NOT_SERVING" and "--vae HOST:PORT" in listed["vae"].detail
        finally:
            await orchestrator.stop()
            await stages.stop()

    asyncio.run(scenario())


def test_the_served_orchestrator_stays_not_serving_without_a_stage_its_chain_needs(tmp_path: Path) -> None:
    """`stagediff serve orchestrator` without --vae: health NOT_SERVING, the reason logged, Generate refused."""

    async def scenario() -> None:
        stages = await FakeStages().start()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.orchestrator.service",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--text-encoder",
            stages.endpoints["text-encoder"],
            "--dit",
            stages.endpoints["dit"],
            "--state-dir",
            str(tmp_path / "state"),
            "--health-interval",
            "0.1",
            cwd=REPO,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        log: list[str] = []
        try:
            endpoint = None
            while not log or "health stays NOT_SERVING" not in log[-1]:
                try:
                    line = await asyncio.wait_for(process.stderr.readline(), timeout=120)
                except TimeoutError:
                    pytest.fail("the orchestrator never said why it is not serving:\n" + "".join(log))
                assert line, "the orchestrator exited:\n" + "".join(log)
                log.append(line.decode())
                if " listening on " in log[-1]:
                    endpoint = log[-1].rsplit(" listening on ", 1)[1].split()[0]
            assert "no endpoint for vae: start it with --vae HOST:PORT" in log[-1]
            async with grpc.aio.insecure_channel(endpoint) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            error = await _refusal(endpoint, _request())
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "--vae" in error.details(), error
        finally:
            process.terminate()
            await process.wait()
            await stages.stop()

    asyncio.run(scenario())


def test_a_restarted_orchestrator_relays_the_stored_chunks_without_running_their_stages(tmp_path: Path) -> None:
    """A job whose DiT had finished when the orchestrator stopped: its stored conditioning and latents are the
    chunks the stages sent, and the VAE decodes the latents after the restart without the text encoder or the
    DiT running again."""
    request = _request(model=MODEL, num_inference_steps=2, guidance_scale=5.0, fps=16.0)
    conditioning = [
        *encode_tensor("prompt_embeds", np.ones((1, 4, 8), np.float32), chunk_bytes=48),
        *encode_tensor("negative_prompt_embeds", np.zeros((1, 4, 8), np.float32), chunk_bytes=48),
    ]
    latents = [
        chunk for t in range(3) for chunk in encode_tensor("latents", np.full((1, 4, 1, 4, 4), t, np.float32), index=t)
    ]
    with JobStore.open(tmp_path / "state") as store:
        store.insert(JobRecord.new("stopped-job", "default", request))
        store.update_state("stopped-job", JobState.JOB_STATE_RUNNING)
        assert store.mark_stage_done("stopped-job", "text-encoder", conditioning)
        assert store.mark_stage_done("stopped-job", "dit", latents)

    async def scenario() -> None:
        stages = await FakeStages().start()
        orchestrator = Orchestrator(stages.endpoints, tmp_path / "state")
        await orchestrator.start()
        try:
            await orchestrator.servicer.ready.wait()
            job = await orchestrator.jobs.get("stopped-job", "default")
            events = [event async for event in job.follow()]
            assert job.state == JobState.JOB_STATE_SUCCEEDED, job.error_message
            frames = _frames(events)
            assert [(f.index, f.shape[0], int(f.array[0, 0, 0, 0])) for f in frames] == [
                (0, 1, 0),
                (1, 4, 1),
                (5, 4, 2),
            ]
            assert stages.text_encoder.sent == [] and stages.denoiser.received == []
            assert stages.vae.calls == 1
        finally:
            await orchestrator.stop()
            await stages.stop()

    asyncio.run(scenario())
