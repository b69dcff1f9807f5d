"""Pools that can be empty: a model whose DiT pool is at zero stays served (the job store keeps what its DiT
reported), its jobs wait for a replica up to --cold-start-timeout and run once one starts, and past it they fail
UNAVAILABLE naming the stage. Fake stages on 127.0.0.1, the orchestrator's own servicer, pipeline and pool.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from services.orchestrator.demand import PoolDemandCollector
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.store import JobStore
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2
from tests.helpers.fake_replicas import eventually
from tests.helpers.fake_stages import (
    LIMITS,
    MODEL,
    ChainOrchestrator,
    FakeDenoiser,
    FakeStages,
    generate,
    generate_request,
    refusal,
    serve_stage,
)

DIT_INFO = stages_pb2.StageInfo(stage="dit", model=MODEL, family="wan-t2v", limits=LIMITS)


def _known(state_dir: Path) -> None:
    """A job store that keeps the model, as one whose DiT served it before does."""
    with JobStore.open(state_dir) as store:
        store.models.save(MODEL, DIT_INFO.SerializeToString(), seen_at=time.time())


async def _models(endpoint: str) -> list[generation_pb2.ModelDescription]:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return list((await stub.ListModels(generation_pb2.ListModelsRequest())).models)


def test_a_job_waits_for_a_dit_to_start_and_runs_on_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        stages = FakeStages()
        await stages.start()
        await stages.servers.pop(1).stop(None)  # the DiT: scaled to zero; its port taken again when it starts
        dit_port = int(stages.endpoints["dit"].rsplit(":", 1)[1])
        _known(tmp_path / "state")
        orchestrator = ChainOrchestrator(stages.endpoints, tmp_path / "state", cold_start_s=60.0)
        registry = CollectorRegistry()
        registry.register(PoolDemandCollector(orchestrator.pool, orchestrator.jobs.scheduler.queued_by_model))
        await orchestrator.start()
        try:
            await asyncio.wait_for(orchestrator.servicer.ready.wait(), 30)  # without a DiT: the store knows the model
            (described,) = await _models(orchestrator.endpoint)
            assert described.id == MODEL and dict(described.serving_replicas)["dit"] == 0
            assert described.status == ("scaled to zero at dit: starts on demand; a request waits up to 60 s for it"), (
                described.status
            )
            job = asyncio.create_task(generate(orchestrator.endpoint, generate_request()))

            def waiting() -> float | None:
                return registry.get_sample_value("stagediff_pool_calls_waiting", {"stage": "dit", "model": MODEL})

            await eventually(lambda: waiting() == 1, "the job waits for a DiT")
            assert not job.done()
            server, _ = await serve_stage("dit", FakeDenoiser(), port=dit_port)
            try:
                events = await asyncio.wait_for(job, timeout=30)
                assert events[-1].HasField("completed"), events[-1]
                assert waiting() == 0
                (described,) = await _models(orchestrator.endpoint)
                assert described.status == "serving"
            finally:
                await server.stop(None)
            # The DiT that served is kept in the store: the next orchestrator knows the model from it.
            await orchestrator.catalog.close()
            assert [known.model for known in orchestrator.store.models.load(time.time())] == [MODEL]
        finally:
            await orchestrator.stop()
            await stages.stop()

    asyncio.run(scenario())


def test_past_the_cold_start_timeout_a_job_fails_unavailable_naming_the_stage(tmp_path: Path) -> None:
    async def scenario() -> None:
        stages = FakeStages()
        await stages.start()
        await stages.servers.pop(1).stop(None)
        _known(tmp_path / "state")
        orchestrator = ChainOrchestrator(stages.endpoints, tmp_path / "state", cold_start_s=0.5)
        await orchestrator.start()
        try:
            await asyncio.wait_for(orchestrator.servicer.ready.wait(), 30)
            error = await refusal(orchestrator.endpoint, generate_request())
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert error.details().startswith("stage 'dit' at 127.0.0.1:"), error.details()
            assert "no replica came within 0.5 s" in error.details(), error.details()
        finally:
            await orchestrator.stop()
            await stages.stop()

    asyncio.run(scenario())


def test_each_pools_demand_is_exported_per_stage_and_model() -> None:
    async def scenario() -> None:
        pool = StagePool({"text-encoder": "127.0.0.1:1", "dit": "127.0.0.1:2", "vae": "127.0.0.1:3"})
        try:
            pool.routes.remember(DIT_INFO, "a test")
            registry = CollectorRegistry()
            registry.register(PoolDemandCollector(pool, lambda: {MODEL: 2}))
            dit = pool["dit"].demand
            dit.record(MODEL, 10.0)
            dit.record(MODEL, 20.0)

            def value(name: str, stage: str = "dit") -> float | None:
                return registry.get_sample_value(name, {"stage": stage, "model": MODEL})

            with dit.waiting_for_replica(MODEL), dit.calling(MODEL):
                assert value("stagediff_pool_calls_waiting") == value("stagediff_pool_calls_in_flight") == 1
                # (2 jobs queued + 1 call waiting) x the mean of the recent calls, 15 s.
                assert value("stagediff_pool_queued_work_seconds") == 45.0
            assert value("stagediff_pool_calls_waiting") == value("stagediff_pool_calls_in_flight") == 0
            assert value("stagediff_pool_replicas_serving") == 0
            assert value("stagediff_pool_queued_work_seconds", "vae") == 0.0  # no VAE call timed yet
            assert registry.get_sample_value("stagediff_model_jobs_queued", {"model": MODEL}) == 2
        finally:
            await pool.close()

    asyncio.run(scenario())
