"""A tenant's limits on one model hold for the jobs the JobManager admits, and for those it recovers after a restart.

The JobManager and Pipeline are the orchestrator's own, with the stage calls replaced (tests.helpers.result_pipeline's
FramePipeline, held until the test releases it); the store is real, and reopened for the restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.orchestrator.jobs import JobManager
from services.orchestrator.scheduler import AdmissionRefused, FairScheduler, TenantCounts
from services.orchestrator.tenants import Quotas, Tenant
from stagediff.v1 import generation_pb2
from tests.helpers.result_pipeline import FramePipeline, make_request
from tests.helpers.store import SUCCEEDED, OpenStore

ACME = Tenant(name="acme", model_quotas={"A": Quotas(max_running_jobs=1, max_queued_jobs=1)})


def request_for(model: str) -> generation_pb2.GenerateRequest:
    request = make_request(1)
    request.model = model
    return request


def test_model_limits_hold_at_submit_and_after_a_restart(tmp_path: Path, open_store: OpenStore) -> None:
    release = asyncio.Event()

    async def hold(job, first: int) -> None:
        await release.wait()

    def manager(store) -> JobManager:
        return JobManager(FramePipeline(store, hold).run, FairScheduler(max_running=8), store, tenants={"acme": ACME})

    async def scenario() -> None:
        with open_store(tmp_path) as store:
            jobs = manager(store)
            for model in ("A", "A", "B"):
                await jobs.submit(request_for(model), ACME)
            # One job runs on A, the other waits for it; the job on B runs beside it.
            assert jobs.scheduler.counts("acme", "A") == TenantCounts(queued=1, running=1)
            assert jobs.scheduler.counts("acme", "B") == TenantCounts(queued=0, running=1)
            with pytest.raises(AdmissionRefused) as refused:
                await jobs.submit(request_for("A"), ACME)
            assert refused.value.scope == "model" and refused.value.model == "A"
            await jobs.shutdown()
        with open_store(tmp_path) as store:
            jobs = manager(store)
            assert await jobs.recover() == 3
            # Queued again each for its model: still one at a time on A.
            assert jobs.scheduler.counts("acme", "A") == TenantCounts(queued=1, running=1)
            assert jobs.scheduler.counts("acme", "B") == TenantCounts(queued=0, running=1)
            release.set()
            async with asyncio.timeout(30):
                while not all(job.finished for job in jobs.jobs.values()):
                    await asyncio.sleep(0.01)
            assert [job.state for job in jobs.jobs.values()] == [SUCCEEDED] * 3

    asyncio.run(scenario())
