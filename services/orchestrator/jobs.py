"""The manager of jobs: admits them for tenants, runs them in the scheduler's order, and keeps each in the store.

Every accepted request becomes a `Job` (services/orchestrator/job.py) owned by
one tenant. `JobManager` composes the parts that each do one job:
- admission checks (admission.py): room on the state volume and in the tenant's
  `max_stored_bytes` before a job is queued;
- dispatch (dispatch.py): starting jobs in the `FairScheduler`'s order, running
  each to its end, recording failures and cancellations;
- pruning (pruning.py): each tenant's retention, and which finished jobs stay
  in memory (GetJob answers from the store's record for the others);
- recovery (recovery.py): at start-up, the unfinished jobs the store holds queue again.

Every job is a record in the `JobStore` from the moment it is accepted until it
is pruned. The store is written before a client hears of a change: admission
(so a restart cannot lose an accepted job), each start, each finished stage's
intermediates (written by the pipeline, so a re-run resumes after the last
finished stage), the result (before the completion event), and every failure or
cancellation. A failed write during a job fails that job (RESOURCE_EXHAUSTED
when the volume is full).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Mapping

import grpc
from opentelemetry import context as otel_context

from services.encoding import output_format
from services.metrics import OrchestratorMetrics
from services.orchestrator.admission import StorageLimits, queue_limits, result_bytes, without_image_bytes
from services.orchestrator.blobs.protocol import PresignsDownloads
from services.orchestrator.deadlines import DeadlineAdmission
from services.orchestrator.dispatch import MOVED, Dispatcher, RunJob
from services.orchestrator.job import Job, JobState, JobTable
from services.orchestrator.notices import take_request_notices
from services.orchestrator.pruning import Pruner
from services.orchestrator.recovery import Recovery, RestoreJob
from services.orchestrator.scheduler import FairScheduler, Priority
from services.orchestrator.store import (
    InvalidTransition,
    JobRecord,
    JobStore,
    MinFree,
    SavedImages,
    StoreError,
    StoreFull,
)
from services.orchestrator.tenants import Tenant
from stagediff.v1 import generation_pb2

logger = logging.getLogger(__name__)


class JobManager:
    """Admits jobs for tenants, runs them in the scheduler's order, and keeps every one in the store.

    Retention (per tenant; see services/orchestrator/pruning.py): `max_kept` finished jobs
    and `max_stored_bytes` (None: no limit) unless the tenant's quotas say
    otherwise, finished jobs at most `retention_s` old (None: no age limit), and
    `min_free` space kept free on the state volume.
    """

    def __init__(
        self,
        run_job: RunJob,
        scheduler: FairScheduler,
        store: JobStore,
        *,
        restore_job: RestoreJob | None = None,
        max_kept: int = 1000,
        max_stored_bytes: int | None = None,
        retention_s: float | None = None,
        min_free: MinFree | None = None,
        max_attempts: int = 3,
        tenants: Mapping[str, Tenant] | None = None,
        metrics: OrchestratorMetrics | None = None,
        deadlines: DeadlineAdmission | None = None,
    ) -> None:
        """`deadlines`: refuses at admission a job whose deadline the DiT cannot meet (None: every job is admitted
        and its deadline only cancels it)."""
        self.restore_job = restore_job
        self.deadlines = deadlines
        # Whether other replicas share the store (and may delete what this one remembers).
        self.shared_store = False
        self.scheduler = scheduler
        self.store = store
        self.max_attempts = max_attempts
        # Tenants by name, for the weight, limits and retention of jobs recovered after a restart.
        self.tenants = dict(tenants or {})
        self.metrics = metrics
        # Active jobs, and the latest finished ones; the rest is in the store.
        self.table = JobTable()
        self.jobs = self.table.jobs
        self.by_request_id = self.table.by_request_id
        self.limits = StorageLimits(
            store,
            scheduler,
            self.table,
            self.tenants,
            max_kept=max_kept,
            max_stored_bytes=max_stored_bytes,
            min_free=min_free or MinFree(),
        )
        self.pruner = Pruner(store, self.limits, self.table, retention_s)
        self.dispatcher = Dispatcher(run_job, scheduler, store, self.table, self.pruner, metrics)
        self.recovery = Recovery(
            store,
            scheduler,
            self.table,
            self.dispatcher,
            self.tenants,
            restore_job=restore_job,
            max_attempts=max_attempts,
        )

    @property
    def min_free(self) -> MinFree:
        """The space kept free on the state volume: new jobs are refused below it."""
        return self.limits.min_free

    @min_free.setter
    def min_free(self, value: MinFree) -> None:
        self.limits.min_free = value

    # ------------------------------------------------------------------ admission --

    async def submit(
        self, request: generation_pb2.GenerateRequest, tenant: Tenant, deadline: float | None = None
    ) -> tuple[Job, bool]:
        """Queues a job for `tenant`; returns (job, created). A known request_id returns its job instead.

        `deadline` is event-loop time. The job is for `request.model` (filled in: its tenant's limits on that
        model apply). Raises AdmissionRefused (with a retry-after) when the queue, the tenant's share of it or its
        share on the model is full, StorageRefused when there is no room to store the result, and
        LimitExceeded when the result alone is larger than the tenant's max_stored_bytes.
        """
        existing = await self.find_request(tenant.name, request.request_id)
        if existing is not None:
            return existing, False
        # The tenant as it is now (its quotas) is what pruning and recovery use for its jobs.
        self.tenants[tenant.name] = tenant
        self.limits.check_free_space(tenant.name)
        if self.deadlines is not None and request.deadline_s > 0:  # the call's own deadline cancels, never refuses
            due_in = min(request.deadline_s, deadline - asyncio.get_running_loop().time() if deadline else math.inf)
            self.deadlines.check(
                request, tenant.name, Priority.parse(tenant.priority.value), due_in, self.table.jobs.values()
            )
        await self.check_stored_bytes(tenant, result_bytes(request) + sum(len(image.data) for image in request.images))
        job_id = uuid.uuid4().hex
        # The images' bytes go to a file beside the job (counted in its tenant's bytes), never into its row or
        # its Job: a queued or finished job holds their digests and sizes only.
        try:
            saved = await asyncio.to_thread(self.store.save_input_images, job_id, request.images)
        except StoreFull as error:
            raise self.limits.disk_full(tenant.name, error) from None
        request = without_image_bytes(request)
        # The queue takes the job, the store records it and the table knows it under the dispatch lock, so no
        # dispatch meets a job the table does not know or the store does not hold.
        # Shielded: a client that hangs up meanwhile must not leave a job stored but unknown here, or queued
        # with no dispatch to start it.
        admitted, job = await asyncio.shield(self._admit_once(job_id, request, tenant, deadline, saved))
        if admitted is not None:
            return admitted, False
        assert job is not None
        # Room for the new job's result: the tenant's oldest finished jobs beyond its limits go now.
        await self.pruner.prune_tenant(tenant.name)
        return job, True

    async def _admit_once(
        self,
        job_id: str,
        request: generation_pb2.GenerateRequest,
        tenant: Tenant,
        deadline: float | None,
        saved: SavedImages | None,
    ) -> tuple[Job | None, Job | None]:
        """(the job its request id names, admitted meanwhile, None) or (None, the new job, dispatched)."""
        async with self.dispatcher.lock:
            admitted = self.table.by_request(tenant.name, request.request_id)
            if admitted is not None:  # the same request, admitted meanwhile
                if saved is not None:
                    await asyncio.to_thread(self.store.discard_saved_images, job_id, saved)
                return admitted, None
            job = await self._admit(job_id, request, tenant, deadline, saved)
        await self.dispatcher.dispatch()
        return None, job

    async def _admit(
        self,
        job_id: str,
        request: generation_pb2.GenerateRequest,
        tenant: Tenant,
        deadline: float | None,
        saved: SavedImages | None,
    ) -> Job:
        """Queues the job, stores it and remembers it (the caller holds the dispatch lock)."""
        try:
            self.scheduler.admit(
                job_id, tenant.name, tenant.priority, tenant.weight, queue_limits(tenant), model=request.model
            )
        except BaseException:
            if saved is not None:
                await asyncio.to_thread(self.store.discard_saved_images, job_id, saved)
            raise
        deadline_at = None if deadline is None else time.time() + (deadline - asyncio.get_running_loop().time())
        # The front end's notices are the job's; the request it stores and echoes keeps none.
        request, notices = take_request_notices(request)
        record = JobRecord.new(
            job_id, tenant.name, request, priority=tenant.priority.value, deadline_at=deadline_at, notices=notices
        )
        try:
            record = await asyncio.to_thread(self.store.insert, record, saved)
        except StoreFull as error:
            self.scheduler.remove(job_id)
            raise self.limits.disk_full(tenant.name, error) from None
        except BaseException:
            self.scheduler.remove(job_id)
            raise
        job = Job(
            job_id=job_id,
            request=request,
            tenant=tenant.name,
            created_at=record.created_at,
            deadline=deadline,
            priority=tenant.priority.value,
            trace_context=otel_context.get_current(),
            notices=notices,
        )
        self.table.remember(job)
        # Watchers replay the log from the start, so the first event needs no notification.
        job.events.append(
            generation_pb2.GenerateEvent(
                job_id=job_id, queued=generation_pb2.JobQueued(position=self.scheduler.position(job_id) or 0)
            )
        )
        return job

    async def check_stored_bytes(self, tenant: Tenant, needed: int) -> None:
        """Refuses a job that needs `needed` bytes (its result and input images) when they cannot fit the
        tenant's max_stored_bytes even after its finished jobs go. Admission checks a request's image bytes
        alone before it parses them; `submit` checks them with the result."""
        await self.limits.check_stored_bytes(tenant, needed)

    async def find_request(self, tenant: str, request_id: str) -> Job | None:
        """The tenant's job with this request id: live, or read back from the store (its result replayable)."""
        if not request_id:
            return None
        live = self.table.by_request(tenant, request_id)
        if live is not None:
            return live
        record = await asyncio.to_thread(self.store.find_by_request_id, tenant, request_id)
        return await self.get(record.job_id, tenant) if record is not None else None

    # ---------------------------------------------------------------------- reads --

    async def get(self, job_id: str, tenant: str | None) -> Job | None:
        """The job if it exists and belongs to `tenant` (None: any tenant).

        A finished job no longer in memory is built from its record alone; its result
        file is opened only when someone follows it (`Job.follow` replays it from disk).
        """
        job = self.jobs.get(job_id)
        # Another replica may have deleted a finished job (or its tenant's retention pruned it) since.
        stale = job is not None and job.finished and self.shared_store
        if stale and await asyncio.to_thread(self.store.get, job_id) is None:
            self.table.forget(job_id)
            return None
        if job is None:
            record = await asyncio.to_thread(self.store.get, job_id)
            if record is None or not record.finished or (tenant is not None and record.tenant != tenant):
                return None
            job = Job.from_record(record)
            if record.state == JobState.JOB_STATE_SUCCEEDED:
                job.stored_in = self.store
        if tenant is not None and job.tenant != tenant:
            return None
        return job

    def position(self, job: Job) -> int:
        return self.scheduler.position(job.job_id) or 0

    async def list_jobs(self, tenant: str | None, state: int = 0, limit: int = 100) -> list[generation_pb2.Job]:
        """The tenant's jobs, newest first; live ones as they are now, the rest as stored (read off the loop)."""
        states = None if state == JobState.JOB_STATE_UNSPECIFIED else [state]
        records = await asyncio.to_thread(self.store.list_jobs, states=states, tenant=tenant, limit=limit)
        positions = self.scheduler.positions()  # once for the whole list: it simulates the queue order
        listed = []
        for record in records:
            live = self.jobs.get(record.job_id)
            job = live if live is not None else Job.from_record(record)
            if states is None or job.state in states:
                listed.append(job.to_proto(positions.get(job.job_id, 0)))
        return listed

    # ------------------------------------------------------------------- changes --

    async def cancel(self, job: Job, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, message: str = "") -> None:
        """Cancels a queued or running job; the running stage calls are cancelled with it."""
        if job.finished:
            return
        message = message or "cancelled by the client"
        async with self.dispatcher.lock:  # the job is queued, or started with its task: never half started
            removed = self.scheduler.remove(job.job_id)
        if removed:
            await self.dispatcher.record_outcome(job.job_id, JobState.JOB_STATE_CANCELLED, code, message, job)
            await job.finish(JobState.JOB_STATE_CANCELLED, code, message)
            self.dispatcher.count_finished(job)
            self.dispatcher.update_gauges()
            await self.dispatcher.announce_positions()
            return
        if job.task is not None:
            job.intermediates["cancel_reason"] = (code, message)
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)

    async def delete(self, job: Job) -> bool:
        """Cancels the job if it is queued or running, then deletes its record and files from the store and
        forgets it; False when the store no longer had it (deleted meanwhile, or pruned)."""
        await self.cancel(job, message="deleted by the client")
        try:
            deleted = await asyncio.to_thread(self.store.delete, job.job_id)
        except InvalidTransition:  # still finishing its cancellation: it is terminal once its task returned
            await asyncio.gather(*(task for task in (job.task,) if task is not None), return_exceptions=True)
            deleted = await asyncio.to_thread(self.store.delete, job.job_id)
        self.table.forget(job.job_id)
        return deleted

    async def download_url(self, job: Job, expires_in_s: int) -> str | None:
        """A presigned GET of a succeeded job's encoded result, valid `expires_in_s`, where the blob store signs
        URLs; None without one, or once the result is deleted (its download then says so)."""
        blobs = self.store.files.blobs
        if not isinstance(blobs, PresignsDownloads):
            return None
        try:
            stored = await asyncio.to_thread(self.store.load_result, job.job_id)
        except StoreError:
            return None
        if stored is None or stored.encoded_key is None:
            return None
        extension = output_format(job.request.output_format).extension
        return await asyncio.to_thread(
            blobs.presigned_get,
            stored.encoded_key,
            expires_in_s,
            media_type=stored.media_type,
            filename=f"{job.job_id}{extension}",
        )

    # ------------------------------------------------------------------ lifecycle --

    async def recover(self) -> int:
        """Queues again every job the store holds as queued or running (from its last finished stage).

        Runs once, before the servicer accepts requests. A job past its deadline fails with
        DEADLINE_EXCEEDED; one that has been started `max_attempts` times (and so may be what brings the
        orchestrator down) fails with INTERNAL. Then every tenant's stored jobs are pruned to its limits.
        Returns how many jobs were queued again.
        """
        return await self.lead()

    @property
    def leading(self) -> bool:
        return self.dispatcher.leading

    async def lead(self, *, requeue_running: bool = True) -> int:
        """Becomes the replica that admits and dispatches: queues every stored unfinished job this replica does
        not know yet and starts the queue; returns how many were queued.

        `requeue_running=False` (replicas on a shared database): running jobs stay their owners', except those
        whose lease expired, which are requeued first; the lease keeper requeues later expiries.
        """
        self.dispatcher.leading = True
        if not requeue_running:
            await asyncio.to_thread(self.store.requeue_expired)
        return await self.recovery.recover(requeue_running=requeue_running)

    async def follow(self) -> None:
        """Stops admitting and dispatching (another replica leads): the queued jobs are the leader's now, so
        their watchers here end UNAVAILABLE and retry there. Running jobs run on here, under their leases."""
        async with self.dispatcher.lock:
            self.dispatcher.leading = False
            queued = list(self.scheduler.positions())
            for job_id in queued:
                self.scheduler.remove(job_id)
        for job_id in queued:
            await self.dispatcher.hand_over(self.jobs[job_id], "another orchestrator replica leads now; retry there")
        self.dispatcher.update_gauges()

    async def adopt_queued(self) -> int:
        """Queues here the stored queued jobs this leader does not know (requeued because their owner's lease
        expired, or handed back by a replica that left), each from its last finished stage; starts the queue.
        Returns how many."""
        adopted = 0
        async with self.dispatcher.lock:  # never between an admission's insert and its remember
            for job_id in await asyncio.to_thread(self.store.queued_ids):
                if job_id in self.jobs:
                    continue
                record = await asyncio.to_thread(self.store.get, job_id)
                if record is None or record.state != JobState.JOB_STATE_QUEUED:
                    continue
                adopted += await self.recovery.queue_again(record)
        await self.dispatcher.dispatch()
        return adopted

    async def release(self) -> None:
        """Stops the jobs still running here and puts them back in the queue at once, for the leader to start
        elsewhere from their last finished stage (a replica leaving after its drain)."""
        running = [job for job in self.jobs.values() if job.task is not None and not job.finished]
        for job in running:
            job.intermediates["handing_back"] = True  # nothing of this run is recorded as its outcome
            job.intermediates["cancel_reason"] = (grpc.StatusCode.UNAVAILABLE, MOVED)
            assert job.task is not None
            job.task.cancel()
        await asyncio.gather(*(job.task for job in running if job.task is not None), return_exceptions=True)
        for job in running:
            try:
                await asyncio.to_thread(self.store.update_state, job.job_id, JobState.JOB_STATE_QUEUED)
            except StoreError as error:  # lost or finished meanwhile: its lease decides
                logger.info("job %s: not handed back: %s", job.job_id, error)

    async def lose(self, job_id: str) -> None:
        """Stops a running job whose lease another replica took: nothing of it is recorded here. Its claim
        fences this replica's writes until its run here has ended, then is forgotten."""
        job = self.jobs.get(job_id)
        if job is not None and job.task is not None and not job.task.done():
            if not job.finished:
                job.intermediates["lease_lost"] = True
                job.intermediates["cancel_reason"] = (grpc.StatusCode.UNAVAILABLE, MOVED)
                job.task.cancel()
            # Waited for, never cancelled with the caller: a finished job's task may still record its outcome.
            await asyncio.wait([job.task])
        if job is not None:
            self.table.forget(job_id)  # a finished job: read from the store, where its new owner writes it
        self.store.forget_claim(job_id)

    async def drain(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the running jobs to finish (a replica leaving: it no longer leads)."""
        tasks = [job.task for job in self.jobs.values() if job.task is not None and not job.finished]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    async def shutdown(self) -> None:
        """Stops every job without recording it as cancelled: the store keeps them queued or running,
        and the next start runs them again. Connected watchers get UNAVAILABLE."""
        self.dispatcher.shutting_down = True
        message = "the orchestrator is shutting down; the job will run again when it restarts"
        for job_id in list(self.scheduler.positions()):
            self.scheduler.remove(job_id)
            await self.jobs[job_id].finish(JobState.JOB_STATE_CANCELLED, grpc.StatusCode.UNAVAILABLE, message)
        running = [(job, job.task) for job in self.jobs.values() if job.task is not None and not job.finished]
        for job, task in running:
            job.intermediates["handing_back"] = True  # to the next start, which resumes it
            job.intermediates["cancel_reason"] = (grpc.StatusCode.UNAVAILABLE, message)
            task.cancel()
        await asyncio.gather(*(task for _, task in running), return_exceptions=True)
