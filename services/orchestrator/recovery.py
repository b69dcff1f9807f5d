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

from services.orchestrator.admission import queue_limits
from services.orchestrator.dispatch import Dispatcher
from services.orchestrator.job import Job, JobState, JobTable
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import JobRecord, JobStore
from services.orchestrator.tenants import Tenant
from stagediff.v1 import generation_pb2, tensor_pb2

logger = logging.getLogger(__name__)

# Puts a recovered job's stored stage outputs (stage -> the chunks it sent) back where the pipeline resumes from them.
RestoreJob = Callable[[Job, dict[str, list[tensor_pb2.TensorChunk]]], None]


class Recovery:
    """Queues stored unfinished jobs again: all of them at start-up (or when a replica takes the lead), and one
    by one those whose owner's lease expired. Jobs go to `scheduler` and `table` for the model their stored request
    names, with each tenant's weight and limits (per model too) as they are in `tenants`; outcomes are recorded
    through `dispatcher`."""

    def __init__(
        self,
        store: JobStore,
        scheduler: FairScheduler,
        table: JobTable,
        dispatcher: Dispatcher,
        tenants: dict[str, Tenant],
        *,
        restore_job: RestoreJob | None,
        max_attempts: int,
    ) -> None:
        self.store = store
        self.scheduler = scheduler
        self.table = table
        self.dispatcher = dispatcher
        self.tenants = tenants
        self.restore_job = restore_job
        self.max_attempts = max_attempts

    async def recover(self, *, requeue_running: bool = True) -> int:
        """Queues again every job the store holds as queued or running (from its last finished stage), and fails
        those past their deadline or their attempts. Then every tenant's stored jobs are pruned to its limits
        and the queue starts. Returns how many jobs were queued again.

        `requeue_running=False` leaves running jobs to their owners (replicas on a shared database: a job whose
        owner died is requeued when its lease expires, `requeue_expired`); jobs already known here are skipped.
        """
        requeued = 0
        for record in await asyncio.to_thread(self.store.recoverable):
            known = record.job_id in self.table.jobs
            if known or (record.state == JobState.JOB_STATE_RUNNING and not requeue_running):
                continue
            requeued += await self.queue_again(record)
        if requeued:
            logger.info("recovered %d unfinished job(s) from the store", requeued)
        for tenant_name in await asyncio.to_thread(self.store.tenants):
            await self.dispatcher.pruner.prune_tenant(tenant_name)
        await self.dispatcher.dispatch()
        return requeued

    async def queue_again(self, record: JobRecord) -> bool:
        """Queues one stored unfinished job again (a running one from its last finished stage); False when it
        failed instead (past its deadline or its attempts). The caller dispatches."""
        job = Job.from_record(record)
        if record.deadline_at is not None and record.deadline_at <= time.time():
            await self.dispatcher.record_outcome(
                job.job_id,
                JobState.JOB_STATE_FAILED,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the job's deadline passed while the orchestrator was down",
            )
            return False
        if record.state == JobState.JOB_STATE_RUNNING or record.attempts > 0:
            if record.attempts >= self.max_attempts:
                await self.dispatcher.record_outcome(
                    job.job_id,
                    JobState.JOB_STATE_FAILED,
                    grpc.StatusCode.INTERNAL,
                    f"the job was started {record.attempts} times without finishing",
                )
                return False
            if record.state == JobState.JOB_STATE_RUNNING:
                await asyncio.to_thread(self.store.update_state, job.job_id, JobState.JOB_STATE_QUEUED)
            job.state = JobState.JOB_STATE_QUEUED
            if self.restore_job is not None:
                stored = await asyncio.to_thread(self.store.load_intermediates, job.job_id)
                self.restore_job(job, stored)
        if record.deadline_at is not None:
            job.deadline = asyncio.get_running_loop().time() + (record.deadline_at - time.time())
        tenant = self.tenants.get(record.tenant)
        weight = tenant.weight if tenant is not None else 1.0
        self.scheduler.admit(
            job.job_id,
            record.tenant,
            record.priority,
            weight,
            queue_limits(tenant),
            model=job.request.model,
            check_limits=False,
        )
        self.table.remember(job)
        job.events.append(
            generation_pb2.GenerateEvent(
                job_id=job.job_id,
                queued=generation_pb2.JobQueued(position=self.scheduler.position(job.job_id) or 0),
            )
        )
        return True
