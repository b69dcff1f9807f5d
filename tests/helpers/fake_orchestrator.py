"""The real GenerationServicer, its interceptors and its port's message limit, in front of fake stages that
never run a model (jobs wait until the orchestrator stops); served on 127.0.0.1 from its own thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc

from services.metrics import OrchestratorMetrics
from services.orchestrator.job import JobState
from services.orchestrator.jobs import JobManager
from services.orchestrator.request_bounds import RequestBoundsInterceptor
from services.orchestrator.routes import ModelRoutes
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.service import PUBLIC_PORT_OPTIONS
from services.orchestrator.servicer import GenerationServicer
from services.orchestrator.store import JobStore
from services.orchestrator.tenant_auth import TenantAuthInterceptor
from services.orchestrator.tenants import (
    TenantRegistry,
)
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2

MODEL = "tiny"
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
LIMITS = stages_pb2.ModelLimits(
    height_multiple=16,
    width_multiple=16,
    temporal_factor=4,
    max_height=1024,
    max_width=1024,
    max_frames=129,
    max_inference_steps=1000,
    max_sequence_length=32,
    max_prompt_chars=10_000,
    default_height=32,
    default_width=32,
    default_num_frames=9,
    default_inference_steps=2,
    default_guidance_scale=5.0,
    default_fps=16.0,
    min_height=16,
)


GRACE_S = 0.5


class FakeStage:
    def __init__(self, name: str) -> None:
        self.name = name
        self.info = stages_pb2.StageInfo(stage=name, model=MODEL, family="wan-t2v", limits=LIMITS)
        self.replicas: list = []
        self.endpoint = f"{name}.internal:1234"
        self.health = "SERVING"
        self.detail = ""

    def info_for(self, accepts) -> stages_pb2.StageInfo:
        return self.info

    def serving(self, accepts=None) -> list[SimpleNamespace]:
        return [SimpleNamespace(endpoint=self.endpoint, info=self.info, serving=True)]


class FakeStagePool:
    """The stages as a servicer sees them; probing on a call would be a fan-out per GetClusterInfo."""

    cold_start_s = 0.0  # stages are never at zero here

    def __init__(self) -> None:
        self.stages = {name: FakeStage(name) for name in ("text-encoder", "dit", "vae", "interp")}

    def __getitem__(self, name: str) -> FakeStage:
        return self.stages[name]

    async def probe_all(self) -> None:
        raise AssertionError("GetClusterInfo probed every replica for one call")

    @property
    def routes(self) -> ModelRoutes:
        routes = ModelRoutes()
        routes.learn(self.stages["dit"].serving())
        return routes


class Orchestrator:
    """A GenerationServicer served on 127.0.0.1 from its own event-loop thread.

    Its jobs run a fake pipeline that reports a progress event and then waits until `release` is set.
    """

    def __init__(self, state_dir: Path, tenants: TenantRegistry) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.store = JobStore.open(state_dir)
        self.metrics = OrchestratorMetrics()
        self.release = threading.Event()
        self.port = self.call(self._start(tenants))

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    async def _run_job(self, job) -> None:
        await job.publish(
            generation_pb2.GenerateEvent(progress=generation_pb2.StageProgress(stage="dit", step=1, total=2))
        )
        while not self.release.is_set():
            await asyncio.sleep(0.02)
        await job.finish(JobState.JOB_STATE_FAILED, grpc.StatusCode.ABORTED, "released by the test")

    async def _start(self, tenants: TenantRegistry) -> int:
        jobs = JobManager(self._run_job, FairScheduler(max_queued=16, max_running=4), self.store, metrics=self.metrics)
        self.jobs = jobs
        self.servicer = GenerationServicer(FakeStagePool(), jobs, tenants, self.metrics, detach_grace_s=GRACE_S)
        self.servicer.ready.set()
        self.server = grpc.aio.server(
            interceptors=[TenantAuthInterceptor(tenants), RequestBoundsInterceptor([GENERATION])],
            options=PUBLIC_PORT_OPTIONS,
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def state(self, job_id: str) -> int:
        return self.jobs.jobs[job_id].state if job_id in self.jobs.jobs else self.store.get(job_id).state

    def stop(self) -> None:
        self.release.set()

        async def stop() -> None:
            await self.servicer.followers.close()
            await self.server.stop(None)
            await self.jobs.shutdown()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.store.close()
