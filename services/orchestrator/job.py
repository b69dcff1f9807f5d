"""A job: one accepted request of one tenant, its state, and the log of its events that watchers follow.

Its events (queued, progress, completed) are appended to the job's log; any
number of watchers (Generate, WatchJob) replay the log from the start and then
follow it, so a client that reconnects sees the whole history, result included.
The log holds no frames: the pipeline writes them to the job's result file in
the store and logs a `ResultPiece` (first frame, count) per piece; a follower
reaching one reads the piece back from the file one wire chunk at a time, so
memory grows neither with the video nor with the number of readers. The sound of
a result with sound is written whole to its own file and logged as an `AudioPiece`,
read back the same way by the followers that receive raw frames. A job with
an encoded output_format logs an `EncodedPiece` for each part of its encoded
file the encoder wrote (followers read it back the same way), and sends its raw
frames only when the request keeps them. A finished job read back from the
store (`Job.from_record`, `stored_in` set) replays its stored result from disk.

`JobTable` holds the jobs in memory (every active one and the latest finished
ones) by id and by the tenant's request id.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict, cast

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import context as otel_context

from services.encoding import output_format
from services.orchestrator.admission import without_image_bytes
from services.orchestrator.kept_outputs import PendingWrite
from services.orchestrator.store import (
    AudioReader,
    AudioWriter,
    EncodedReader,
    EncodedWriter,
    JobRecord,
    JobStore,
    ResultGone,
    ResultReader,
    ResultWriter,
)
from stagediff.tensor_codec import DEFAULT_CHUNK_BYTES
from stagediff.v1 import generation_pb2, stages_pb2, tensor_pb2

if TYPE_CHECKING:  # encoded_results.py imports Job
    from services.orchestrator.encoded_results import EncodedResult

JobState = generation_pb2.JobState
TERMINAL_STATES = (JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED)


@dataclass(frozen=True)
class ResultPiece:
    """A log entry for frames [first, first + count) of the job's result, written to its result file.

    Followers turn it into the wire chunks `encode_tensor("frames", frames, index=first)` would make.
    """

    first: int
    count: int
    fps: float


@dataclass(frozen=True)
class AudioPiece:
    """A log entry for the result's sound, written whole to the job's sound file (`Job.audio`).

    Followers that receive the raw frames turn it into the chunks of tensor "audio" float32 [channels, samples].
    """

    sample_rate: int


@dataclass(frozen=True)
class EncodedPiece:
    """A log entry for bytes [offset, offset + size) of the job's encoded file; `last` marks the file's end."""

    offset: int
    size: int
    last: bool


class JobIntermediates(TypedDict, total=False):
    """What a run keeps in the job across its retries; cleared when the job finishes."""

    outputs: dict[str, list[tensor_pb2.TensorChunk]]  # the finished stages' outputs, by stage
    cancel_reason: tuple[grpc.StatusCode, str]  # the status a cancelled run ends with
    frames_published: int  # frames of the result already published (services/orchestrator/result_publisher.py)
    audio_published: bool  # the result's sound is written and published (a retried VAE's is dropped)
    lease_lost: bool  # another replica runs the job now: this run records nothing
    # The run stops to run again, elsewhere (the replica leaves and requeues the job itself) or after a restart
    # (the orchestrator shuts down): its outcome is not recorded, and its kept outputs are written at once.
    handing_back: bool
    saving: list[PendingWrite]  # kept stage outputs on their way to the store (kept_outputs.py)
    state_write: PendingWrite  # the newest denoising state's write


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
    # The changes made to the request that its caller did not ask for (services/orchestrator/notices.py).
    notices: list[stages_pb2.Notice] = field(default_factory=list)
    # Absolute event-loop time after which the job is cancelled with DEADLINE_EXCEEDED.
    deadline: float | None = None
    # Results of finished stages, kept so that a failed later stage can be retried from them.
    intermediates: JobIntermediates = field(default_factory=JobIntermediates)
    # The log: events, and a ResultPiece for each piece of frames written to `result`.
    events: list[generation_pb2.GenerateEvent | ResultPiece | EncodedPiece | AudioPiece] = field(default_factory=list)
    # The result file the pipeline writes while the job runs (and followers read from).
    result: ResultWriter | None = None
    # The encoded file (output_format other than raw), written alongside, and the encoder that writes it.
    encoded: EncodedWriter | None = None
    encoder: EncodedResult | None = None
    # The result's sound (a model that makes video with sound), written whole once the VAE sent it.
    audio: AudioWriter | None = None
    # The stages the job runs through, and the latest step each reported (for progress_percent).
    chain: tuple[str, ...] = ()
    steps: dict[str, tuple[int, int]] = field(default_factory=dict)
    # A finished job read back from the store: followers replay its stored result from there.
    stored_in: JobStore | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    task: asyncio.Task | None = None
    priority: str = "normal"
    # How many times the job's denoising yielded its DiT slot to a job of a higher class (denoise_call.py).
    preemptions: int = 0
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

    async def publish_audio(self, sample_rate: int) -> None:
        """Tells followers that the result's sound is in its sound file (`audio`)."""
        self.events.append(AudioPiece(sample_rate))
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
        self.intermediates = JobIntermediates()
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
                    if isinstance(item, AudioPiece):
                        if not skip_frames:
                            async for event in self._audio_events(item, chunk_bytes):
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

    async def _audio_events(self, piece: AudioPiece, chunk_bytes: int) -> AsyncIterator[generation_pb2.GenerateEvent]:
        """The chunks of the result's sound, read from its file; none when the job did not succeed and the
        file is gone."""
        try:
            if self.audio is None:
                raise ResultGone(f"job {self.job_id}: it has no sound file")
            reader: AudioReader = await asyncio.to_thread(self.audio.open_reader)
        except ResultGone:
            if self.state == JobState.JOB_STATE_SUCCEEDED:
                raise
            return
        try:
            chunks = reader.chunks(chunk_bytes=chunk_bytes)
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                yield generation_pb2.GenerateEvent(
                    job_id=self.job_id,
                    result=generation_pb2.ResultChunk(
                        tensor=chunk, fps=self.fps_out, audio_sample_rate=piece.sample_rate
                    ),
                )
        finally:
            reader.close()

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
        store = self.stored_in
        assert store is not None  # replayed only for a job read from the store
        result = await asyncio.to_thread(store.load_result, self.job_id)
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
            state=cast(JobState, self.state),
            request=request,
            created_at=_timestamp(self.created_at),
            queue_position=queue_position,
            current_stage=self.current_stage,
            timings=self.timings,
            num_frames_out=self.num_frames_out,
            fps_out=self.fps_out,
            transformer_passes=self.transformer_passes,
            progress_percent=self.progress_percent(),
            notices=self.notices,
            preemptions=self.preemptions,
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
            notices=list(record.notices),
            priority=record.priority,
            preemptions=record.preemptions,
        )
        if record.error_code is not None:
            job.error_code = _status_code(record.error_code)
        return job


def _status_code(value: int) -> grpc.StatusCode:
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)


class JobTable:
    """The jobs in memory: every active one and the latest finished ones; the rest is in the store."""

    def __init__(self) -> None:
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self.by_request_id: dict[tuple[str, str], str] = {}

    def remember(self, job: Job) -> None:
        self.jobs[job.job_id] = job
        if job.request.request_id:
            self.by_request_id[(job.tenant, job.request.request_id)] = job.job_id

    def forget(self, job_id: str) -> None:
        """Drops a finished job from memory (an active one stays)."""
        job = self.jobs.get(job_id)
        if job is None or not job.finished:
            return
        del self.jobs[job_id]
        if job.request.request_id:
            self.by_request_id.pop((job.tenant, job.request.request_id), None)

    def by_request(self, tenant: str, request_id: str) -> Job | None:
        """The tenant's job in memory with this request id, if any."""
        job_id = self.by_request_id.get((tenant, request_id))
        return self.jobs.get(job_id) if job_id is not None else None
