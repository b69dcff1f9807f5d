"""Durable job records and results under the orchestrator's state directory.

Layout of `state_dir`:

    jobs.sqlite3 (+ -wal, -shm)   job records, which intermediates and results exist, and their sizes
    LOCK                          held (flock) by the one process that owns the directory
    jobs/<job_id>/stage-<stage>.chunks        what a finished stage of an unfinished job sent
    jobs/<job_id>/stage-input-images.<hex>.chunks   the input images of a job whose conditioning is not done
    jobs/<job_id>/.result-frames.npy.<hex>.partial   the result of a running job, written as it streams
    jobs/<job_id>/result-frames.npy           the final frames, uint8 [F, H, W, 3]
    jobs/<job_id>/.result.<ext>.<hex>.partial the encoded result of a running job (output_format), as encoded
    jobs/<job_id>/result.<ext>                the encoded result (result.mp4, result.png...)

Durability. SQLite runs in WAL mode with `synchronous=NORMAL` by default: a
committed transaction is in the WAL file when `commit` returns, so it survives
a crash or SIGKILL of the process; only a power loss or kernel crash can lose
the last transactions (never corrupt the database). `synchronous="FULL"` also
survives those, at one fsync per commit. Files are complete (written, fsynced,
renamed into place, directory fsynced) before the row that names them is
committed, so a row always points at a complete file, and a file without a row
(a crash between the two, or a result still being written) is never read as a
result and is swept away by the next `open`.

Results stream to disk. The final frames' shape is known when a job starts
(`create_result`), so the result file is preallocated under a temporary name
(a .npy header, then F * H * W * 3 bytes) and each piece of frames is written
at its frame offset as it arrives (`ResultWriter.write`). Readers of a running
job read the pieces back from that same file (`ResultWriter.open_reader`), so
no frame stays in memory after it is written. `commit_result` fsyncs the file,
renames it to result-frames.npy and commits the row that marks the job
SUCCEEDED, with the pieces as first published (so a replay looks like the live
stream). A stored result is read back chunk by chunk (`StoredResult.events`),
never whole. The file format and its reader and writer are in result_files.py;
the errors, and how OS and SQLite failures map to them, in store_errors.py.

Stage outputs are kept as they came off the wire. A finished stage's output
(the text encoder's conditioning tensors, the DiT's latent frames) is the list
of `TensorChunk` messages the stage sent, stored length-prefixed, in order, and
read back as the same messages: the orchestrator relays bytes and never holds a
tensor (nor imports torch).

Input images are files too. A job's request row holds its images' digests and sizes, never their bytes:
`insert` writes the images (InputImage messages, length-prefixed) to the job's folder as the intermediate
of the pseudo-stage INPUT_IMAGES, so they count in the tenant's bytes like any intermediate, the stages
that encode them read them back (`load_input_images`), and they are deleted once those stages are done
(`drop_input_images`) or the job ends.

Space. Every file's size is recorded with its row: `usage` says how many bytes
a tenant's jobs hold, and `prune` keeps each tenant within its own limits on
kept finished jobs, stored bytes and age; one tenant's jobs are never deleted
for another's. Out of space (ENOSPC, EDQUOT, SQLite's SQLITE_FULL) raises
`StoreFull`; any other I/O or database failure raises `StoreError`, with a
one-line message.

Threads. One connection, guarded by a lock, so every method may be called from
any thread. Record methods (insert, get, update_state, find_by_request_id,
recoverable, list_jobs, usage) take well under a millisecond and are meant to
be called directly on the event loop thread. Methods that read or write tensor
files (mark_stage_done, load_intermediates, create_result, ResultWriter.write,
commit_result, save_result, load_result, delete, prune) can take much longer
(fsync, large arrays): call them through `asyncio.to_thread`. They hold the
lock only for their short transaction, never while writing a file. Each job has
one writer at a time (its own task). One process owns a state directory at a
time (`StateDirLocked` otherwise); the kernel drops the lock when the process
dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np
from google.protobuf import proto
from google.protobuf.message import DecodeError

from services.orchestrator.result_files import (
    ENCODED_FILE,
    RESULT_FILE,
    RESULT_TENSOR,
    EncodedReader,
    EncodedWriter,
    ResultReader,
    ResultWriter,
    StoredResult,
    check_shape,
    npy_header,
    read_npy_header,
)
from services.orchestrator.sizes import MinFree, parse_size
from services.orchestrator.store_errors import (
    DuplicateRequestId,
    InvalidTransition,
    ResultGone,
    StateDirLocked,
    StoreError,
    StoreFull,
    UnknownJob,
    db_error,
    fsync_dir,
    io_error,
)
from stagediff.v1 import generation_pb2, image_pb2, tensor_pb2

# The store's public names, with the errors (store_errors.py) and result files (result_files.py) it uses,
# so that callers import them from one place.
__all__ = [
    "ACTIVE_STATES",
    "RESULT_FILE",
    "RESULT_TENSOR",
    "TERMINAL_STATES",
    "DuplicateRequestId",
    "InvalidTransition",
    "JobRecord",
    "JobState",
    "JobStore",
    "MinFree",
    "ResultGone",
    "ResultReader",
    "EncodedReader",
    "EncodedWriter",
    "ResultWriter",
    "StateDirLocked",
    "StoreError",
    "StoreFull",
    "StoredResult",
    "UnknownJob",
    "Usage",
    "parse_size",
]

JobState = generation_pb2.JobState
TERMINAL_STATES = (JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED)
ACTIVE_STATES = (JobState.JOB_STATE_QUEUED, JobState.JOB_STATE_RUNNING)

SCHEMA_VERSION = 5
DB_NAME = "jobs.sqlite3"
LOCK_NAME = "LOCK"
JOBS_DIR = "jobs"
_TMP_SUFFIX = ".tmp"
_PARTIAL_SUFFIX = ".partial"
_CHUNKS_SUFFIX = ".chunks"
# The intermediates row of a job's input images (see the module's doc); never a stage's name.
INPUT_IMAGES = "input-images"
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")

_SCHEMA = """
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- admission order
    job_id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    request_id TEXT,                        -- NULL when the client gave none
    priority TEXT NOT NULL,
    request BLOB NOT NULL,                  -- GenerateRequest, serialized
    state INTEGER NOT NULL,                 -- JobState value
    created_at REAL NOT NULL,               -- unix seconds, as are all times
    started_at REAL,
    finished_at REAL,
    deadline_at REAL,
    error_code INTEGER,                     -- google.rpc.Code value
    error_message TEXT NOT NULL DEFAULT '',
    timings TEXT NOT NULL DEFAULT '{}',     -- JSON {stage: seconds}
    num_frames_out INTEGER NOT NULL DEFAULT 0,
    fps_out REAL NOT NULL DEFAULT 0,
    last_stage TEXT NOT NULL DEFAULT '',    -- last stage whose output is saved
    attempts INTEGER NOT NULL DEFAULT 0,    -- times the job was started
    passes_run INTEGER NOT NULL DEFAULT 0,  -- transformer passes the DiT ran in full
    passes_skipped INTEGER NOT NULL DEFAULT 0,  -- and those its step cache skipped
    UNIQUE (tenant, request_id)
);
CREATE INDEX jobs_by_state ON jobs (state, seq);
CREATE INDEX jobs_by_tenant ON jobs (tenant, state, finished_at);
CREATE TABLE intermediates (
    job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    stage TEXT NOT NULL,
    file TEXT NOT NULL,
    done_at REAL NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,       -- the file's size
    PRIMARY KEY (job_id, stage)
);
CREATE TABLE results (
    job_id TEXT PRIMARY KEY REFERENCES jobs (job_id) ON DELETE CASCADE,
    file TEXT NOT NULL,
    shape TEXT NOT NULL,                    -- JSON [F, H, W, 3]
    fps REAL NOT NULL,
    pieces TEXT NOT NULL,                   -- JSON [[first frame, count], ...] as first published
    saved_at REAL NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,       -- the files' sizes together
    media_type TEXT NOT NULL DEFAULT '',    -- of the encoded file, '' for a raw result
    encoded_file TEXT,                      -- the encoded file (output_format), NULL for a raw result
    encoded_bytes INTEGER NOT NULL DEFAULT 0,
    raw_kept INTEGER NOT NULL DEFAULT 1     -- 0: an encoded result whose raw frames were not kept
);
"""

# Version 1 lacked the sizes and the per-tenant index; `_migrate` adds them and measures the files.
_MIGRATE_1_TO_2 = """
ALTER TABLE intermediates ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE results ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
CREATE INDEX jobs_by_tenant ON jobs (tenant, state, finished_at);
"""

# Version 2 kept stage outputs as safetensors files of the tensors the orchestrator decoded; version 3 keeps
# the chunks the stages sent. A job that was running resumes from its first stage (stages are deterministic),
# and `_sweep` removes the old files, which no row names any more.
_MIGRATE_2_TO_3 = """
DELETE FROM intermediates;
UPDATE jobs SET last_stage = '';
"""

# Version 4 counts the transformer passes the DiT ran and skipped (its step cache); older jobs count none.
_MIGRATE_3_TO_4 = """
ALTER TABLE jobs ADD COLUMN passes_run INTEGER NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN passes_skipped INTEGER NOT NULL DEFAULT 0;
"""

# Version 5 stores encoded results (output_format) beside or instead of the raw frames; older results are raw.
_MIGRATE_4_TO_5 = """
ALTER TABLE results ADD COLUMN media_type TEXT NOT NULL DEFAULT '';
ALTER TABLE results ADD COLUMN encoded_file TEXT;
ALTER TABLE results ADD COLUMN encoded_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE results ADD COLUMN raw_kept INTEGER NOT NULL DEFAULT 1;
"""


@dataclass
class JobRecord:
    """One job as stored. `seq` (admission order) is assigned by `insert`."""

    job_id: str
    tenant: str
    request: bytes  # a serialized GenerateRequest with every default filled in
    request_id: str = ""
    priority: str = "normal"
    state: int = JobState.JOB_STATE_QUEUED
    created_at: float = 0.0  # 0: the store's clock at insert
    started_at: float | None = None
    finished_at: float | None = None
    deadline_at: float | None = None  # unix seconds; jobs past it are failed on recovery
    error_code: int | None = None
    error_message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    num_frames_out: int = 0
    fps_out: float = 0.0
    last_stage: str = ""
    attempts: int = 0
    passes_run: int = 0
    passes_skipped: int = 0
    seq: int = 0

    @classmethod
    def new(
        cls,
        job_id: str,
        tenant: str,
        request: generation_pb2.GenerateRequest,
        *,
        priority: str = "normal",
        deadline_at: float | None = None,
    ) -> JobRecord:
        return cls(
            job_id=job_id,
            tenant=tenant,
            request=request.SerializeToString(deterministic=True),
            request_id=request.request_id,
            priority=priority,
            deadline_at=deadline_at,
        )

    def parse_request(self) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest.FromString(self.request)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


@dataclass(frozen=True)
class SavedImages:
    """The file `save_input_images` wrote in a job's folder, and its size."""

    file: str
    size: int


@dataclass(frozen=True)
class Usage:
    """Bytes a tenant's jobs hold in the state directory."""

    finished: int  # results of its finished jobs: what `prune` may delete
    active: int  # intermediates (and committed results) of its queued and running jobs

    @property
    def total(self) -> int:
        return self.finished + self.active


def _check_frames(frames: np.ndarray) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"frames: uint8 [F, H, W, 3] expected, got {frames.dtype} {list(frames.shape)}")


def _check_pieces(pieces: list[tuple[int, int]], num_frames: int) -> None:
    covered = sorted(pieces)
    expected = 0
    for first, count in covered:
        if first != expected or count < 1:
            raise ValueError(f"pieces {covered} must cover frames 0..{num_frames - 1} without gaps or overlaps")
        expected = first + count
    if expected != num_frames:
        raise ValueError(f"pieces {covered} must cover frames 0..{num_frames - 1} without gaps or overlaps")


def _check_name(kind: str, value: str) -> None:
    if not _NAME.match(value):
        raise ValueError(f"{kind}: '{value}' must be 1-128 of A-Z a-z 0-9 _ - . and not start with '.'")


def _atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Writes a file so that it is either absent or complete, also after a crash."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class JobStore:
    """Job records in SQLite and tensor files beside them; see the module docstring for guarantees."""

    def __init__(self, state_dir: Path, connection: sqlite3.Connection, lock_file, clock: Callable[[], float]) -> None:
        self.state_dir = state_dir
        self.jobs_dir = state_dir / JOBS_DIR
        self.clock = clock
        self._db = connection
        self._lock_file = lock_file
        self._mutex = threading.RLock()

    @classmethod
    def open(
        cls, state_dir: str | os.PathLike, *, synchronous: str = "NORMAL", clock: Callable[[], float] = time.time
    ) -> JobStore:
        """Opens (creating if needed) the store, takes ownership of the directory and sweeps crash leftovers.

        A directory that cannot be used (not writable, a file in the way, a
        read-only volume) raises StoreError with a one-line message.
        """
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous: '{synchronous}' is not one of NORMAL, FULL")
        state_dir = Path(state_dir)
        try:
            (state_dir / JOBS_DIR).mkdir(parents=True, exist_ok=True)
            lock_file = open(state_dir / LOCK_NAME, "a+b")  # noqa: SIM115 - held for the store's lifetime
        except OSError as error:
            raise io_error(error, "cannot be used as the state dir", with_path=True) from None
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise StateDirLocked(f"state dir {state_dir} is in use by another process") from None
        connection = None
        try:
            if not os.access(state_dir / JOBS_DIR, os.W_OK | os.X_OK):
                raise StoreError(f"cannot be used as the state dir: {state_dir / JOBS_DIR} is not writable")
            connection = sqlite3.connect(state_dir / DB_NAME, isolation_level=None, check_same_thread=False)
            connection.row_factory = sqlite3.Row
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={synchronous}")
            connection.execute("PRAGMA foreign_keys=ON")
            store = cls(state_dir, connection, lock_file, clock)
            store._migrate()
            store._sweep()
        except sqlite3.Error as error:
            _close_quietly(connection, lock_file)
            raise StoreError(f"cannot be used as the state dir: {state_dir / DB_NAME}: {error}") from None
        except OSError as error:
            _close_quietly(connection, lock_file)
            raise io_error(error, "cannot be used as the state dir", with_path=True) from None
        except BaseException:
            _close_quietly(connection, lock_file)
            raise
        return store

    def close(self) -> None:
        with self._mutex:
            if self._db is None:
                return
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
            self._db = None
            self._lock_file.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def free_bytes(self) -> tuple[int, int]:
        """(free, total) bytes of the state directory's volume."""
        usage = shutil.disk_usage(self.state_dir)
        return usage.free, usage.total

    # ------------------------------------------------------------ records --

    def insert(self, record: JobRecord, images: SavedImages | None = None) -> JobRecord:
        """Stores a new job, with the input images `save_input_images` wrote for it; returns the job with `seq`
        (and `created_at` if unset) filled in. The images' file is deleted if the job cannot be stored."""
        _check_name("job_id", record.job_id)
        record = replace(record, created_at=record.created_at or self.clock())
        try:
            return self._insert(record, images)
        except BaseException:
            if images is not None:
                self.discard_saved_images(record.job_id, images)
            raise

    def save_input_images(self, job_id: str, images: Iterable[image_pb2.InputImage]) -> SavedImages | None:
        """Writes a new job's input images (with their bytes) to its folder, before `insert` stores the job;
        None without images. Blocking: use to_thread."""
        _check_name("job_id", job_id)
        buffer = io.BytesIO()
        for image in images:
            proto.serialize_length_prefixed(image, buffer)
        if not buffer.tell():
            return None
        data = buffer.getbuffer()
        file = f"stage-{INPUT_IMAGES}.{uuid.uuid4().hex}{_CHUNKS_SUFFIX}"  # never another job's, by any id
        try:
            _atomic_write(self._job_dir(job_id, create=True) / file, lambda out: out.write(data))
        except OSError as error:
            raise io_error(error, f"job {job_id}: saving its input images") from None
        return SavedImages(file, len(data))

    def discard_saved_images(self, job_id: str, images: SavedImages) -> None:
        """Deletes images saved for a job that was never stored (refused after they were written)."""
        (self.jobs_dir / job_id / images.file).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (self.jobs_dir / job_id).rmdir()  # only when nothing else is there

    def load_input_images(self, job_id: str) -> list[image_pb2.InputImage]:
        """The job's input images with their bytes, as `insert` stored them; blocking. StoreError once dropped."""
        row = self._fetchone("SELECT file FROM intermediates WHERE job_id = ? AND stage = ?", (job_id, INPUT_IMAGES))
        if row is None:
            raise StoreError(f"job {job_id}: its input images are no longer stored")
        images: list[image_pb2.InputImage] = []
        try:
            with open(self.jobs_dir / job_id / row["file"], "rb") as file:
                while (image := proto.parse_length_prefixed(image_pb2.InputImage, file)) is not None:
                    images.append(image)
        except (OSError, ValueError, DecodeError) as error:
            raise StoreError(f"job {job_id}: its input images cannot be read: {error}") from None
        return images

    def drop_input_images(self, job_id: str) -> None:
        """Deletes the job's input images once the stages that encode them are done; blocking."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT file FROM intermediates WHERE job_id = ? AND stage = ?", (job_id, INPUT_IMAGES)
            ).fetchone()
            db.execute("DELETE FROM intermediates WHERE job_id = ? AND stage = ?", (job_id, INPUT_IMAGES))
        if row is not None:
            (self.jobs_dir / job_id / row["file"]).unlink(missing_ok=True)

    def _insert(self, record: JobRecord, images: SavedImages | None) -> JobRecord:
        with self._transaction() as db:
            if record.request_id:
                existing = db.execute(
                    "SELECT job_id FROM jobs WHERE tenant = ? AND request_id = ?", (record.tenant, record.request_id)
                ).fetchone()
                if existing is not None:
                    raise DuplicateRequestId(
                        f"tenant '{record.tenant}' already has request_id '{record.request_id}'", existing["job_id"]
                    )
            try:
                cursor = db.execute(
                    "INSERT INTO jobs (job_id, tenant, request_id, priority, request, state, created_at, started_at,"
                    " finished_at, deadline_at, error_code, error_message, timings, num_frames_out, fps_out,"
                    " last_stage, attempts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        record.job_id,
                        record.tenant,
                        record.request_id or None,
                        record.priority,
                        record.request,
                        int(record.state),
                        record.created_at,
                        record.started_at,
                        record.finished_at,
                        record.deadline_at,
                        record.error_code,
                        record.error_message,
                        json.dumps(record.timings),
                        record.num_frames_out,
                        record.fps_out,
                        record.last_stage,
                        record.attempts,
                    ),
                )
            except sqlite3.IntegrityError:
                raise StoreError(f"job_id '{record.job_id}' is already stored") from None
            if images is not None:
                db.execute(
                    "INSERT INTO intermediates (job_id, stage, file, done_at, bytes) VALUES (?, ?, ?, ?, ?)",
                    (record.job_id, INPUT_IMAGES, images.file, record.created_at, images.size),
                )
            return replace(record, seq=cursor.lastrowid)

    def get(self, job_id: str) -> JobRecord | None:
        row = self._fetchone("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
        return _record(row) if row is not None else None

    def find_by_request_id(self, tenant: str, request_id: str) -> JobRecord | None:
        """The tenant's job with this client-chosen id (idempotent resubmission), if any."""
        if not request_id:
            return None
        row = self._fetchone("SELECT * FROM jobs WHERE tenant = ? AND request_id = ?", (tenant, request_id))
        return _record(row) if row is not None else None

    def update_state(
        self,
        job_id: str,
        state: int,
        *,
        at: float | None = None,
        error_code: int | None = None,
        error_message: str = "",
        timings: Mapping[str, float] | None = None,
        num_frames_out: int | None = None,
        fps_out: float | None = None,
    ) -> JobRecord:
        """Moves a job to RUNNING, back to QUEUED (recovery), or to FAILED / CANCELLED.

        RUNNING sets started_at and counts an attempt. FAILED and CANCELLED set
        finished_at, the error and timings, and delete the job's intermediates.
        SUCCEEDED goes through `commit_result`, so that a succeeded job always
        has its result. A finished job cannot change: InvalidTransition.
        """
        at = self.clock() if at is None else at
        if state in (JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED):
            assignments = {"finished_at": at, "error_code": error_code, "error_message": error_message}
        elif state == JobState.JOB_STATE_RUNNING:
            assignments = {"started_at": at}
        elif state == JobState.JOB_STATE_QUEUED:
            assignments = {"started_at": None}
        elif state == JobState.JOB_STATE_SUCCEEDED:
            raise InvalidTransition("a job succeeds through commit_result, which stores its frames")
        else:
            raise ValueError(f"state: {state} is not a job state")
        if timings is not None:
            assignments["timings"] = json.dumps(dict(timings))
        if num_frames_out is not None:
            assignments["num_frames_out"] = num_frames_out
        if fps_out is not None:
            assignments["fps_out"] = fps_out
        with self._transaction() as db:
            current = self._state_of(db, job_id)
            allowed = {
                JobState.JOB_STATE_RUNNING: (JobState.JOB_STATE_QUEUED,),
                JobState.JOB_STATE_QUEUED: (JobState.JOB_STATE_RUNNING,),
            }.get(state, ACTIVE_STATES)
            if current not in allowed:
                raise InvalidTransition(
                    f"job {job_id} is {JobState.Name(current)}; it cannot become {JobState.Name(state)}"
                )
            columns = ", ".join(f"{name} = ?" for name in assignments)
            attempts = ", attempts = attempts + 1" if state == JobState.JOB_STATE_RUNNING else ""
            db.execute(
                f"UPDATE jobs SET state = ?, {columns}{attempts} WHERE job_id = ?",
                (int(state), *assignments.values(), job_id),
            )
            files = self._drop_intermediates(db, job_id) if state in TERMINAL_STATES else []
            row = db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        _unlink_all(files)
        return _record(row)

    def recoverable(self) -> list[JobRecord]:
        """Queued and running jobs in admission order: what a restarted orchestrator must finish."""
        rows = self._fetchall(
            "SELECT * FROM jobs WHERE state IN (?, ?) ORDER BY seq", tuple(int(s) for s in ACTIVE_STATES)
        )
        return [_record(row) for row in rows]

    def list_jobs(
        self,
        *,
        states: Collection[int] | None = None,
        tenant: str | None = None,
        limit: int = 100,
        before_seq: int | None = None,
    ) -> list[JobRecord]:
        """Jobs newest first, optionally of some states or one tenant; `before_seq` pages on."""
        where, params = [], []
        if states:
            where.append(f"state IN ({', '.join('?' * len(states))})")
            params.extend(int(s) for s in states)
        if tenant is not None:
            where.append("tenant = ?")
            params.append(tenant)
        if before_seq is not None:
            where.append("seq < ?")
            params.append(before_seq)
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._fetchall(f"SELECT * FROM jobs {clause} ORDER BY seq DESC LIMIT ?", (*params, limit))
        return [_record(row) for row in rows]

    def finished_jobs(
        self, *, tenant: str | None = None, limit: int = 100, before_seq: int | None = None
    ) -> list[JobRecord]:
        """Succeeded, failed and cancelled jobs, newest first."""
        return self.list_jobs(states=TERMINAL_STATES, tenant=tenant, limit=limit, before_seq=before_seq)

    def tenants(self) -> list[str]:
        """Every tenant that has a stored job."""
        return [row["tenant"] for row in self._fetchall("SELECT DISTINCT tenant FROM jobs ORDER BY tenant", ())]

    # ------------------------------------------------------ intermediates --

    def mark_stage_done(
        self,
        job_id: str,
        stage: str,
        chunks: Iterable[tensor_pb2.TensorChunk],
        *,
        passes: tuple[int, int] | None = None,
    ) -> bool:
        """Saves a finished stage's output, the chunks it sent in order, so that a restarted job resumes after
        it; blocking, use to_thread. `passes`: the DiT's (run, skipped) transformer passes, kept with its output.

        Returns False (and keeps nothing) if the job finished meanwhile, e.g. it was cancelled.
        """
        _check_name("stage", stage)
        if self._state(job_id) in TERMINAL_STATES:
            return False
        buffer = io.BytesIO()
        for chunk in chunks:
            proto.serialize_length_prefixed(chunk, buffer)
        data = buffer.getbuffer()
        directory = self._job_dir(job_id, create=True)
        file = f"stage-{stage}{_CHUNKS_SUFFIX}"
        try:
            _atomic_write(directory / file, lambda out: out.write(data))
        except FileNotFoundError:
            if self._finished_or_gone(job_id):  # deleted while writing
                return False
            raise StoreError(f"job {job_id}: its folder disappeared while stage {stage} was saved") from None
        except OSError as error:
            raise io_error(error, f"job {job_id}: saving the output of stage {stage}") from None
        with self._transaction() as db:
            if self._state_of(db, job_id) in TERMINAL_STATES:
                kept = False
            else:
                db.execute(
                    "INSERT OR REPLACE INTO intermediates (job_id, stage, file, done_at, bytes) VALUES (?, ?, ?, ?, ?)",
                    (job_id, stage, file, self.clock(), len(data)),
                )
                db.execute("UPDATE jobs SET last_stage = ? WHERE job_id = ?", (stage, job_id))
                if passes is not None:
                    db.execute("UPDATE jobs SET passes_run = ?, passes_skipped = ? WHERE job_id = ?", (*passes, job_id))
                kept = True
        if not kept:
            (directory / file).unlink(missing_ok=True)
        return kept

    def load_intermediates(self, job_id: str) -> dict[str, list[tensor_pb2.TensorChunk]]:
        """{stage: the chunks it sent} of every saved stage, in the order they finished; blocking."""
        rows = self._fetchall(
            "SELECT stage, file FROM intermediates WHERE job_id = ? AND stage != ? ORDER BY done_at, rowid",
            (job_id, INPUT_IMAGES),
        )
        loaded: dict[str, list[tensor_pb2.TensorChunk]] = {}
        for row in rows:
            path = self.jobs_dir / job_id / row["file"]
            chunks: list[tensor_pb2.TensorChunk] = []
            try:
                with open(path, "rb") as file:
                    while (chunk := proto.parse_length_prefixed(tensor_pb2.TensorChunk, file)) is not None:
                        chunks.append(chunk)
            except (OSError, ValueError, DecodeError) as error:
                raise StoreError(
                    f"job {job_id}: the saved output of stage {row['stage']} cannot be read: {error}"
                ) from None
            loaded[row["stage"]] = chunks
        return loaded

    # ------------------------------------------------------------ results --

    def create_result(self, job_id: str, shape: tuple[int, ...]) -> ResultWriter:
        """Preallocates a running job's result file of `shape` [F, H, W, 3]; blocking, use to_thread.

        Raises InvalidTransition if the job is not running, StoreError (StoreFull) if the file cannot be made.
        """
        shape = check_shape(shape)
        self._require_state(job_id, (JobState.JOB_STATE_RUNNING,))
        header = npy_header(shape)
        nbytes = len(header) + shape[0] * shape[1] * shape[2] * shape[3]
        try:
            directory = self._job_dir(job_id, create=True)
            partial = directory / f".{RESULT_FILE}.{uuid.uuid4().hex}{_PARTIAL_SUFFIX}"
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise io_error(error, f"job {job_id}: creating its result file") from None
        try:
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, nbytes)
        except OSError as error:
            os.close(fd)
            partial.unlink(missing_ok=True)
            raise io_error(error, f"job {job_id}: creating its result file") from None
        return ResultWriter(job_id, directory, shape, fd, partial, len(header))

    def create_encoded(self, job_id: str, extension: str, media_type: str) -> EncodedWriter:
        """Opens a running job's encoded result file (empty, appended to); blocking, use to_thread."""
        self._require_state(job_id, (JobState.JOB_STATE_RUNNING,))
        if not re.fullmatch(r"\.[a-z0-9]{1,8}", extension):
            raise ValueError(f"extension: {extension!r} is not a file extension")
        try:
            directory = self._job_dir(job_id, create=True)
            partial = directory / f".{ENCODED_FILE}{extension}.{uuid.uuid4().hex}{_PARTIAL_SUFFIX}"
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise io_error(error, f"job {job_id}: creating its encoded result file") from None
        return EncodedWriter(job_id, directory, extension, media_type, fd, partial)

    def commit_result(
        self,
        writer: ResultWriter,
        fps: float,
        *,
        encoded: EncodedWriter | None = None,
        keep_raw: bool = True,
        timings: Mapping[str, float] | None = None,
        at: float | None = None,
    ) -> JobRecord:
        """Completes a written result and marks its job SUCCEEDED in one step; blocking, use to_thread.

        The writer's pieces must cover every frame (ValueError otherwise). With
        `encoded`, its file is completed too, and the raw frames are deleted
        once committed unless `keep_raw`. Raises InvalidTransition (keeping
        nothing) if the job is not running, e.g. it was cancelled meanwhile.
        """
        job_id = writer.job_id
        _check_pieces(writer.pieces, writer.shape[0])
        keep_raw = keep_raw or encoded is None
        self._require_state(job_id, (JobState.JOB_STATE_RUNNING,))
        try:
            if encoded is not None:
                encoded._finish_file()
            try:
                writer._finish_file()
            except BaseException:
                if encoded is not None:
                    encoded._uncommit()  # the two files are committed together or not at all
                raise
        except FileNotFoundError:
            if self._finished_or_gone(job_id):  # cancelled and deleted while writing
                raise InvalidTransition(f"job {job_id} finished or was deleted while its result was written") from None
            raise StoreError(f"job {job_id}: its result file disappeared before it was complete") from None
        except OSError as error:
            raise io_error(error, f"job {job_id}: completing its result") from None
        at = self.clock() if at is None else at
        try:
            with self._transaction() as db:
                self._require_state_of(db, job_id, (JobState.JOB_STATE_RUNNING,))
                db.execute(
                    "INSERT OR REPLACE INTO results (job_id, file, shape, fps, pieces, saved_at, bytes,"
                    " media_type, encoded_file, encoded_bytes, raw_kept) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        job_id,
                        RESULT_FILE,
                        json.dumps(list(writer.shape)),
                        fps,
                        json.dumps(writer.pieces),
                        at,
                        (writer.nbytes if keep_raw else 0) + (encoded.size if encoded is not None else 0),
                        encoded.media_type if encoded is not None else "",
                        encoded.path.name if encoded is not None else None,
                        encoded.size if encoded is not None else 0,
                        int(keep_raw),
                    ),
                )
                updates = "state = ?, finished_at = ?, num_frames_out = ?, fps_out = ?, error_code = NULL"
                params: list = [int(JobState.JOB_STATE_SUCCEEDED), at, int(writer.shape[0]), fps]
                if timings is not None:
                    updates += ", timings = ?"
                    params.append(json.dumps(dict(timings)))
                db.execute(f"UPDATE jobs SET {updates} WHERE job_id = ?", (*params, job_id))
                files = self._drop_intermediates(db, job_id)
                row = db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        except BaseException:
            writer._uncommit()
            if encoded is not None:
                encoded._uncommit()
            raise
        if not keep_raw:
            files.append(writer.path)
        _unlink_all(files)
        return _record(row)

    def save_result(
        self,
        job_id: str,
        frames: np.ndarray,
        fps: float,
        *,
        pieces: list[tuple[int, int]] | None = None,
        timings: Mapping[str, float] | None = None,
        at: float | None = None,
    ) -> JobRecord:
        """Stores frames the caller already holds whole and marks the job SUCCEEDED; blocking, use to_thread.

        `create_result` + `ResultWriter.write` + `commit_result` in one call.
        `pieces` are the (first frame, count) of the tensors as first published;
        the default is one piece.
        """
        _check_frames(frames)
        pieces = [(int(first), int(count)) for first, count in (pieces or [(0, frames.shape[0])])]
        _check_pieces(pieces, frames.shape[0])
        writer = self.create_result(job_id, frames.shape)
        try:
            writer.write(0, 0, np.ascontiguousarray(frames).reshape(-1))
            for first, count in pieces:
                writer.add_piece(first, count)
            return self.commit_result(writer, fps, timings=timings, at=at)
        finally:
            writer.discard()

    def load_result(self, job_id: str) -> StoredResult | None:
        """A succeeded job's result (file, shape, pieces), None if it has none; reads the file's header only."""
        row = self._fetchone(
            "SELECT results.*, jobs.timings, jobs.passes_run, jobs.passes_skipped FROM results JOIN jobs"
            " USING (job_id) WHERE job_id = ?",
            (job_id,),
        )
        if row is None:
            return None
        directory = self.jobs_dir / job_id
        path, shape, data_offset = None, check_shape(json.loads(row["shape"])), 0
        if row["raw_kept"]:
            path = directory / row["file"]
            try:
                with open(path, "rb") as file:
                    shape, data_offset = read_npy_header(file)
                    size = os.fstat(file.fileno()).st_size
            except (OSError, ValueError) as error:
                raise StoreError(f"job {job_id}: its result file cannot be read: {error}") from None
            if list(shape) != json.loads(row["shape"]) or size != data_offset + int(np.prod(shape)):
                raise StoreError(f"job {job_id}: the result file does not hold the frames its record describes")
        encoded_path = directory / row["encoded_file"] if row["encoded_file"] else None
        if encoded_path is not None:
            try:
                size = encoded_path.stat().st_size
            except OSError as error:
                raise StoreError(f"job {job_id}: its encoded result cannot be read: {error}") from None
            if size != row["encoded_bytes"]:
                raise StoreError(
                    f"job {job_id}: its encoded result has {size} bytes, its record says {row['encoded_bytes']}"
                )
        return StoredResult(
            path=path,
            media_type=row["media_type"],
            encoded_path=encoded_path,
            encoded_bytes=row["encoded_bytes"],
            shape=check_shape(shape),
            data_offset=data_offset,
            fps=row["fps"],
            pieces=[(first, count) for first, count in json.loads(row["pieces"])],
            timings=json.loads(row["timings"]),
            transformer_passes=(row["passes_run"], row["passes_skipped"]),
        )

    # ---------------------------------------------------------- retention --

    def usage(self, tenant: str) -> Usage:
        """Bytes the tenant's jobs hold: results of its finished jobs, intermediates of its queued and running ones.

        A running job's result file counts once it is committed; the caller
        reserves what running jobs are still writing (`prune`'s `reserved_bytes`).
        """
        row = self._fetchone(
            "SELECT"
            " (SELECT COALESCE(SUM(r.bytes), 0) FROM results r JOIN jobs j USING (job_id) WHERE j.tenant = ?)"
            " AS finished,"
            " (SELECT COALESCE(SUM(i.bytes), 0) FROM intermediates i JOIN jobs j USING (job_id) WHERE j.tenant = ?)"
            " AS active",
            (tenant, tenant),
        )
        return Usage(finished=row["finished"], active=row["active"])

    def delete(self, job_id: str) -> bool:
        """Forgets a finished job and its files; False if unknown. Queued or running jobs are refused."""
        with self._transaction() as db:
            row = db.execute("SELECT state FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                return False
            if row["state"] not in TERMINAL_STATES:
                raise InvalidTransition(f"job {job_id} is {JobState.Name(row['state'])}; finish it before deleting")
            db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
        shutil.rmtree(self.jobs_dir / job_id, ignore_errors=True)
        return True

    def prune(
        self,
        *,
        tenant: str | None = None,
        max_kept: int | None = None,
        max_bytes: int | None = None,
        reserved_bytes: int = 0,
        max_age_s: float | None = None,
    ) -> list[str]:
        """Deletes finished jobs (records and files) beyond the limits; returns their ids. Blocking.

        The limits hold for each tenant on its own: with `tenant`, only that
        tenant's jobs are looked at; without, every tenant's, each against its
        own count and bytes, so one tenant's jobs never make room for another's.
        A tenant keeps its newest finished jobs while they number at most
        `max_kept` and its bytes (the files of its queued and running jobs,
        `reserved_bytes` for what they will still write, then its finished
        results from the newest) stay within `max_bytes`; the rest, oldest
        first, go. `max_age_s` deletes jobs that finished longer ago.
        `reserved_bytes` needs `tenant`.
        """
        if reserved_bytes and tenant is None:
            raise ValueError("reserved_bytes: give the tenant it is reserved for")
        terminal = tuple(int(s) for s in TERMINAL_STATES)
        only = " AND jobs.tenant = ?" if tenant is not None else ""
        scope = (tenant,) if tenant is not None else ()
        cutoff = None if max_age_s is None else self.clock() - max_age_s
        if max_kept is None and max_bytes is None:  # age alone: only the expired jobs need looking at
            if cutoff is None:
                return []
            only += " AND jobs.finished_at < ?"
            scope = (*scope, cutoff)
        doomed: list[str] = []
        with self._transaction() as db:
            finished = db.execute(
                "SELECT jobs.job_id, jobs.tenant, jobs.finished_at, COALESCE(results.bytes, 0) AS bytes"
                " FROM jobs LEFT JOIN results USING (job_id)"
                f" WHERE jobs.state IN (?, ?, ?){only} ORDER BY jobs.finished_at DESC, jobs.seq DESC",
                (*terminal, *scope),
            ).fetchall()
            used: dict[str, int] = {}
            if max_bytes is not None:
                for row in db.execute(
                    "SELECT jobs.tenant, COALESCE(SUM(intermediates.bytes), 0) AS bytes"
                    " FROM intermediates JOIN jobs USING (job_id)"
                    f" WHERE jobs.state NOT IN (?, ?, ?){only} GROUP BY jobs.tenant",
                    (*terminal, *scope),
                ):
                    used[row["tenant"]] = row["bytes"]
                if tenant is not None:
                    used[tenant] = used.get(tenant, 0) + reserved_bytes
            kept: dict[str, int] = {}
            full: set[str] = set()  # tenants whose older finished jobs all go
            for row in finished:
                owner = row["tenant"]
                too_old = cutoff is not None and (row["finished_at"] or 0.0) < cutoff
                too_many = max_kept is not None and kept.get(owner, 0) >= max_kept
                too_big = max_bytes is not None and used.get(owner, 0) + row["bytes"] > max_bytes
                if too_big or too_many:
                    full.add(owner)
                if too_old or owner in full:
                    doomed.append(row["job_id"])
                    continue
                kept[owner] = kept.get(owner, 0) + 1
                used[owner] = used.get(owner, 0) + row["bytes"]
            db.executemany("DELETE FROM jobs WHERE job_id = ?", [(job_id,) for job_id in doomed])
        for job_id in doomed:
            shutil.rmtree(self.jobs_dir / job_id, ignore_errors=True)
        return sorted(doomed)

    # ----------------------------------------------------------- internals --

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("the job store is closed")
        return self._db

    def _fetchone(self, sql: str, params: tuple) -> sqlite3.Row | None:
        with self._mutex:
            try:
                return self._connection().execute(sql, params).fetchone()
            except sqlite3.Error as error:
                raise db_error(error) from None

    def _fetchall(self, sql: str, params: tuple) -> list[sqlite3.Row]:
        with self._mutex:
            try:
                return self._connection().execute(sql, params).fetchall()
            except sqlite3.Error as error:
                raise db_error(error) from None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT; rolled back on any error, database errors raised as StoreError."""
        with self._mutex:
            db = self._connection()
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as error:
                raise db_error(error) from None
            try:
                yield db
                db.execute("COMMIT")
            except BaseException as error:
                if db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                if isinstance(error, sqlite3.Error):
                    raise db_error(error) from None
                raise

    def _state_of(self, db: sqlite3.Connection, job_id: str) -> int:
        row = db.execute("SELECT state FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise UnknownJob(job_id)
        return row["state"]

    def _state(self, job_id: str) -> int:
        row = self._fetchone("SELECT state FROM jobs WHERE job_id = ?", (job_id,))
        if row is None:
            raise UnknownJob(job_id)
        return row["state"]

    def _finished_or_gone(self, job_id: str) -> bool:
        try:
            return self._state(job_id) in TERMINAL_STATES
        except UnknownJob:
            return True

    def _require_state_of(self, db: sqlite3.Connection, job_id: str, states: tuple[int, ...]) -> None:
        current = self._state_of(db, job_id)
        if current not in states:
            wanted = " or ".join(JobState.Name(s) for s in states)
            raise InvalidTransition(f"job {job_id} is {JobState.Name(current)}, not {wanted}")

    def _require_state(self, job_id: str, states: tuple[int, ...]) -> None:
        current = self._state(job_id)
        if current not in states:
            wanted = " or ".join(JobState.Name(s) for s in states)
            raise InvalidTransition(f"job {job_id} is {JobState.Name(current)}, not {wanted}")

    def _job_dir(self, job_id: str, *, create: bool = False) -> Path:
        _check_name("job_id", job_id)
        directory = self.jobs_dir / job_id
        if create and not directory.is_dir():
            try:
                directory.mkdir(exist_ok=True)
                fsync_dir(self.jobs_dir)
            except OSError as error:
                raise io_error(error, f"job {job_id}: creating its folder") from None
        return directory

    def _drop_intermediates(self, db: sqlite3.Connection, job_id: str) -> list[Path]:
        """Deletes the rows in this transaction; the caller unlinks the returned files after commit."""
        rows = db.execute("SELECT file FROM intermediates WHERE job_id = ?", (job_id,)).fetchall()
        db.execute("DELETE FROM intermediates WHERE job_id = ?", (job_id,))
        return [self.jobs_dir / job_id / row["file"] for row in rows]

    def _migrate(self) -> None:
        with self._transaction() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.state_dir / DB_NAME} has schema version {version}; this version reads {SCHEMA_VERSION}"
                )
            if version == 0:
                _run_script(db, _SCHEMA)
            if version == 1:
                _run_script(db, _MIGRATE_1_TO_2)
                for table in ("intermediates", "results"):
                    rows = db.execute(f"SELECT rowid, job_id, file FROM {table}").fetchall()
                    for row in rows:
                        path = self.jobs_dir / row["job_id"] / row["file"]
                        size = path.stat().st_size if path.is_file() else 0
                        db.execute(f"UPDATE {table} SET bytes = ? WHERE rowid = ?", (size, row["rowid"]))
            if version in (1, 2):
                _run_script(db, _MIGRATE_2_TO_3)
            if version in (1, 2, 3):
                _run_script(db, _MIGRATE_3_TO_4)
            if version in (1, 2, 3, 4):
                _run_script(db, _MIGRATE_4_TO_5)
            if version != SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _sweep(self) -> None:
        """Removes what a crash can leave behind: temporary and partial files, and files or folders no row names."""
        with self._mutex:
            db = self._connection()
            known = {row["job_id"] for row in db.execute("SELECT job_id FROM jobs")}
            referenced = {
                (row["job_id"], row["file"])
                for row in db.execute(
                    "SELECT job_id, file FROM intermediates UNION ALL SELECT job_id, file FROM results"
                    " UNION ALL SELECT job_id, encoded_file FROM results WHERE encoded_file IS NOT NULL"
                )
            }
        for directory in self.jobs_dir.iterdir():
            if not directory.is_dir() or directory.name not in known:
                if directory.is_dir():
                    shutil.rmtree(directory, ignore_errors=True)
                else:
                    directory.unlink(missing_ok=True)
                continue
            for path in directory.iterdir():
                if (directory.name, path.name) not in referenced:
                    if path.is_dir():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                directory.rmdir()  # only succeeds when nothing is left


def _run_script(db: sqlite3.Connection, script: str) -> None:
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _close_quietly(connection: sqlite3.Connection | None, lock_file) -> None:
    if connection is not None:
        with contextlib.suppress(Exception):
            connection.close()
    lock_file.close()


def _unlink_all(paths: Iterable[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _record(row: sqlite3.Row) -> JobRecord:
    return JobRecord(
        job_id=row["job_id"],
        tenant=row["tenant"],
        request=bytes(row["request"]),
        request_id=row["request_id"] or "",
        priority=row["priority"],
        state=row["state"],
        created_at=row["created_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        deadline_at=row["deadline_at"],
        error_code=row["error_code"],
        error_message=row["error_message"],
        timings=json.loads(row["timings"]),
        num_frames_out=row["num_frames_out"],
        fps_out=row["fps_out"],
        last_stage=row["last_stage"],
        attempts=row["attempts"],
        passes_run=row["passes_run"],
        passes_skipped=row["passes_skipped"],
        seq=row["seq"],
    )
