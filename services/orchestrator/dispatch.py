"""Starting jobs in the scheduler's order, running each to its end, and recording how it ended.

Which job runs next is the `FairScheduler`'s decision (priority classes, then
weighted fair sharing between the tenants of a class, each tenant's running and
queued limits); `max_running` jobs run at once across the stages, so several
pipeline through them: while the DiT denoises one job, the VAE decodes another.

The store is written before a client hears of a change: each start, and every
failure or cancellation (the pipeline writes a success with its result). A store
error never leaks a running slot or stalls the queue: a job whose start cannot be
recorded fails at once (its slot goes to the next job), and an outcome that
cannot be recorded is logged (the store still holds the job as unfinished, so the
next start runs it again). While shutting down, outcomes are not recorded: the
store keeps the stopped jobs queued or running for the next start.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from services.logging_setup import log_context
from services.metrics import OrchestratorMetrics
from services.orchestrator.job import Job, JobState, JobTable
from services.orchestrator.pruning import Pruner
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.store import InvalidTransition, JobStore, StoreError, StoreFull
from services.orchestrator.store_retry import store_call
from services.tracing import set_grpc_status, start_span_under
from stagediff.v1 import generation_pb2

logger = logging.getLogger(__name__)

RunJob = Callable[[Job], Awaitable[None]]
MOVED = "the job moved to another orchestrator replica; retry to reach it there"


def store_failure(error: StoreError, what: str) -> tuple[grpc.StatusCode, str]:
    """The status a job fails with when the store fails it: RESOURCE_EXHAUSTED when out of space."""
    if isinstance(error, StoreFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: the orchestrator's state volume is full ({error})"
    return grpc.StatusCode.INTERNAL, f"{what}: the orchestrator's job store failed ({error})"


class Dispatcher:
    """Runs the jobs the scheduler lets start, each under `run_job`, and records their failures and
    cancellations; after each job the queue moves on and its tenant is pruned."""

    def __init__(
        self,
        run_job: RunJob,
        scheduler: FairScheduler,
        store: JobStore,
        table: JobTable,
        pruner: Pruner,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
        self.run_job = run_job
        self.scheduler = scheduler
        self.store = store
        self.table = table
        self.pruner = pruner
        self.metrics = metrics
        self.shutting_down = False
        # Whether this replica dispatches (it leads); a follower's jobs are the leader's to start.
        self.leading = True
        # Held while jobs start, and while admission queues, stores and remembers a new one.
        self.lock = asyncio.Lock()

    async def dispatch(self) -> None:
        """Starts every job the scheduler lets start. A job whose start cannot be recorded fails at once and
        gives its running slot back, so the next one still starts.

        Shielded: a caller cancelled meanwhile (a client that hung up during its admission) must not leave a
        job claimed in the store and taken from the queue, yet without the task that runs it.
        """
        await asyncio.shield(self._dispatch())

    async def _dispatch(self) -> None:
        async with self.lock:
            while self.leading and (job_id := self.scheduler.next_runnable()) is not None:
                await self._start(self.table.jobs[job_id])
        self.update_gauges()

    async def _start(self, job: Job) -> None:
        """Claims a job the scheduler let start (in the store: RUNNING, owned by this replica) and runs it."""
        job_id = job.job_id
        try:
            await store_call(self.store.update_state, job_id, JobState.JOB_STATE_RUNNING)
        except InvalidTransition:  # no longer queued: another replica claimed it (a former leader's admission)
            self.scheduler.finished(job_id)
            await self.hand_over(job)
            return
        except StoreError as error:
            self.scheduler.finished(job_id)
            code, message = store_failure(error, "the job could not be started")
            logger.error("job %s: %s", job_id, message)
            await self.record_outcome(job_id, JobState.JOB_STATE_FAILED, code, message, job)
            await job.finish(JobState.JOB_STATE_FAILED, code, message)
            self.count_finished(job)
            return
        job.state = JobState.JOB_STATE_RUNNING
        if self.metrics is not None:
            self.metrics.observe_queue_time(max(0.0, time.time() - job.created_at), job.priority)
        job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"job-{job_id}")

    def update_gauges(self) -> None:
        """Sets the queue-depth and running gauges from the jobs in memory."""
        if self.metrics is None:
            return
        # Counted from the jobs' states: the scheduler's `positions()` simulates the whole queue order.
        waiting: dict[str, int] = {"high": 0, "normal": 0, "low": 0}
        for job in self.table.jobs.values():
            if job.state == JobState.JOB_STATE_QUEUED:
                waiting[job.priority] = waiting.get(job.priority, 0) + 1
        for priority, count in waiting.items():
            self.metrics.set_queue_depth(count, priority)
        self.metrics.set_running(self.scheduler.running_count())

    def count_finished(self, job: Job) -> None:
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
            lost = bool(job.intermediates.get("lease_lost"))
            if not self.shutting_down and not lost and not job.intermediates.get("handing_back"):
                await self.record_outcome(job.job_id, JobState.JOB_STATE_CANCELLED, code, message, job)
            await job.finish(JobState.JOB_STATE_CANCELLED, code, message)
            if lost:  # its run here is over: nothing writes the job under the lost claim any more
                self.store.forget_claim(job.job_id)
            logger.info("job %s cancelled: %s", job.job_id, message)
        except Exception:  # run_job records its own failures; this is a bug guard
            logger.exception("job %s failed unexpectedly", job.job_id)
            if not job.finished:
                await self.record_outcome(
                    job.job_id, JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, "internal error"
                )
                await job.finish(JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, "internal error")
        else:
            if job.state == JobState.JOB_STATE_FAILED:
                await self.record_outcome(job.job_id, job.state, job.error_code, job.error_message, job)
        finally:
            self.scheduler.finished(job.job_id)
            if not self.shutting_down:
                self.count_finished(job)
                await self.dispatch()
                await self.announce_positions()
                await self.pruner.prune_tenant(job.tenant)
            self.update_gauges()

    async def hand_over(self, job: Job, message: str = MOVED) -> None:
        """Lets go of a job another replica holds now: its watchers here end UNAVAILABLE (their retry reaches
        the holder) and this replica forgets it, recording nothing."""
        await job.finish(JobState.JOB_STATE_CANCELLED, grpc.StatusCode.UNAVAILABLE, message)
        self.table.forget(job.job_id)

    async def record_outcome(
        self, job_id: str, state: int, code: grpc.StatusCode | None, message: str, job: Job | None = None
    ) -> None:
        """Records a failure or cancellation (success is stored by the pipeline with its result).

        Best effort: if the store cannot record it, the job stays unfinished there and runs again at the
        next start; the clients already hear the outcome from the job itself.
        """
        try:
            await store_call(
                functools.partial(
                    self.store.update_state,
                    job_id,
                    state,
                    error_code=None if code is None else code.value[0],
                    error_message=message,
                    timings=job.timings if job is not None else None,
                    num_frames_out=job.num_frames_out if job is not None else None,
                    fps_out=job.fps_out if job is not None else None,
                )
            )
        except InvalidTransition:
            pass  # already finished in the store (the result was stored just before a late cancel)
        except StoreError as error:
            logger.error("job %s: could not record that it ended %s: %s", job_id, JobState.Name(state), error)

    async def announce_positions(self) -> None:
        """Tells each queued job's watchers its position, when it changed since the last it logged."""
        for job_id, position in self.scheduler.positions().items():
            job = self.table.jobs[job_id]
            last = next(
                (
                    e
                    for e in reversed(job.events)
                    if isinstance(e, generation_pb2.GenerateEvent) and e.HasField("queued")
                ),
                None,
            )
            if last is None or last.queued.position != position:
                await job.publish(generation_pb2.GenerateEvent(queued=generation_pb2.JobQueued(position=position)))
