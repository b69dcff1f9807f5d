"""Durable job records and results under the orchestrator's state directory.

Layout of `state_dir`:

    jobs.sqlite3 (+ -wal, -shm)   job records, which intermediates and results exist
    LOCK                          held (flock) by the one process that owns the directory
    jobs/<job_id>/stage-<stage>.safetensors   tensors of a finished stage of an unfinished job
    jobs/<job_id>/result-frames.npy           the final frames, uint8 [F, H, W, 3]

Durability. SQLite runs in WAL mode with `synchronous=NORMAL` by default: a
committed transaction is in the WAL file when `commit` returns, so it survives
a crash or SIGKILL of the process; only a power loss or kernel crash can lose
the last transactions (never corrupt the database). `synchronous="FULL"` also
survives those, at one fsync per commit. Files are written atomically (a
temporary file, fsync, os.replace, fsync of the directory) before the row that
names them is committed, so a row always points at a complete file, and a file
without a row (a crash between the two) is never read and is swept away by the
next `open`.

Threads. One connection, guarded by a lock, so every method may be called from
any thread. Record methods (insert, get, update_state, find_by_request_id,
recoverable, list_jobs) take well under a millisecond and are meant to be
called directly on the event loop thread. Methods that read or write tensor
files (mark_stage_done, load_intermediates, save_result, load_result, delete,
prune) can take much longer (fsync, large arrays): call them through
`asyncio.to_thread`. They hold the lock only for their short transaction,
never while writing a file. Each job has one writer at a time (its own task);
two threads saving the same job's result at once are not supported. One
process owns a state directory at a time (`StateDirLocked` otherwise); the
kernel drops the lock when the process dies.
"""

from __future__ import annotations

import contextlib
import fcntl
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
import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from services.tensor_codec import TensorAssembler, encode_tensor
from stagediff.v1 import generation_pb2, tensor_pb2

JobState = generation_pb2.JobState
TERMINAL_STATES = (JobState.JOB_STATE_SUCCEEDED, JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED)
ACTIVE_STATES = (JobState.JOB_STATE_QUEUED, JobState.JOB_STATE_RUNNING)

SCHEMA_VERSION = 1
DB_NAME = "jobs.sqlite3"
LOCK_NAME = "LOCK"
JOBS_DIR = "jobs"
RESULT_FILE = "result-frames.npy"
_TMP_SUFFIX = ".tmp"
_ORDER_KEY = "stagediff.order"  # safetensors metadata: the tensors' names in the order they were given
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
    UNIQUE (tenant, request_id)
);
CREATE INDEX jobs_by_state ON jobs (state, seq);
CREATE TABLE intermediates (
    job_id TEXT NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    stage TEXT NOT NULL,
    file TEXT NOT NULL,
    done_at REAL NOT NULL,
    PRIMARY KEY (job_id, stage)
);
CREATE TABLE results (
    job_id TEXT PRIMARY KEY REFERENCES jobs (job_id) ON DELETE CASCADE,
    file TEXT NOT NULL,
    shape TEXT NOT NULL,                    -- JSON [F, H, W, 3]
    fps REAL NOT NULL,
    pieces TEXT NOT NULL,                   -- JSON [[first frame, count], ...] as first published
    saved_at REAL NOT NULL
);
"""


class StoreError(Exception):
    """The state directory cannot be used as asked."""


class StateDirLocked(StoreError):
    """Another process owns the state directory."""


class UnknownJob(KeyError):
    """No record with that job id."""


class InvalidTransition(StoreError):
    """The job's current state does not allow the change (e.g. it already finished)."""


class DuplicateRequestId(StoreError):
    """The tenant already has a job with this request id; `job_id` names it."""

    def __init__(self, message: str, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


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


@dataclass
class StoredResult:
    """A finished job's frames (read-only, memory-mapped) and how they were first published."""

    frames: np.ndarray  # uint8 [F, H, W, 3]
    fps: float
    pieces: list[tuple[int, int]]  # (first frame, count) of each published tensor, in order
    timings: dict[str, float]

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    def events(self, job_id: str = "") -> Iterator[generation_pb2.GenerateEvent]:
        """The result chunks and the completion event, as a watcher of the live job received them."""
        for first, count in self.pieces:
            for chunk in encode_tensor("frames", self.frames[first : first + count], index=first):
                yield generation_pb2.GenerateEvent(
                    job_id=job_id, result=generation_pb2.ResultChunk(tensor=chunk, fps=self.fps)
                )
        yield generation_pb2.GenerateEvent(
            job_id=job_id,
            completed=generation_pb2.JobCompleted(timings=self.timings, num_frames=self.num_frames, fps=self.fps),
        )


class FrameCollector:
    """Rebuilds the frames a job published from its result chunks, for `save_result`.

    Feed every published `ResultChunk.tensor` (or pass the job's events to
    `from_events`). A frame tensor published twice at the same index (a stage
    retried) is kept once.
    """

    def __init__(self) -> None:
        self._assembler = TensorAssembler()
        self._pieces: dict[int, np.ndarray] = {}
        self._order: list[int] = []

    @classmethod
    def from_events(cls, events: Iterable[generation_pb2.GenerateEvent]) -> FrameCollector:
        collector = cls()
        for event in events:
            if event.HasField("result"):
                collector.feed(event.result.tensor)
        return collector

    def feed(self, chunk: tensor_pb2.TensorChunk) -> None:
        tensor = self._assembler.feed(chunk)
        if tensor is None:
            return
        if tensor.index not in self._pieces:
            self._order.append(tensor.index)
        self._pieces[tensor.index] = tensor.array

    def result(self) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The frames uint8 [F, H, W, 3] and the pieces; raises ValueError on gaps or overlaps."""
        self._assembler.finish()
        pieces = [(index, int(self._pieces[index].shape[0])) for index in self._order]
        _check_pieces(pieces, sum(count for _, count in pieces))
        if not pieces:
            raise ValueError("no frames were published")
        frames = np.concatenate([self._pieces[index] for index in sorted(self._pieces)])
        _check_frames(frames)
        return frames, pieces


def pack_wire_tensors(chunks: Iterable[tensor_pb2.TensorChunk]) -> dict[str, torch.Tensor]:
    """Assembles wire chunks (e.g. the DiT's latent chunks) into tensors keyed "<name>@<index>", in order."""
    assembler = TensorAssembler()
    tensors: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        tensor = assembler.feed(chunk)
        if tensor is not None:
            tensors[f"{tensor.name}@{tensor.index}"] = tensor.to_torch()
    assembler.finish()
    return tensors


def unpack_wire_tensors(tensors: Mapping[str, torch.Tensor]) -> list[tensor_pb2.TensorChunk]:
    """The wire chunks of tensors packed by `pack_wire_tensors`, in the same order."""
    chunks: list[tensor_pb2.TensorChunk] = []
    for key, tensor in tensors.items():
        name, _, index = key.rpartition("@")
        chunks.extend(encode_tensor(name, tensor, index=int(index)))
    return chunks


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    _fsync_dir(path.parent)


def _as_cpu_tensor(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, copy=True))
    # A private contiguous copy: safetensors refuses tensors that share storage (views of one batch).
    return value.detach().to("cpu").contiguous().clone()


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
        """Opens (creating if needed) the store, takes ownership of the directory and sweeps crash leftovers."""
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous: '{synchronous}' is not one of NORMAL, FULL")
        state_dir = Path(state_dir)
        (state_dir / JOBS_DIR).mkdir(parents=True, exist_ok=True)
        lock_file = open(state_dir / LOCK_NAME, "a+b")  # noqa: SIM115 - held for the store's lifetime
        try:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.close()
            raise StateDirLocked(f"state dir {state_dir} is in use by another process") from None
        try:
            connection = sqlite3.connect(state_dir / DB_NAME, isolation_level=None, check_same_thread=False)
            connection.row_factory = sqlite3.Row
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={synchronous}")
            connection.execute("PRAGMA foreign_keys=ON")
            store = cls(state_dir, connection, lock_file, clock)
            store._migrate()
            store._sweep()
        except BaseException:
            with contextlib.suppress(Exception):
                connection.close()
            lock_file.close()
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

    # ------------------------------------------------------------ records --

    def insert(self, record: JobRecord) -> JobRecord:
        """Stores a new job; returns it with `seq` (and `created_at` if unset) filled in."""
        _check_name("job_id", record.job_id)
        record = replace(record, created_at=record.created_at or self.clock())
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
            return replace(record, seq=cursor.lastrowid)

    def get(self, job_id: str) -> JobRecord | None:
        with self._mutex:
            row = self._connection().execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return _record(row) if row is not None else None

    def find_by_request_id(self, tenant: str, request_id: str) -> JobRecord | None:
        """The tenant's job with this client-chosen id (idempotent resubmission), if any."""
        if not request_id:
            return None
        with self._mutex:
            row = (
                self._connection()
                .execute("SELECT * FROM jobs WHERE tenant = ? AND request_id = ?", (tenant, request_id))
                .fetchone()
            )
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
        SUCCEEDED goes through `save_result`, so that a succeeded job always has
        its result. A finished job cannot change: InvalidTransition.
        """
        at = self.clock() if at is None else at
        if state in (JobState.JOB_STATE_FAILED, JobState.JOB_STATE_CANCELLED):
            assignments = {"finished_at": at, "error_code": error_code, "error_message": error_message}
        elif state == JobState.JOB_STATE_RUNNING:
            assignments = {"started_at": at}
        elif state == JobState.JOB_STATE_QUEUED:
            assignments = {"started_at": None}
        elif state == JobState.JOB_STATE_SUCCEEDED:
            raise InvalidTransition("a job succeeds through save_result, which stores its frames")
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
        with self._mutex:
            rows = (
                self._connection()
                .execute("SELECT * FROM jobs WHERE state IN (?, ?) ORDER BY seq", tuple(int(s) for s in ACTIVE_STATES))
                .fetchall()
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
        with self._mutex:
            rows = (
                self._connection()
                .execute(f"SELECT * FROM jobs {clause} ORDER BY seq DESC LIMIT ?", (*params, limit))
                .fetchall()
            )
        return [_record(row) for row in rows]

    def finished_jobs(
        self, *, tenant: str | None = None, limit: int = 100, before_seq: int | None = None
    ) -> list[JobRecord]:
        """Succeeded, failed and cancelled jobs, newest first."""
        return self.list_jobs(states=TERMINAL_STATES, tenant=tenant, limit=limit, before_seq=before_seq)

    # ------------------------------------------------------ intermediates --

    def mark_stage_done(self, job_id: str, stage: str, tensors: Mapping[str, torch.Tensor | np.ndarray]) -> bool:
        """Saves a finished stage's output so a restarted job resumes after it; blocking, use to_thread.

        Returns False (and keeps nothing) if the job finished meanwhile, e.g. it was cancelled.
        """
        _check_name("stage", stage)
        if self._state(job_id) in TERMINAL_STATES:
            return False
        prepared = {name: _as_cpu_tensor(value) for name, value in tensors.items()}
        data = save_safetensors(prepared, metadata={_ORDER_KEY: json.dumps(list(prepared))})
        directory = self._job_dir(job_id, create=True)
        file = f"stage-{stage}.safetensors"
        try:
            _atomic_write(directory / file, lambda out: out.write(data))
        except FileNotFoundError:
            if self._finished_or_gone(job_id):  # deleted while writing
                return False
            raise
        with self._transaction() as db:
            if self._state_of(db, job_id) in TERMINAL_STATES:
                kept = False
            else:
                db.execute(
                    "INSERT OR REPLACE INTO intermediates (job_id, stage, file, done_at) VALUES (?, ?, ?, ?)",
                    (job_id, stage, file, self.clock()),
                )
                db.execute("UPDATE jobs SET last_stage = ? WHERE job_id = ?", (stage, job_id))
                kept = True
        if not kept:
            (directory / file).unlink(missing_ok=True)
        return kept

    def load_intermediates(self, job_id: str) -> dict[str, dict[str, torch.Tensor]]:
        """{stage: {name: tensor}} of every saved stage, in the order they finished; blocking."""
        with self._mutex:
            rows = (
                self._connection()
                .execute("SELECT stage, file FROM intermediates WHERE job_id = ? ORDER BY done_at, rowid", (job_id,))
                .fetchall()
            )
        loaded: dict[str, dict[str, torch.Tensor]] = {}
        for row in rows:
            with safe_open(self.jobs_dir / job_id / row["file"], framework="pt") as file:
                order = json.loads((file.metadata() or {}).get(_ORDER_KEY, "[]")) or sorted(file.keys())
                loaded[row["stage"]] = {name: file.get_tensor(name) for name in order}
        return loaded

    # ------------------------------------------------------------ results --

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
        """Stores the final frames and marks the job SUCCEEDED in one step; blocking, use to_thread.

        `pieces` are the (first frame, count) of the tensors as first published
        (`FrameCollector.result`), so a replay looks like the live stream; the
        default is one piece. Raises InvalidTransition (keeping nothing) if the
        job is not running, e.g. it was cancelled meanwhile.
        """
        _check_frames(frames)
        pieces = [(int(first), int(count)) for first, count in (pieces or [(0, frames.shape[0])])]
        _check_pieces(pieces, frames.shape[0])
        self._require_state(job_id, (JobState.JOB_STATE_RUNNING,))
        path = self._job_dir(job_id, create=True) / RESULT_FILE
        try:
            _atomic_write(path, lambda out: np.save(out, np.ascontiguousarray(frames), allow_pickle=False))
        except FileNotFoundError:
            if self._finished_or_gone(job_id):  # cancelled and deleted while writing
                raise InvalidTransition(f"job {job_id} finished or was deleted while its result was written") from None
            raise
        at = self.clock() if at is None else at
        try:
            with self._transaction() as db:
                self._require_state_of(db, job_id, (JobState.JOB_STATE_RUNNING,))
                db.execute(
                    "INSERT OR REPLACE INTO results (job_id, file, shape, fps, pieces, saved_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (job_id, RESULT_FILE, json.dumps(list(frames.shape)), fps, json.dumps(pieces), at),
                )
                updates = "state = ?, finished_at = ?, num_frames_out = ?, fps_out = ?, error_code = NULL"
                params: list = [int(JobState.JOB_STATE_SUCCEEDED), at, int(frames.shape[0]), fps]
                if timings is not None:
                    updates += ", timings = ?"
                    params.append(json.dumps(dict(timings)))
                db.execute(f"UPDATE jobs SET {updates} WHERE job_id = ?", (*params, job_id))
                files = self._drop_intermediates(db, job_id)
                row = db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        except InvalidTransition:
            path.unlink(missing_ok=True)
            raise
        _unlink_all(files)
        return _record(row)

    def load_result(self, job_id: str) -> StoredResult | None:
        """A succeeded job's frames (memory-mapped) and how to replay them; None if it has none; blocking."""
        with self._mutex:
            row = (
                self._connection()
                .execute(
                    "SELECT results.*, jobs.timings FROM results JOIN jobs USING (job_id) WHERE job_id = ?", (job_id,)
                )
                .fetchone()
            )
        if row is None:
            return None
        try:
            frames = np.load(self.jobs_dir / job_id / row["file"], mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            raise StoreError(f"job {job_id}: its result file cannot be read: {error}") from None
        if list(frames.shape) != json.loads(row["shape"]) or frames.dtype != np.uint8:
            raise StoreError(f"job {job_id}: the result file does not hold the frames its record describes")
        pieces = [(first, count) for first, count in json.loads(row["pieces"])]
        return StoredResult(frames=frames, fps=row["fps"], pieces=pieces, timings=json.loads(row["timings"]))

    # ---------------------------------------------------------- retention --

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

    def prune(self, *, max_kept: int | None = None, max_age_s: float | None = None) -> list[str]:
        """Deletes finished jobs beyond the newest `max_kept` or finished over `max_age_s` ago; returns their ids."""
        terminal = tuple(int(s) for s in TERMINAL_STATES)
        doomed: set[str] = set()
        with self._transaction() as db:
            if max_kept is not None:
                rows = db.execute(
                    "SELECT job_id FROM jobs WHERE state IN (?, ?, ?) ORDER BY finished_at DESC, seq DESC"
                    " LIMIT -1 OFFSET ?",
                    (*terminal, max_kept),
                ).fetchall()
                doomed.update(row["job_id"] for row in rows)
            if max_age_s is not None:
                rows = db.execute(
                    "SELECT job_id FROM jobs WHERE state IN (?, ?, ?) AND finished_at < ?",
                    (*terminal, self.clock() - max_age_s),
                ).fetchall()
                doomed.update(row["job_id"] for row in rows)
            db.executemany("DELETE FROM jobs WHERE job_id = ?", [(job_id,) for job_id in doomed])
        for job_id in doomed:
            shutil.rmtree(self.jobs_dir / job_id, ignore_errors=True)
        return sorted(doomed)

    # ----------------------------------------------------------- internals --

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError("the job store is closed")
        return self._db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._mutex:
            db = self._connection()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _state_of(self, db: sqlite3.Connection, job_id: str) -> int:
        row = db.execute("SELECT state FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is None:
            raise UnknownJob(job_id)
        return row["state"]

    def _state(self, job_id: str) -> int:
        with self._mutex:
            return self._state_of(self._connection(), job_id)

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
        with self._mutex:
            self._require_state_of(self._connection(), job_id, states)

    def _job_dir(self, job_id: str, *, create: bool = False) -> Path:
        _check_name("job_id", job_id)
        directory = self.jobs_dir / job_id
        if create and not directory.is_dir():
            directory.mkdir(exist_ok=True)
            _fsync_dir(self.jobs_dir)
        return directory

    def _drop_intermediates(self, db: sqlite3.Connection, job_id: str) -> list[Path]:
        """Deletes the rows in this transaction; the caller unlinks the returned files after commit."""
        rows = db.execute("SELECT file FROM intermediates WHERE job_id = ?", (job_id,)).fetchall()
        db.execute("DELETE FROM intermediates WHERE job_id = ?", (job_id,))
        return [self.jobs_dir / job_id / row["file"] for row in rows]

    def _migrate(self) -> None:
        with self._transaction() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            elif version != SCHEMA_VERSION:
                raise StoreError(
                    f"{self.state_dir / DB_NAME} has schema version {version}; this version reads {SCHEMA_VERSION}"
                )

    def _sweep(self) -> None:
        """Removes what a crash can leave behind: temporary files, and files or job folders no row names."""
        with self._mutex:
            db = self._connection()
            known = {row["job_id"] for row in db.execute("SELECT job_id FROM jobs")}
            referenced = {
                (row["job_id"], row["file"])
                for row in db.execute(
                    "SELECT job_id, file FROM intermediates UNION ALL SELECT job_id, file FROM results"
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
        seq=row["seq"],
    )
