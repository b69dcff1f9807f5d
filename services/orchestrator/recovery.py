"""Restart recovery: the jobs the store holds as unfinished are queued again.

Every job is a record in the `JobStore` from the moment it is accepted until it
is pruned, and the store is written before a client hears of a change, so a
restart loses no accepted job. At start-up, before the servicer accepts
requests, queued jobs queue again and running ones queue again from their last
finished stage (their stored stage outputs are restored onto the job); finished
ones are served from the store (their results replayed from the files) when
asked for. A job past its deadline fails with DEADLINE_EXCEEDED; one that has
been started `max_attempts` times (and so may be what brings the orchestrator
down) fails with INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from services.orchestrator.dispatch import Dispatcher
from services.orchestrator.job import Job, JobState, JobTable
from services.orchestrator.scheduler import FairScheduler, TenantLimits
from services.orchestrator.store import JobRecord, JobStore
from services.orchestrator.tenants import Tenant
from stagediff.v1 import generation_pb2, tensor_pb2

logger = logging.getLogger(__name__)

# Puts a recovered job's stored stage outputs (stage -> the chunks it sent) back where the pipeline resumes from them.
RestoreJob = Callable[[Job, dict[str, list[tensor_pb2.TensorChunk]]], None]


async def recover(
    store: JobStore,
    scheduler: FairScheduler,
    table: JobTable,
    dispatcher: Dispatcher,
    tenants: dict[str, Tenant],
    *,
    restore_job: RestoreJob | None,
    max_attempts: int,
    requeue_running: bool = True,
) -> int:
    """Queues again every job the store holds as queued or running (from its last finished stage), with its
    tenant's weight and limits as they are in `tenants`, and fails those past their deadline or their attempts.
    Then every tenant's stored jobs are pruned to its limits and the queue starts. Returns how many jobs were
    queued again.

    `requeue_running=False` leaves running jobs to their owners (replicas on a shared database: a job whose
    owner died is requeued when its lease expires, `requeue_expired`); jobs already known here are skipped.
    """
    requeued = 0
    for record in await asyncio.to_thread(store.recoverable):
        if record.job_id in table.jobs or (record.state == JobState.JOB_STATE_RUNNING and not requeue_running):
            continue
        if await queue_again(
            record, store, scheduler, table, dispatcher, tenants, restore_job=restore_job, max_attempts=max_attempts
        ):
            requeued += 1
    if requeued:
        logger.info("recovered %d unfinished job(s) from the store", requeued)
    for tenant_name in await asyncio.to_thread(store.tenants):
        await dispatcher.pruner.prune_tenant(tenant_name)
    await dispatcher.dispatch()
    return requeued


async def queue_again(
    record: JobRecord,
    store: JobStore,
    scheduler: FairScheduler,
    table: JobTable,
    dispatcher: Dispatcher,
    tenants: dict[str, Tenant],
    *,
    restore_job: RestoreJob | None,
    max_attempts: int,
) -> bool:
    """Queues one stored unfinished job again (a running one from its last finished stage); False when it
    failed instead (past its deadline or its attempts). The caller dispatches."""
    job = Job.from_record(record)
    if record.deadline_at is not None and record.deadline_at <= time.time():
        await dispatcher.record_outcome(
            job.job_id,
            JobState.JOB_STATE_FAILED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "the job's deadline passed while the orchestrator was down",
        )
        return False
    if record.state == JobState.JOB_STATE_RUNNING or record.attempts > 0:
        if record.attempts >= max_attempts:
            await dispatcher.record_outcome(
                job.job_id,
                JobState.JOB_STATE_FAILED,
                grpc.StatusCode.INTERNAL,
                f"the job was started {record.attempts} times without finishing",
            )
            return False
        if record.state == JobState.JOB_STATE_RUNNING:
            await asyncio.to_thread(store.update_state, job.job_id, JobState.JOB_STATE_QUEUED)
        job.state = JobState.JOB_STATE_QUEUED
        if restore_job is not None:
            stored = await asyncio.to_thread(store.load_intermediates, job.job_id)
            restore_job(job, stored)
    if record.deadline_at is not None:
        job.deadline = asyncio.get_running_loop().time() + (record.deadline_at - time.time())
    tenant = tenants.get(record.tenant)
    weight, limits = 1.0, None
    if tenant is not None:
        weight = tenant.weight
        limits = TenantLimits(tenant.quotas.max_queued_jobs, tenant.quotas.max_running_jobs)
    scheduler.admit(job.job_id, record.tenant, record.priority, weight, limits, check_limits=False)
    table.remember(job)
    job.events.append(
        generation_pb2.GenerateEvent(
            job_id=job.job_id,
            queued=generation_pb2.JobQueued(position=scheduler.position(job.job_id) or 0),
        )
    )
    return True
