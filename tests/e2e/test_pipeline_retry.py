"""A stage that fails with UNAVAILABLE is retried from the last finished stage, sending no frame twice."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.auth import cluster_channel
from services.orchestrator.job import JobState, ResultPiece
from services.orchestrator.jobs import JobManager
from services.orchestrator.pipeline import Pipeline
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.store import JobStore
from services.orchestrator.tenants import TenantRegistry
from stagediff import Client
from stagediff.tensor_codec import TensorAssembler
from stagediff.v1 import generation_pb2, stages_pb2_grpc
from tests.helpers.grpc_channels import CLUSTER_SECRET

pytestmark = pytest.mark.e2e


class FlakyVae(stages_pb2_grpc.VaeDecoderServicer, stages_pb2_grpc.StageControlServicer):
    """Relays to the real VAE, but drops the first call with UNAVAILABLE after its first frame chunk."""

    def __init__(self, real_endpoint: str) -> None:
        self.channel = cluster_channel(real_endpoint, CLUSTER_SECRET)
        self.real = stages_pb2_grpc.VaeDecoderStub(self.channel)
        self.real_control = stages_pb2_grpc.StageControlStub(self.channel)
        self.calls = 0

    async def GetStageInfo(self, request, context):
        return await self.real_control.GetStageInfo(request)

    async def Decode(self, request_iterator, context):
        self.calls += 1
        call = self.real.Decode(request_iterator)
        async for response in call:
            yield response
            if self.calls == 1 and response.tensor.last:
                call.cancel()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "replica went away")


async def _run(cluster, state_dir) -> tuple[list[generation_pb2.GenerateEvent], int, FlakyVae, object]:
    flaky = FlakyVae(cluster.services["vae"].endpoint)
    server = grpc.aio.server()
    stages_pb2_grpc.add_VaeDecoderServicer_to_server(flaky, server)
    stages_pb2_grpc.add_StageControlServicer_to_server(flaky, server)
    # Health stays SERVING: the replica that failed the call rejoins at the next probe, and the retry goes to it.
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    endpoints = {name: cluster.services[name].endpoint for name in ("text-encoder", "dit", "interp")}
    stages = StagePool({**endpoints, "vae": f"127.0.0.1:{port}"}, probe_interval_s=0.1, secret=CLUSTER_SECRET)
    await stages.wait_until_serving()
    store = JobStore.open(state_dir)
    pipeline = Pipeline(stages, stage_retries=1, retry_backoff_s=0.01, store=store)
    jobs = JobManager(pipeline.run, FairScheduler(), store)
    request = generation_pb2.GenerateRequest(
        model="tiny",
        prompt="a fox",
        negative_prompt="blurry",
        height=64,
        width=64,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=5.0,
        seed=0,
        fps=16,
    )
    job, _ = await jobs.submit(request, TenantRegistry.open().open_tenant)
    events = [event async for event in job.follow()]
    store.close()
    await stages.close()
    await flaky.channel.close()
    await server.stop(None)
    return events, job.state, flaky, job


def test_vae_failure_is_retried_without_recomputing_the_dit(cluster, tmp_path) -> None:
    events, state, flaky, job = asyncio.run(_run(cluster, tmp_path / "state"))
    assert state == JobState.JOB_STATE_SUCCEEDED, job.error_message
    assert flaky.calls == 2
    dit_steps = [e.progress.step for e in events if e.HasField("progress") and e.progress.stage == "dit"]
    assert dit_steps == [1, 2], "the DiT ran once; the retry started from its latents"
    assembler = TensorAssembler()
    indexes, frames = [], []
    for event in events:
        if event.HasField("result"):
            tensor = assembler.feed(event.result.tensor)
            if tensor is not None:
                indexes.append(tensor.index)
                frames.append(tensor.array)
    assert indexes == [0, 1, 5], "no frame was sent twice"
    # The frames went to the store's result file; the job's log holds only where they are.
    assert [(e.first, e.count) for e in job.events if isinstance(e, ResultPiece)] == [(0, 1), (1, 4), (5, 4)]
    assert not any(isinstance(e, generation_pb2.GenerateEvent) and e.HasField("result") for e in job.events)
    with Client(cluster.endpoint) as client:
        expected = client.generate(
            "a fox",
            negative_prompt="blurry",
            height=64,
            width=64,
            num_frames=9,
            num_inference_steps=2,
            guidance_scale=5.0,
            seed=0,
        ).frames
    assert np.array_equal(np.concatenate(frames), expected)
