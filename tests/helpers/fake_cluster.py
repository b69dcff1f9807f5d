"""Fake stages and a real orchestrator in front of them, with a tenants file of an ordinary tenant and an
admin: a cluster in process, for the tenant and adapter admission checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.orchestrator.adapter_rate import AdapterRate
from services.orchestrator.jobs import JobManager
from services.orchestrator.pipeline import Pipeline, restore_intermediates
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.servicer import GenerationServicer
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.store import JobStore
from services.orchestrator.tenant_auth import TenantAuthInterceptor
from services.orchestrator.tenants import TenantRegistry, hash_api_key
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2
from tests.helpers.fake_stages import LIMITS, FakeDenoiser, FakeTextEncoder, FakeVae, generate_request, serve_stage

KEYS = {"acme": "sd_acme-key", "ops": "sd_ops-key"}


def tenants_file(**acme_quotas) -> TenantRegistry:
    """'acme', an ordinary tenant that may use every public adapter, and 'ops', an admin."""
    return TenantRegistry.from_dict(
        {
            "tenants": [
                {"name": "acme", "api_keys": [hash_api_key(KEYS["acme"])], "loras": ["*"], "quotas": acme_quotas},
                {"name": "ops", "api_keys": [hash_api_key(KEYS["ops"])], "admin": True, "loras": ["*"]},
            ]
        }
    )


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


class RecordingDenoiser(FakeDenoiser):
    """The fake DiT, remembering each call's params; with `failure` set it refuses every call with it."""

    def __init__(self) -> None:
        super().__init__()
        self.params: list[stages_pb2.DenoiseParams] = []
        self.failure: str | None = None

    async def Denoise(self, request_iterator, context):
        async def recorded():
            async for request in request_iterator:
                if request.HasField("params"):
                    self.params.append(request.params)
                yield request

        if self.failure is not None:
            async for _ in recorded():
                pass
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.failure)
        async for response in super().Denoise(recorded(), context):
            yield response


class CountingTextEncoder(FakeTextEncoder):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def Encode(self, request, context):
        self.calls += 1
        async for response in super().Encode(request, context):
            yield response


class Cluster:
    """Fake stages and a real orchestrator in front of them, with `tenants_file`'s tenants."""

    def __init__(
        self,
        state_dir: Path,
        dit_limits: stages_pb2.ModelLimits = LIMITS,
        batch_per_tenant: bool = True,
        adapter_rate: AdapterRate | None = None,
        **acme_quotas,
    ) -> None:
        self.state_dir = state_dir
        self.dit_limits = dit_limits
        self.batch_per_tenant = batch_per_tenant
        self.adapter_rate = adapter_rate
        self.tenants = tenants_file(**acme_quotas)
        self.text_encoder = CountingTextEncoder()
        self.denoiser = RecordingDenoiser()

    async def __aenter__(self) -> Cluster:
        self.servers: list[grpc.aio.Server] = []
        self.endpoints: dict[str, str] = {}
        stages = (("text-encoder", self.text_encoder), ("dit", self.denoiser), ("vae", FakeVae()))
        for name, servicer in stages:
            server, self.endpoints[name] = await serve_stage(name, servicer, self.dit_limits)
            self.servers.append(server)
        self.pool = StagePool(self.endpoints, probe_interval_s=0.1)
        self.store = JobStore.open(self.state_dir)
        pipeline = Pipeline(
            self.pool,
            retry_backoff_s=0.01,
            store=self.store,
            cluster_secret="s",
            batch_per_tenant=self.batch_per_tenant,
        )
        self.jobs = JobManager(pipeline.run, FairScheduler(), self.store, restore_job=restore_intermediates)
        self.servicer = GenerationServicer(self.pool, self.jobs, self.tenants, adapter_rate=self.adapter_rate)
        self.server = grpc.aio.server(interceptors=[TenantAuthInterceptor(self.tenants)])
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        await asyncio.wait_for(self.servicer.start(), 10)
        self.channel = grpc.aio.insecure_channel(self.endpoint)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.jobs.shutdown()
        await self.pool.close()
        self.store.close()
        for server in self.servers:
            await server.stop(None)

    async def generate(self, tenant: str, **fields) -> grpc.aio.AioRpcError | None:
        """Runs a request to its end: None when it succeeded, else the error the stream ended with."""
        try:
            async for _ in self.stub.Generate(generate_request(**fields), metadata=auth(tenant), timeout=30):
                pass
        except grpc.aio.AioRpcError as error:
            return error
        return None

    async def job_errors(self, tenant: str) -> list[str]:
        """The error message of each of the tenant's jobs, as GetJob and ListJobs show them."""
        listed = await self.stub.ListJobs(generation_pb2.ListJobsRequest(), metadata=auth(tenant))
        messages = [job.error.message for job in listed.jobs]
        for job in listed.jobs:
            got = await self.stub.GetJob(generation_pb2.GetJobRequest(job_id=job.job_id), metadata=auth(tenant))
            messages.append(got.error.message)
            with pytest.raises(grpc.aio.AioRpcError) as watched:
                async for _ in self.stub.WatchJob(
                    generation_pb2.WatchJobRequest(job_id=job.job_id), metadata=auth(tenant)
                ):
                    pass
            messages.append(watched.value.details())
        return messages
