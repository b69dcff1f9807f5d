"""Jobs, their event logs, and the manager that admits, schedules, persists and recovers them.

Every accepted request becomes a `Job` owned by one tenant. Its events (queued,
progress, completed) are appended to the job's log; any number of watchers
(Generate, WatchJob) replay the log from the start and then follow it, so a
client that reconnects sees the whole history, result included. The log holds
no frames: the pipeline writes them to the job's result file in the store and
logs a `ResultPiece` (first frame, count) per piece; a follower reaching one
reads the piece back from the file one wire chunk (1 MiB) at a time, so memory
grows neither with the video nor with the number of readers. A job with an
encoded output_format logs an `EncodedPiece` for each part of its encoded file
the encoder wrote (followers read it back the same way), and sends its raw
frames only when the request keeps them. At most
`MAX_FINISHED_IN_MEMORY` finished jobs stay in memory; GetJob answers from the
store's record for the others, and a watcher of a stored result streams it
from disk the same way.

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

A store error never leaks a running slot or stalls the queue: a job whose start
cannot be recorded fails at once (its slot goes to the next job), a failed write
during a job fails that job (RESOURCE_EXHAUSTED when the volume is full), and
an outcome that cannot be recorded is logged (the store still holds the job as
unfinished, so the next start runs it again).

Retention belongs to tenants. Each tenant keeps at most `max_kept_jobs` finished
jobs and `max_stored_bytes` of files (its quotas in the tenants file, else the
orchestrator's defaults), and no finished job older than `retention_s`; pruning
runs tenant by tenant whenever a job finishes and at start-up, so one tenant's
jobs never push out another's. At admission the new job's result size is
reserved: the tenant's oldest finished jobs are deleted to make room, and the job
is refused (RESOURCE_EXHAUSTED naming max_stored_bytes) when its queued and
running jobs alone would not fit, or (PERMISSION_DENIED) when its result alone is
larger than the quota. New jobs are refused (RESOURCE_EXHAUSTED, retry later)
while the state volume has less than `min_free` space left.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import context as otel_context

from services.encoding import output_format
from services.logging_setup import log_context
from services.metrics import OrchestratorMetrics
from services.orchestrator.scheduler import AdmissionRefused, FairScheduler, TenantLimits
from services.orchestrator.store import (
    EncodedReader,
    EncodedWriter,
    InvalidTransition,
    JobRecord,
    JobStore,
    MinFree,
    ResultGone,
    ResultReader,
    ResultWriter,
    StoreError,
    StoreFull,
)
from services.orchestrator.tenants import LimitExceeded, Tenant, output_frames
from services.tracing import set_grpc_status, start_span_under
from stagediff.tensor_codec import DEFAULT_CHUNK_BYTES
from stagediff.v1 import generation_pb2, stages_pb2, tensor_pb2

if TYPE_CHECKING:  # encoded_results.py imports Job
    from services.orchestrator.encoded_results import EncodedResult

logger = logging.getLogger(__name__)

JobState = generation_pb2.JobState
TERMINAL_STATES = (JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED)

__all__ = [
    "AdmissionRefused",
    "Job",
    "JobManager",
    "JobState",
    "ResultPiece",
    "StorageRefused",
    "TERMINAL_STATES",
    "result_shape",
]

# Finished jobs kept in memory (their logs hold no frames); older ones are answered from the store.
MAX_FINISHED_IN_MEMORY = 64
# When a refused job may try again after the state volume was found too full.
DISK_FULL_RETRY_AFTER_S = 60.0


class StorageRefused(AdmissionRefused):
    """A job refused for space: the state volume is nearly full (scope "disk"), or its tenant's running and
    queued jobs already hold its max_stored_bytes (scope "storage"). RESOURCE_EXHAUSTED with a retry-after."""


def result_shape(request: generation_pb2.GenerateRequest) -> tuple[int, int, int, int]:
    """The final frames' shape [F, H, W, 3] of a completed request (F after interpolation)."""
    return (output_frames(request), request.height, request.width, 3)


def without_image_bytes(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    """`request` without its images' bytes (their roles, digests and sizes kept); itself when it holds none.

    The copy is built field by field, never by CopyFrom and ClearField: protobuf (upb) keeps the bytes a
    message copied in its own memory until the message is freed, cleared or not, so a job would keep every
    input image it ever took.
    """
    if not any(image.data for image in request.images):
        return request
    cleared = generation_pb2.GenerateRequest()
    for descriptor, value in request.ListFields():
        if descriptor.name == "images":
            continue
        if descriptor.is_repeated:
            getattr(cleared, descriptor.name).extend(value)
        elif descriptor.message_type is not None:
            getattr(cleared, descriptor.name).CopyFrom(value)
        else:
            setattr(cleared, descriptor.name, value)
    for image in request.images:
        kept = cleared.images.add()
        for descriptor, value in image.ListFields():
            if descriptor.name != "data":
                setattr(kept, descriptor.name, value)
    return cleared


def result_bytes(request: generation_pb2.GenerateRequest) -> int:
    """The bytes a job's result is reserved at admission: its raw frames, twice when an encoded result keeps them
    too (an encoded file is not larger than the frames it encodes, but for a few bytes of header)."""
    frames, height, width, channels = result_shape(request)
    raw = frames * height * width * channels
    return raw * 2 if request.keep_raw_frames else raw


def store_failure(error: StoreError, what: str) -> tuple[grpc.StatusCode, str]:
    """The status a job fails with when the store fails it: RESOURCE_EXHAUSTED when out of space."""
    if isinstance(error, StoreFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: the orchestrator's state volume is full ({error})"
    return grpc.StatusCode.INTERNAL, f"{what}: the orchestrator's job store failed ({error})"


@dataclass(frozen=True)
class ResultPiece:
    """A log entry for frames [first, first + count) of the job's result, written to its result file.

    Followers turn it into the wire chunks `encode_tensor("frames", frames, index=first)` would make.
    """

    first: int
    count: int
    fps: float


@dataclass(frozen=True)
class EncodedPiece:
    """A log entry for bytes [offset, offset + size) of the job's encoded file; `last` marks the file's end."""

    offset: int
    size: int
    last: bool


# Rough share of a job's time in each stage on the served models, to turn stage steps into one percentage.
# The DiT's steps dominate; the others are short. Only the stages of a job's chain count.
STAGE_WEIGHTS = {"text-encoder": 1.0, "dit": 16.0, "vae": 2.0, "interp": 1.0}


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
    # The passes the DiT ran and its step cache skipped, once it has finished.
    transformer_passes: stages_pb2.TransformerPasses = field(default_factory=stages_pb2.TransformerPasses)
    # Absolute event-loop time after which the job is cancelled with DEADLINE_EXCEEDED.
    deadline: float | None = None
    # Results of finished stages, kept so that a failed later stage can be retried from them.
    intermediates: dict[str, object] = field(default_factory=dict)
    # The log: events, and a ResultPiece for each piece of frames written to `result`.
    events: list[generation_pb2.GenerateEvent | ResultPiece] = field(default_factory=list)
    # The result file the pipeline writes while the job runs (and followers read from).
    result: ResultWriter | None = None
    # The encoded file (output_format other than raw), written alongside, and the encoder that writes it.
    encoded: EncodedWriter | None = None
    encoder: EncodedResult | None = None
    # The stages the job runs through, and the latest step each reported (for progress_percent).
    chain: tuple[str, ...] = ()
    steps: dict[str, tuple[int, int]] = field(default_factory=dict)
    # A finished job read back from the store: followers replay its stored result from there.
    stored_in: JobStore | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task | None = None
    priority: str = "normal"
    # The trace context of the request that submitted the job: its task runs under it, so the stage calls
    # join the client's trace.
    trace_context: otel_context.Context | None = None

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def sends_raw_frames(self) -> bool:
        """Whether followers receive the raw frames: a raw result, or an encoded one that keeps them."""
        return self.request.output_format in ("", "raw") or self.request.keep_raw_frames

    def progress_percent(self) -> float:
        """0 to 100: the finished share of the job's chain, each stage weighed by STAGE_WEIGHTS."""
        if self.state == JobState.JOB_STATE_SUCCEEDED:
            return 100.0
        total = sum(STAGE_WEIGHTS.get(stage, 1.0) for stage in self.chain)
        if not total:
            return 0.0
        done = sum(
            STAGE_WEIGHTS.get(stage, 1.0) * step / max(steps, 1)
            for stage, (step, steps) in self.steps.items()
            if stage in self.chain
        )
        return round(100.0 * min(done / total, 1.0), 1)

    async def publish(self, event: generation_pb2.GenerateEvent) -> None:
        event.job_id = self.job_id
        if event.HasField("progress"):
            self.steps[event.progress.stage] = (event.progress.step, event.progress.total)
        self.events.append(event)
        async with self.changed:
            self.changed.notify_all()

    async def publish_piece(self, first: int, count: int, fps: float) -> None:
        """Tells followers that frames [first, first + count) are in the result file."""
        self.events.append(ResultPiece(first, count, fps))
        async with self.changed:
            self.changed.notify_all()

    async def publish_encoded(self, offset: int, size: int, last: bool) -> None:
        """Tells followers that bytes [offset, offset + size) of the encoded file are written."""
        self.events.append(EncodedPiece(offset, size, last))
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

    async def follow(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> AsyncIterator[generation_pb2.GenerateEvent]:
        """Yields every event from the first, then new ones until the job finishes.

        Result pieces are read from the result file as they are reached, one
        chunk at a time (off the event loop). A job that failed after some
        frames were written yields no frames once its file is gone; a
        succeeded job whose result was deleted meanwhile raises ResultGone.
        """
        if self.stored_in is not None:
            async for event in self._replay_stored(chunk_bytes):
                yield event
            return
        sent = 0
        reader: ResultReader | None = None
        encoded: EncodedReader | None = None
        skip_frames = not self.sends_raw_frames
        skip_encoded = False
        try:
            while True:
                while sent < len(self.events):
                    item = self.events[sent]
                    sent += 1
                    if isinstance(item, EncodedPiece):
                        if skip_encoded:
                            continue
                        if encoded is None:
                            encoded = await self._open_encoded()
                            if encoded is None:
                                skip_encoded = True
                                continue
                        async for event in self._encoded_events(encoded, item, chunk_bytes):
                            yield event
                        continue
                    if not isinstance(item, ResultPiece):
                        yield item
                        continue
                    if skip_frames:
                        continue
                    if reader is None:
                        reader = await self._open_result()
                        if reader is None:
                            skip_frames = True
                            continue
                    async for event in self._piece_events(reader, item.first, item.count, item.fps, chunk_bytes):
                        yield event
                if self.finished:
                    return
                async with self.changed:
                    if sent == len(self.events) and not self.finished:
                        await self.changed.wait()
        finally:
            for open_reader in (reader, encoded):
                if open_reader is not None:
                    open_reader.close()

    async def _open_result(self) -> ResultReader | None:
        """A reader of the result file; None when the job did not succeed and its partial result is gone."""
        try:
            if self.result is None:
                raise ResultGone(f"job {self.job_id}: it has no result file")
            return await asyncio.to_thread(self.result.open_reader)
        except ResultGone:
            if self.state == JobState.JOB_STATE_SUCCEEDED:
                raise
            return None

    async def _open_encoded(self) -> EncodedReader | None:
        """A reader of the encoded file; None when the job did not succeed and its partial file is gone."""
        try:
            if self.encoded is None:
                raise ResultGone(f"job {self.job_id}: it has no encoded file")
            return await asyncio.to_thread(self.encoded.open_reader)
        except ResultGone:
            if self.state == JobState.JOB_STATE_SUCCEEDED:
                raise
            return None

    async def _encoded_events(
        self, reader: EncodedReader, piece: EncodedPiece, chunk_bytes: int
    ) -> AsyncIterator[generation_pb2.GenerateEvent]:
        chunks = reader.chunks(piece.offset, piece.size, last=piece.last, chunk_bytes=chunk_bytes)
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield generation_pb2.GenerateEvent(
                job_id=self.job_id, result=generation_pb2.ResultChunk(encoded=chunk, fps=self.fps_out)
            )

    async def _piece_events(
        self, reader: ResultReader, first: int, count: int, fps: float, chunk_bytes: int
    ) -> AsyncIterator[generation_pb2.GenerateEvent]:
        chunks = reader.chunks(first, count, chunk_bytes=chunk_bytes)
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield generation_pb2.GenerateEvent(
                job_id=self.job_id, result=generation_pb2.ResultChunk(tensor=chunk, fps=fps)
            )

    async def _replay_stored(self, chunk_bytes: int) -> AsyncIterator[generation_pb2.GenerateEvent]:
        """A stored succeeded job's result chunks, read from its file, then its completion event."""
        result = await asyncio.to_thread(self.stored_in.load_result, self.job_id)
        if result is None:
            return
        events = result.events(self.job_id, seed=self.request.seed, chunk_bytes=chunk_bytes)
        try:
            while (event := await asyncio.to_thread(next, events, None)) is not None:
                yield event
        finally:
            events.close()

    def to_proto(self, queue_position: int = 0) -> generation_pb2.Job:
        # A client sees which images the job took (sha256, size), never their bytes.
        request = without_image_bytes(self.request)
        job = generation_pb2.Job(
            job_id=self.job_id,
            state=self.state,
            request=request,
            created_at=_timestamp(self.created_at),
            queue_position=queue_position,
            current_stage=self.current_stage,
            timings=self.timings,
            num_frames_out=self.num_frames_out,
            fps_out=self.fps_out,
            transformer_passes=self.transformer_passes,
            progress_percent=self.progress_percent(),
        )
        if self.state == JobState.JOB_STATE_SUCCEEDED:
            job.media_type = output_format(self.request.output_format).media_type
        if self.state == JobState.JOB_STATE_RUNNING and self.current_stage in self.steps:
            step, total = self.steps[self.current_stage]
            job.progress.CopyFrom(generation_pb2.StageProgress(stage=self.current_stage, step=step, total=total))
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
            transformer_passes=stages_pb2.TransformerPasses(run=record.passes_run, skipped=record.passes_skipped),
            priority=record.priority,
        )
        if record.error_code is not None:
            job.error_code = _status_code(record.error_code)
        return job


def _status_code(value: int) -> grpc.StatusCode:
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)


RunJob = Callable[[Job], Awaitable[None]]
# Puts a recovered job's stored stage outputs (stage -> the chunks it sent) back where the pipeline resumes from them.
RestoreJob = Callable[[Job, dict[str, list[tensor_pb2.TensorChunk]]], None]


class JobManager:
    """Admits jobs for tenants, runs them in the scheduler's order, and keeps every one in the store.

    Retention (per tenant; see the module docstring): `max_kept` finished jobs
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
        tenants: dict[str, Tenant] | None = None,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
        self.run_job = run_job
        self.restore_job = restore_job
        self.scheduler = scheduler
        self.store = store
        self.max_kept = max_kept
        self.max_stored_bytes = max_stored_bytes
        self.retention_s = retention_s
        self.min_free = min_free or MinFree()
        self.max_attempts = max_attempts
        # Tenants by name, for the weight, limits and retention of jobs recovered after a restart.
        self.tenants = dict(tenants or {})
        self.metrics = metrics
        # Active jobs, and the latest finished ones; the rest is in the store.
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.by_request_id: dict[tuple[str, str], str] = {}
        self.shutting_down = False

    # ------------------------------------------------------------------ admission --

    async def submit(
        self, request: generation_pb2.GenerateRequest, tenant: Tenant, deadline: float | None = None
    ) -> tuple[Job, bool]:
        """Queues a job for `tenant`; returns (job, created). A known request_id returns its job instead.

        `deadline` is event-loop time. Raises AdmissionRefused (with a retry-after) when the queue or the
        tenant's share of it is full, StorageRefused when there is no room to store the result, and
        LimitExceeded when the result alone is larger than the tenant's max_stored_bytes.
        """
        existing = await self.find_request(tenant.name, request.request_id)
        if existing is not None:
            return existing, False
        # The tenant as it is now (its quotas) is what pruning and recovery use for its jobs.
        self.tenants[tenant.name] = tenant
        self._check_free_space(tenant.name)
        self.check_stored_bytes(tenant, result_bytes(request) + sum(len(image.data) for image in request.images))
        job_id = uuid.uuid4().hex
        # The images' bytes go to a file beside the job (counted in its tenant's bytes), never into its row or
        # its Job: a queued or finished job holds their digests and sizes only. The file is written before the
        # job enters the queue, so that nothing awaits between the queue taking the job and the job being known.
        try:
            saved = await asyncio.to_thread(self.store.save_input_images, job_id, request.images)
        except StoreFull as error:
            raise self._disk_full(tenant.name, error) from None
        request = without_image_bytes(request)
        admitted = self.by_request_id.get((tenant.name, request.request_id))
        if admitted is not None and admitted in self.jobs:  # the same request, admitted meanwhile
            if saved is not None:
                self.store.discard_saved_images(job_id, saved)
            return self.jobs[admitted], False
        quotas = tenant.quotas
        try:
            self.scheduler.admit(
                job_id,
                tenant.name,
                tenant.priority,
                tenant.weight,
                TenantLimits(max_queued=quotas.max_queued_jobs, max_running=quotas.max_running_jobs),
            )
        except BaseException:
            if saved is not None:
                self.store.discard_saved_images(job_id, saved)
            raise
        deadline_at = None if deadline is None else time.time() + (deadline - asyncio.get_running_loop().time())
        try:
            record = self.store.insert(
                JobRecord.new(job_id, tenant.name, request, priority=tenant.priority.value, deadline_at=deadline_at),
                saved,
            )
        except StoreFull as error:
            self.scheduler.remove(job_id)
            raise self._disk_full(tenant.name, error) from None
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
        await self._dispatch()
        # Room for the new job's result: the tenant's oldest finished jobs beyond its limits go now.
        await self._prune_tenant(tenant.name)
        return job, True

    @staticmethod
    def _disk_full(tenant: str, error: StoreFull) -> StorageRefused:
        return StorageRefused(
            f"the orchestrator's state volume is full ({error}); retry later",
            retry_after_s=DISK_FULL_RETRY_AFTER_S,
            scope="disk",
            tenant=tenant,
        )

    def _check_free_space(self, tenant: str) -> None:
        """Refuses new jobs while the state volume has less than `min_free` left."""
        free, total = self.store.free_bytes()
        keep = self.min_free.of(total)
        if free < keep:
            raise StorageRefused(
                f"the orchestrator's state volume has {free} bytes free, less than the {self.min_free} it keeps free "
                "(--min-free-bytes); retry later",
                retry_after_s=DISK_FULL_RETRY_AFTER_S,
                scope="disk",
                tenant=tenant,
            )

    def check_stored_bytes(self, tenant: Tenant, needed: int) -> None:
        """Refuses a job that needs `needed` bytes (its result and input images) when they cannot fit the
        tenant's max_stored_bytes even after its finished jobs go. Admission checks a request's image bytes
        alone before it parses them; `submit` checks them with the result."""
        limit = self._retention(tenant.name)[1]
        if limit is None:
            return
        if needed > limit:
            raise LimitExceeded(
                tenant.name,
                "max_stored_bytes",
                needed,
                limit,
                f"output: the result and the input images take {needed} bytes, more than tenant "
                f"'{tenant.name}' may store (max_stored_bytes {limit})",
            )
        held = self.store.usage(tenant.name).active + self._reserved_bytes(tenant.name)
        if held + needed > limit:
            raise StorageRefused(
                f"tenant '{tenant.name}' has {held} bytes in queued and running jobs; with this job's {needed} that "
                f"exceeds its max_stored_bytes of {limit}; retry when some have finished",
                retry_after_s=self.scheduler.retry_after(tenant.name),
                scope="storage",
                tenant=tenant.name,
            )

    def _retention(self, name: str) -> tuple[int, int | None]:
        """(max kept finished jobs, max stored bytes) of a tenant: its quotas, else the orchestrator's defaults.

        A tenant no longer in the tenants file (its jobs are still stored) gets the defaults.
        """
        tenant = self.tenants.get(name)
        kept = tenant.quotas.max_kept_jobs if tenant is not None else None
        stored = tenant.quotas.max_stored_bytes if tenant is not None else None
        return (self.max_kept if kept is None else kept, self.max_stored_bytes if stored is None else stored)

    def _reserved_bytes(self, tenant: str) -> int:
        """What the tenant's queued and running jobs will write as results (not yet in the store's sizes)."""
        return sum(result_bytes(job.request) for job in self.jobs.values() if job.tenant == tenant and not job.finished)

    async def find_request(self, tenant: str, request_id: str) -> Job | None:
        """The tenant's job with this request id: live, or read back from the store (its result replayable)."""
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
        """The job if it exists and belongs to `tenant` (None: any tenant).

        A finished job no longer in memory is built from its record alone; its result
        file is opened only when someone follows it (`Job.follow` replays it from disk).
        """
        job = self.jobs.get(job_id)
        if job is None:
            record = self.store.get(job_id)
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

    async def delete(self, job: Job) -> bool:
        """Cancels the job if it is queued or running, then deletes its record and files from the store and
        forgets it; False when the store no longer had it (deleted meanwhile, or pruned)."""
        await self.cancel(job, message="deleted by the client")
        try:
            deleted = await asyncio.to_thread(self.store.delete, job.job_id)
        except InvalidTransition:  # still finishing its cancellation: it is terminal once its task returned
            await asyncio.gather(*(task for task in (job.task,) if task is not None), return_exceptions=True)
            deleted = await asyncio.to_thread(self.store.delete, job.job_id)
        self._forget(job.job_id)
        return deleted

    async def _dispatch(self) -> None:
        """Starts every job the scheduler lets start. A job whose start cannot be recorded fails at once and
        gives its running slot back, so the next one still starts."""
        while (job_id := self.scheduler.next_runnable()) is not None:
            job = self.jobs[job_id]
            try:
                self.store.update_state(job_id, JobState.JOB_STATE_RUNNING)
            except StoreError as error:
                self.scheduler.finished(job_id)
                code, message = store_failure(error, "the job could not be started")
                logger.error("job %s: %s", job_id, message)
                self._store_outcome(job_id, JobState.JOB_STATE_FAILED, code, message, job)
                await job.finish(JobState.JOB_STATE_FAILED, code, message)
                self._count_finished(job)
                continue
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
                await self._dispatch()
                await self._announce_positions()
                await self._prune_tenant(job.tenant)
            self._update_gauges()

    def _store_outcome(
        self, job_id: str, state: int, code: grpc.StatusCode | None, message: str, job: Job | None = None
    ) -> None:
        """Records a failure or cancellation (success is stored by the pipeline with its result).

        Best effort: if the store cannot record it, the job stays unfinished there and runs again at the
        next start; the clients already hear the outcome from the job itself.
        """
        try:
            self.store.update_state(
                job_id,
                state,
                error_code=None if code is None else code.value[0],
                error_message=message,
                timings=job.timings if job is not None else None,
                num_frames_out=job.num_frames_out if job is not None else None,
                fps_out=job.fps_out if job is not None else None,
            )
        except InvalidTransition:
            pass  # already finished in the store (the result was stored just before a late cancel)
        except StoreError as error:
            logger.error("job %s: could not record that it ended %s: %s", job_id, JobState.Name(state), error)

    async def _announce_positions(self) -> None:
        for job_id, position in self.scheduler.positions().items():
            job = self.jobs[job_id]
            last = next(
                (e for e in reversed(job.events) if not isinstance(e, ResultPiece) and e.HasField("queued")), None
            )
            if last is None or last.queued.position != position:
                await job.publish(generation_pb2.GenerateEvent(queued=generation_pb2.JobQueued(position=position)))

    async def _prune_tenant(self, tenant: str) -> None:
        """Keeps the tenant within its kept-jobs and stored-bytes limits, every tenant within the age limit,
        and in memory only the latest finished jobs. A store error is logged: pruning waits for the next job."""
        max_kept, max_bytes = self._retention(tenant)
        try:
            removed = await asyncio.to_thread(
                self.store.prune,
                tenant=tenant,
                max_kept=max_kept,
                max_bytes=max_bytes,
                reserved_bytes=self._reserved_bytes(tenant),
            )
            if self.retention_s is not None:
                removed += await asyncio.to_thread(self.store.prune, max_age_s=self.retention_s)
        except StoreError as error:
            logger.error("pruning finished jobs failed: %s", error)
            removed = []
        for job_id in removed:
            self._forget(job_id)
        finished = [job_id for job_id, job in self.jobs.items() if job.finished]
        for job_id in finished[: max(0, len(finished) - MAX_FINISHED_IN_MEMORY)]:
            self._forget(job_id)

    def _forget(self, job_id: str) -> None:
        job = self.jobs.get(job_id)
        if job is None or not job.finished:
            return
        del self.jobs[job_id]
        if job.request.request_id:
            self.by_request_id.pop((job.tenant, job.request.request_id), None)

    # ------------------------------------------------------------------ lifecycle --

    async def recover(self) -> int:
        """Queues again every job the store holds as queued or running (from its last finished stage).

        Runs once, before the servicer accepts requests. A job past its deadline fails with
        DEADLINE_EXCEEDED; one that has been started `max_attempts` times (and so may be what brings the
        orchestrator down) fails with INTERNAL. Then every tenant's stored jobs are pruned to its limits.
        Returns how many jobs were queued again.
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
        for tenant_name in self.store.tenants():
            await self._prune_tenant(tenant_name)
        await self._dispatch()
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
