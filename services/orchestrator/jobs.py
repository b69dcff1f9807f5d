"""Jobs, their event logs, and the manager that admits, schedules, persists and recovers them.

Every accepted request becomes a `Job` owned by one tenant. Its events (queued,
progress, result chunks, completed) are appended to the job's log; any number of
watchers (Generate, WatchJob) replay the log from the start and then follow it,
so a client that reconnects sees the whole history, result included.

Which job runs next is the `FairScheduler`'s decision (priority classes, then
weighted fair sharing between the tenants of a class, each tenant's running and
queued limits); `max_running` jobs run at once across the stages, so several
pipeline through them: while the DiT denoises one job, the VAE decodes another.

Every job is a record in the `JobStore` from the moment it is accepted until it
is pruned. The store is written before a client hears of a change: admission
(so a restart cannot lose an accepted job), each start, each finished stage's
intermediates (written by the pipeline, so a re-run resumes after the last
finished stage), the result (before the completion event), and every failure
or cancellation. `recover()` runs once at start-up: queued jobs queue again,
running ones queue again from their last finished stage, and finished ones are
served from the store (their results replayed from the files) when asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import context as otel_context

from services.logging_setup import log_context
from services.metrics import OrchestratorMetrics
from services.orchestrator.scheduler import AdmissionRefused, FairScheduler, TenantLimits
from services.orchestrator.store import InvalidTransition, JobRecord, JobStore
from services.orchestrator.tenants import Tenant
from services.tracing import set_grpc_status, start_span_under
from stagediff.v1 import generation_pb2

logger = logging.getLogger(__name__)

JobState = generation_pb2.JobState
TERMINAL_STATES = (JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED)

__all__ = ["AdmissionRefused", "Job", "JobManager", "JobState", "TERMINAL_STATES"]


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


@dataclass
class Job:
    job_id: str
    request: generation_pb2.GenerateRequest
    tenant: str = ""
    created_at: float = field(default_factory=time.time)
    state: int = JobState.JOB_STATE_QUEUED
    finished_at: float | None = None
    current_stage: str = ""
    error_code: grpc.StatusCode | None = None
    error_message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    num_frames_out: int = 0
    fps_out: float = 0.0
    # Absolute event-loop time after which the job is cancelled with DEADLINE_EXCEEDED.
    deadline: float | None = None
    # Results of finished stages, kept so that a failed later stage can be retried from them.
    intermediates: dict[str, object] = field(default_factory=dict)
    events: list[generation_pb2.GenerateEvent] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task | None = None
    priority: str = "normal"
    # The trace context of the request that submitted the job: its task runs under it, so the stage calls
    # join the client's trace.
    trace_context: otel_context.Context | None = None

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    async def publish(self, event: generation_pb2.GenerateEvent) -> None:
        event.job_id = self.job_id
        self.events.append(event)
        async with self.changed:
            self.changed.notify_all()

    async def finish(self, state: int, code: grpc.StatusCode | None = None, message: str = "") -> None:
        self.state = state
        self.error_code = code
        self.error_message = message
        self.finished_at = time.time()
        self.current_stage = ""
        self.intermediates.clear()
        async with self.changed:
            self.changed.notify_all()

    async def follow(self) -> AsyncIterator[generation_pb2.GenerateEvent]:
        """Yields every event from the first, then new ones until the job finishes."""
        sent = 0
        while True:
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.finished:
                return
            async with self.changed:
                if sent == len(self.events) and not self.finished:
                    await self.changed.wait()

    def to_proto(self, queue_position: int = 0) -> generation_pb2.Job:
        job = generation_pb2.Job(
            job_id=self.job_id,
            state=self.state,
            request=self.request,
            created_at=_timestamp(self.created_at),
            queue_position=queue_position,
            current_stage=self.current_stage,
            timings=self.timings,
            num_frames_out=self.num_frames_out,
            fps_out=self.fps_out,
        )
        if self.finished_at is not None:
            job.finished_at.CopyFrom(_timestamp(self.finished_at))
        if self.error_code is not None:
            job.error.code = self.error_code.value[0]
            job.error.message = self.error_message
        return job

    @classmethod
    def from_record(cls, record: JobRecord) -> Job:
        """A job as the store has it (no event log yet)."""
        job = cls(
            job_id=record.job_id,
            request=record.parse_request(),
            tenant=record.tenant,
            created_at=record.created_at,
            state=record.state,
            finished_at=record.finished_at,
            error_message=record.error_message,
            timings=dict(record.timings),
            num_frames_out=record.num_frames_out,
            fps_out=record.fps_out,
            priority=record.priority,
        )
        if record.error_code is not None:
            job.error_code = _status_code(record.error_code)
        return job


def _status_code(value: int) -> grpc.StatusCode:
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)


RunJob = Callable[[Job], Awaitable[None]]
# Puts a recovered job's stored intermediates (stage -> name -> tensor) back where the pipeline resumes from them.
RestoreJob = Callable[[Job, dict[str, dict[str, object]]], None]


class JobManager:
    """Admits jobs for tenants, runs them in the scheduler's order, and keeps every one in the store."""

    def __init__(
        self,
        run_job: RunJob,
        scheduler: FairScheduler,
        store: JobStore,
        *,
        restore_job: RestoreJob | None = None,
        max_kept: int = 1000,
        retention_s: float | None = None,
        max_attempts: int = 3,
        tenants: dict[str, Tenant] | None = None,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
        self.run_job = run_job
        self.restore_job = restore_job
        self.scheduler = scheduler
        self.store = store
        self.max_kept = max_kept
        self.retention_s = retention_s
        self.max_attempts = max_attempts
        # Tenants by name, for the weight and limits of jobs recovered after a restart.
        self.tenants = dict(tenants or {})
        self.metrics = metrics
        # Active jobs, and finished ones while watchers may still want their live log; the rest is in the store.
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.by_request_id: dict[tuple[str, str], str] = {}
        self.shutting_down = False

    # ------------------------------------------------------------------ admission --

    async def submit(
        self, request: generation_pb2.GenerateRequest, tenant: Tenant, deadline: float | None = None
    ) -> tuple[Job, bool]:
        """Queues a job for `tenant`; returns (job, created). A known request_id returns its job instead.

        `deadline` is event-loop time. Raises AdmissionRefused (with a retry-after) when the queue or the
        tenant's share of it is full.
        """
        existing = await self.find_request(tenant.name, request.request_id)
        if existing is not None:
            return existing, False
        job_id = uuid.uuid4().hex
        quotas = tenant.quotas
        self.scheduler.admit(
            job_id,
            tenant.name,
            tenant.priority,
            tenant.weight,
            TenantLimits(max_queued=quotas.max_queued_jobs, max_running=quotas.max_running_jobs),
        )
        deadline_at = None if deadline is None else time.time() + (deadline - asyncio.get_running_loop().time())
        try:
            record = self.store.insert(
                JobRecord.new(job_id, tenant.name, request, priority=tenant.priority.value, deadline_at=deadline_at)
            )
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
        )
        self._remember(job)
        # Watchers replay the log from the start, so the first event needs no notification.
        job.events.append(
            generation_pb2.GenerateEvent(
                job_id=job_id, queued=generation_pb2.JobQueued(position=self.scheduler.position(job_id) or 0)
            )
        )
        self._dispatch()
        return job, True

    async def find_request(self, tenant: str, request_id: str) -> Job | None:
        """The tenant's job with this request id: live, or rebuilt from the store (its result replayable)."""
        if not request_id:
            return None
        job_id = self.by_request_id.get((tenant, request_id))
        if job_id is not None and job_id in self.jobs:
            return self.jobs[job_id]
        record = self.store.find_by_request_id(tenant, request_id)
        return await self.get(record.job_id, tenant) if record is not None else None

    def _remember(self, job: Job) -> None:
        self.jobs[job.job_id] = job
        if job.request.request_id:
            self.by_request_id[(job.tenant, job.request.request_id)] = job.job_id

    # ---------------------------------------------------------------------- reads --

    async def get(self, job_id: str, tenant: str | None) -> Job | None:
        """The job if it exists and belongs to `tenant` (None: any tenant); a stored finished job gets its
        log rebuilt from the stored result, so it can be watched like a live one."""
        job = self.jobs.get(job_id)
        if job is None:
            record = self.store.get(job_id)
            # Another tenant's job is not read at all, let alone its result.
            if record is None or not record.finished or (tenant is not None and record.tenant != tenant):
                return None
            job = Job.from_record(record)
            if record.state == JobState.JOB_STATE_SUCCEEDED:
                result = await asyncio.to_thread(self.store.load_result, job_id)
                if result is not None:
                    job.events = await asyncio.to_thread(lambda: list(result.events(job_id)))
        if tenant is not None and job.tenant != tenant:
            return None
        return job

    def position(self, job: Job) -> int:
        return self.scheduler.position(job.job_id) or 0

    def list_jobs(self, tenant: str | None, state: int = 0, limit: int = 100) -> list[generation_pb2.Job]:
        """The tenant's jobs, newest first; live ones as they are now, the rest as stored."""
        states = None if state == JobState.JOB_STATE_UNSPECIFIED else [state]
        positions = self.scheduler.positions()  # once for the whole list: it simulates the queue order
        listed = []
        for record in self.store.list_jobs(states=states, tenant=tenant, limit=limit):
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
        if self.scheduler.remove(job.job_id):
            self._store_outcome(job.job_id, JobState.JOB_STATE_CANCELLED, code, message, job)
            await job.finish(JobState.JOB_STATE_CANCELLED, code, message)
            self._count_finished(job)
            self._update_gauges()
            await self._announce_positions()
            return
        if job.task is not None:
            job.intermediates["cancel_reason"] = (code, message)
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)

    def _dispatch(self) -> None:
        while (job_id := self.scheduler.next_runnable()) is not None:
            job = self.jobs[job_id]
            self.store.update_state(job_id, JobState.JOB_STATE_RUNNING)
            job.state = JobState.JOB_STATE_RUNNING
            if self.metrics is not None:
                self.metrics.observe_queue_time(max(0.0, time.time() - job.created_at), job.priority)
            job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"job-{job_id}")
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        # Counted from the jobs' states: the scheduler's `positions()` simulates the whole queue order.
        waiting: dict[str, int] = {"high": 0, "normal": 0, "low": 0}
        for job in self.jobs.values():
            if job.state == JobState.JOB_STATE_QUEUED:
                waiting[job.priority] = waiting.get(job.priority, 0) + 1
        for priority, count in waiting.items():
            self.metrics.set_queue_depth(count, priority)
        self.metrics.set_running(self.scheduler.running_count())

    def _count_finished(self, job: Job) -> None:
        """Counts a job that reached its final state, by tenant, model and status."""
        if self.metrics is None:
            return
        succeeded = job.state == JobState.JOB_STATE_SUCCEEDED
        code = grpc.StatusCode.OK if succeeded else (job.error_code or grpc.StatusCode.CANCELLED)
        latency = (job.finished_at or time.time()) - job.created_at if succeeded else None
        self.metrics.request_finished(tenant=job.tenant, model=job.request.model, code=code, latency_s=latency)

    async def _run(self, job: Job) -> None:
        # Everything logged for the job carries its id and tenant; its span joins the submitting client's trace.
        with (
            log_context(job_id=job.job_id, tenant=job.tenant),
            start_span_under(job.trace_context, "job", attributes={"stagediff.job_id": job.job_id}) as span,
        ):
            logger.info("job started after %.3f s in the queue", max(0.0, time.time() - job.created_at))
            await self._run_traced(job)
            logger.info("job %s%s", JobState.Name(job.state), f": {job.error_message}" if job.error_message else "")
            if job.error_code is not None:
                set_grpc_status(span, job.error_code, job.error_message)

    async def _run_traced(self, job: Job) -> None:
        try:
            await self.run_job(job)
        except asyncio.CancelledError:
            code, message = job.intermediates.get("cancel_reason", (grpc.StatusCode.CANCELLED, "cancelled"))
            if not self.shutting_down:
                self._store_outcome(job.job_id, JobState.JOB_STATE_CANCELLED, code, message, job)
            await job.finish(JobState.JOB_STATE_CANCELLED, code, message)
            logger.info("job %s cancelled: %s", job.job_id, message)
        except Exception:  # run_job records its own failures; this is a bug guard
            logger.exception("job %s failed unexpectedly", job.job_id)
            if not job.finished:
                self._store_outcome(job.job_id, JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, "internal error")
                await job.finish(JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, "internal error")
        else:
            if job.state == JobState.JOB_STATE_FAILED:
                self._store_outcome(job.job_id, job.state, job.error_code, job.error_message, job)
        finally:
            self.scheduler.finished(job.job_id)
            if not self.shutting_down:
                self._count_finished(job)
                await self._prune()
                self._dispatch()
                await self._announce_positions()
            self._update_gauges()

    def _store_outcome(
        self, job_id: str, state: int, code: grpc.StatusCode | None, message: str, job: Job | None = None
    ) -> None:
        """Records a failure or cancellation (success is stored by the pipeline with its result)."""
        # Already finished in the store (the result was stored just before a late cancel): nothing to record.
        with contextlib.suppress(InvalidTransition):
            self.store.update_state(
                job_id,
                state,
                error_code=None if code is None else code.value[0],
                error_message=message,
                timings=job.timings if job is not None else None,
                num_frames_out=job.num_frames_out if job is not None else None,
                fps_out=job.fps_out if job is not None else None,
            )

    async def _announce_positions(self) -> None:
        for job_id, position in self.scheduler.positions().items():
            job = self.jobs[job_id]
            last = next((e for e in reversed(job.events) if e.HasField("queued")), None)
            if last is None or last.queued.position != position:
                await job.publish(generation_pb2.GenerateEvent(queued=generation_pb2.JobQueued(position=position)))

    async def _prune(self) -> None:
        """Keeps at most max_kept finished jobs in the store (and retention_s of age), and in memory only
        finished jobs that are still being watched or finished recently."""
        removed = await asyncio.to_thread(self.store.prune, max_kept=self.max_kept, max_age_s=self.retention_s)
        for job_id in removed:
            self._forget(job_id)
        finished = [job_id for job_id, job in self.jobs.items() if job.finished]
        for job_id in finished[: max(0, len(finished) - 64)]:
            self._forget(job_id)

    def _forget(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is not None and job.request.request_id:
            self.by_request_id.pop((job.tenant, job.request.request_id), None)

    # ------------------------------------------------------------------ lifecycle --

    async def recover(self) -> int:
        """Queues again every job the store holds as queued or running (from its last finished stage).

        Runs once, before the servicer accepts requests. A job past its deadline fails with
        DEADLINE_EXCEEDED; one that has been started `max_attempts` times (and so may be what brings the
        orchestrator down) fails with INTERNAL. Returns how many jobs were queued again.
        """
        requeued = 0
        loop = asyncio.get_running_loop()
        for record in self.store.recoverable():
            job = Job.from_record(record)
            if record.deadline_at is not None and record.deadline_at <= time.time():
                self._store_outcome(
                    job.job_id,
                    JobState.JOB_STATE_FAILED,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "the job's deadline passed while the orchestrator was down",
                )
                continue
            if record.state == JobState.JOB_STATE_RUNNING:
                if record.attempts >= self.max_attempts:
                    self._store_outcome(
                        job.job_id,
                        JobState.JOB_STATE_FAILED,
                        grpc.StatusCode.INTERNAL,
                        f"the job was started {record.attempts} times without finishing",
                    )
                    continue
                self.store.update_state(job.job_id, JobState.JOB_STATE_QUEUED)
                job.state = JobState.JOB_STATE_QUEUED
                if self.restore_job is not None:
                    stored = await asyncio.to_thread(self.store.load_intermediates, job.job_id)
                    self.restore_job(job, stored)
            if record.deadline_at is not None:
                job.deadline = loop.time() + (record.deadline_at - time.time())
            tenant = self.tenants.get(record.tenant)
            weight, limits = 1.0, None
            if tenant is not None:
                weight = tenant.weight
                limits = TenantLimits(tenant.quotas.max_queued_jobs, tenant.quotas.max_running_jobs)
            self.scheduler.admit(job.job_id, record.tenant, record.priority, weight, limits, check_limits=False)
            self._remember(job)
            job.events.append(
                generation_pb2.GenerateEvent(
                    job_id=job.job_id,
                    queued=generation_pb2.JobQueued(position=self.scheduler.position(job.job_id) or 0),
                )
            )
            requeued += 1
        if requeued:
            logger.info("recovered %d unfinished job(s) from the store", requeued)
        self._dispatch()
        return requeued

    async def shutdown(self) -> None:
        """Stops every job without recording it as cancelled: the store keeps them queued or running,
        and the next start runs them again. Connected watchers get UNAVAILABLE."""
        self.shutting_down = True
        message = "the orchestrator is shutting down; the job will run again when it restarts"
        for job_id in list(self.scheduler.positions()):
            self.scheduler.remove(job_id)
            await self.jobs[job_id].finish(JobState.JOB_STATE_CANCELLED, grpc.StatusCode.UNAVAILABLE, message)
        running = [job for job in self.jobs.values() if job.task is not None and not job.finished]
        for job in running:
            job.intermediates["cancel_reason"] = (grpc.StatusCode.UNAVAILABLE, message)
            job.task.cancel()
        await asyncio.gather(*(job.task for job in running), return_exceptions=True)
