"""Retention belongs to tenants, and a full state volume or a failing store never leaks a slot.

The JobManager and Pipeline are the orchestrator's own, with the stage calls replaced (tests.test_result_spool's
FramePipeline); the store is real, and so is the full volume where this runs as root (a 2 MiB tmpfs).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest

from services.orchestrator.admission import StorageRefused
from services.orchestrator.job import JobState
from services.orchestrator.jobs import JobManager
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import RESULT_FILE, MinFree, StoreFull
from services.orchestrator.tenants import LimitExceeded, Quotas, Tenant
from tests.helpers.result_pipeline import FramePipeline, make_request
from tests.helpers.store import FAILED, SUCCEEDED, OpenStore, files, read_file


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def finish(jobs: JobManager, tenant: Tenant, request_id: str = "", num_frames: int = 1):
    job, created = await jobs.submit(make_request(num_frames, request_id=request_id), tenant)
    assert created
    await job.task
    assert job.state == SUCCEEDED, job.error_message
    return job


def test_one_tenant_finishing_many_jobs_never_deletes_another_tenants(tmp_path: Path, open_store: OpenStore) -> None:
    acme, beta = Tenant(name="acme"), Tenant(name="beta")
    small = Tenant(name="small", quotas=Quotas(max_kept_jobs=1))
    clock = FakeClock()

    async def scenario() -> None:
        with open_store(tmp_path, clock=clock) as store:
            jobs = JobManager(
                FramePipeline(store).run,
                FairScheduler(),
                store,
                max_kept=3,
                retention_s=3600,
                tenants={t.name: t for t in (acme, beta, small)},
            )
            kept_by_beta = [await finish(jobs, beta, f"beta-{i}") for i in range(2)]
            acme_jobs = [await finish(jobs, acme, f"acme-{i}") for i in range(4)]  # one more than max_kept
            # Only acme's own oldest went; beta keeps its jobs, results and request ids.
            assert store.get(acme_jobs[0].job_id) is None
            assert [r.job_id for r in store.finished_jobs(tenant="acme")] == [j.job_id for j in acme_jobs[:0:-1]]
            for i, job in enumerate(kept_by_beta):
                assert (await jobs.find_request("beta", f"beta-{i}")).job_id == job.job_id
                assert f"{job.job_id}/{RESULT_FILE}" in files(store)
            assert await jobs.find_request("acme", "acme-0") is None  # its own request id is free again
            # A tenant's quota overrides the default.
            small_jobs = [await finish(jobs, small) for _ in range(2)]
            assert [r.job_id for r in store.finished_jobs(tenant="small")] == [small_jobs[1].job_id]
            assert len(store.finished_jobs(tenant="acme")) == 3
            # Age: an hour later, the next finished job takes every tenant's expired jobs with it.
            clock.now += 3601
            latest = await finish(jobs, small)
            assert [r.job_id for r in store.finished_jobs(limit=1000)] == [latest.job_id]
            assert not any(job_id in jobs.jobs for job_id in (j.job_id for j in kept_by_beta + acme_jobs))

    asyncio.run(scenario())


def test_stored_bytes_are_a_tenant_quota(tmp_path: Path, open_store: OpenStore) -> None:
    one_frame = 16 * 32 * 3  # make_request's frames
    release = asyncio.Event()

    async def hold(job, first: int) -> None:
        if job.request.seed == 1:
            await release.wait()

    async def scenario() -> None:
        with open_store(tmp_path) as store:
            size = None
            jobs = JobManager(FramePipeline(store, hold).run, FairScheduler(max_running=8), store)
            probe = Tenant(name="probe")
            first = await finish(jobs, probe)
            size = len(read_file(store, first.job_id, RESULT_FILE))
            tenant = Tenant(name="acme", quotas=Quotas(max_stored_bytes=3 * size + 100))
            other = Tenant(name="beta", quotas=Quotas(max_stored_bytes=3 * size + 100))
            beta_jobs = [await finish(jobs, other) for _ in range(3)]
            acme_jobs = [await finish(jobs, tenant) for _ in range(4)]
            # Making room for acme's fourth result took acme's oldest, never beta's.
            assert store.get(acme_jobs[0].job_id) is None
            assert all(store.get(j.job_id) is not None for j in acme_jobs[1:] + beta_jobs)
            assert store.usage("acme").total == 3 * size and store.usage("beta").total == 3 * size
            # A result larger than the quota can never be stored: PERMISSION_DENIED naming the quota.
            with pytest.raises(LimitExceeded, match="max_stored_bytes") as too_big:
                await jobs.submit(make_request(4), tenant)
            assert too_big.value.code == grpc.StatusCode.PERMISSION_DENIED and too_big.value.value == 4 * one_frame
            # Jobs still running hold their results' room: a fourth is refused until they finish.
            running = [(await jobs.submit(make_request(1, seed=1), tenant))[0] for _ in range(3)]
            with pytest.raises(StorageRefused, match="max_stored_bytes") as refused:
                await jobs.submit(make_request(1), tenant)
            assert refused.value.scope == "storage" and refused.value.retry_after_s > 0
            # Their room came from acme's finished jobs, all gone now.
            assert all(store.get(j.job_id) is None for j in acme_jobs)
            release.set()
            await asyncio.gather(*(job.task for job in running))
            assert all(job.state == SUCCEEDED for job in running)
            await finish(jobs, tenant)
            assert store.usage("acme").total <= 3 * size + 100

    asyncio.run(scenario())


def test_new_jobs_are_refused_while_the_state_volume_is_nearly_full(tmp_path: Path, open_store: OpenStore) -> None:
    async def scenario() -> None:
        with open_store(tmp_path) as store:
            free = shutil.disk_usage(tmp_path).free
            jobs = JobManager(
                FramePipeline(store).run, FairScheduler(), store, min_free=MinFree(bytes=free + (1 << 40))
            )
            with pytest.raises(StorageRefused, match="--min-free-bytes") as refused:
                await jobs.submit(make_request(1), Tenant(name="acme"))
            assert refused.value.scope == "disk" and refused.value.retry_after_s > 0
            assert store.list_jobs() == [] and jobs.scheduler.depth() == 0
            jobs.min_free = MinFree(percent=0.0)
            await finish(jobs, Tenant(name="acme"))

    asyncio.run(scenario())


def test_a_store_error_at_dispatch_fails_that_job_and_the_queue_moves_on(tmp_path: Path, open_store: OpenStore) -> None:
    async def scenario() -> None:
        with open_store(tmp_path) as store:
            scheduler = FairScheduler(max_running=1)
            jobs = JobManager(FramePipeline(store).run, scheduler, store)
            tenant = Tenant(name="acme")
            update_state = store.update_state
            failures = []

            def update_state_once_full(job_id, state, **fields):
                if state == JobState.JOB_STATE_RUNNING and not failures:
                    failures.append(job_id)
                    raise StoreFull("the job database failed: database or disk is full")
                return update_state(job_id, state, **fields)

            store.update_state = update_state_once_full
            first, _ = await jobs.submit(make_request(1), tenant)
            assert failures == [first.job_id]
            assert first.state == FAILED and first.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "could not be started" in first.error_message
            assert store.get(first.job_id).state == FAILED
            assert scheduler.running_count() == 0
            second, _ = await jobs.submit(make_request(1), tenant)
            await second.task
            assert second.state == SUCCEEDED and scheduler.running_count() == 0

    asyncio.run(scenario())
