"""Jobs, their event logs and the queue that runs them.

Every accepted request becomes a `Job`. Its events (queued, progress, result
chunks, completed) are appended to the job's log; any number of watchers
(Generate, WatchJob) replay the log from the start and then follow it, so a
client that reconnects sees the whole history, result included.

A fixed number of jobs run at once (`max_running`); since the stages run on
separate pools, several running jobs pipeline through them: while the DiT
denoises one job, the VAE decodes another.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from stagediff.v1 import generation_pb2

logger = logging.getLogger(__name__)

JobState = generation_pb2.JobState
TERMINAL_STATES = (JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED)


class QueueFull(Exception):
    """Admission refused: the queue holds as many jobs as it may."""


def _timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


@dataclass
class Job:
    job_id: str
    request: generation_pb2.GenerateRequest
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


RunJob = Callable[[Job], Awaitable[None]]


class JobManager:
    """Admits jobs into a bounded FIFO queue and runs up to `max_running` at once."""

    def __init__(self, run_job: RunJob, max_running: int = 4, max_queued: int = 256, max_kept: int = 1000) -> None:
        self.run_job = run_job
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_kept = max_kept
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.by_request_id: dict[str, str] = {}
        self.queue: deque[Job] = deque()
        self.running: set[str] = set()

    def submit(self, request: generation_pb2.GenerateRequest) -> tuple[Job, bool]:
        """Queues a job; returns (job, created). A known request_id returns its job instead."""
        if request.request_id and request.request_id in self.by_request_id:
            return self.jobs[self.by_request_id[request.request_id]], False
        if len(self.queue) >= self.max_queued:
            raise QueueFull(f"the queue holds {len(self.queue)} jobs, its limit; retry later")
        job = Job(job_id=uuid.uuid4().hex, request=request)
        self.jobs[job.job_id] = job
        if request.request_id:
            self.by_request_id[request.request_id] = job.job_id
        # Watchers replay the log from the start, so the first event needs no notification.
        job.events.append(
            generation_pb2.GenerateEvent(job_id=job.job_id, queued=generation_pb2.JobQueued(position=len(self.queue)))
        )
        self.queue.append(job)
        self._forget_old_jobs()
        self._dispatch()
        return job, True

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def position(self, job: Job) -> int:
        try:
            return self.queue.index(job)
        except ValueError:
            return 0

    async def cancel(self, job: Job, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, message: str = "") -> None:
        """Cancels a queued or running job; the running stage calls are cancelled with it."""
        if job.finished:
            return
        message = message or "cancelled by the client"
        if job in self.queue:
            self.queue.remove(job)
            await job.finish(JobState.JOB_STATE_CANCELLED, code, message)
            await self._announce_positions()
            return
        if job.task is not None:
            job.intermediates["cancel_reason"] = (code, message)
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)

    def _dispatch(self) -> None:
        while self.queue and len(self.running) < self.max_running:
            job = self.queue.popleft()
            self.running.add(job.job_id)
            job.state = JobState.JOB_STATE_RUNNING
            job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"job-{job.job_id}")

    async def _run(self, job: Job) -> None:
        try:
            await self.run_job(job)
        except asyncio.CancelledError:
            code, message = job.intermediates.get("cancel_reason", (grpc.StatusCode.CANCELLED, "cancelled"))
            await job.finish(JobState.JOB_STATE_CANCELLED, code, message)
            logger.info("job %s cancelled: %s", job.job_id, message)
        except Exception:  # run_job records its own failures; this is a bug guard
            logger.exception("job %s failed unexpectedly", job.job_id)
            if not job.finished:
                await job.finish(JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, "internal error")
        finally:
            self.running.discard(job.job_id)
            self._dispatch()
            await self._announce_positions()

    async def _announce_positions(self) -> None:
        for position, job in enumerate(list(self.queue)):
            last = next((e for e in reversed(job.events) if e.HasField("queued")), None)
            if last is None or last.queued.position != position:
                await job.publish(generation_pb2.GenerateEvent(queued=generation_pb2.JobQueued(position=position)))

    def _forget_old_jobs(self) -> None:
        """Keeps at most max_kept finished jobs, dropping the oldest."""
        finished = [job_id for job_id, job in self.jobs.items() if job.finished]
        for job_id in finished[: max(0, len(finished) - self.max_kept)]:
            job = self.jobs.pop(job_id)
            if job.request.request_id:
                self.by_request_id.pop(job.request.request_id, None)

    async def shutdown(self) -> None:
        for job in list(self.queue):
            await self.cancel(job, grpc.StatusCode.UNAVAILABLE, "the orchestrator is shutting down")
        for job_id in list(self.running):
            await self.cancel(self.jobs[job_id], grpc.StatusCode.UNAVAILABLE, "the orchestrator is shutting down")
