"""`JobStore`: durable job records (rows) and their files (a state directory, or blobs).

It composes the rows (rows.py: SQLite in the state directory, or PostgreSQL) and the files (files.py: the directory, or
a BlobStore such as S3; results.py: a result's files); its result operations (a running job's result files made, then
committed with its row; a result loaded back) are `JobResults`, in job_results.py. Every operation that touches both
follows one rule: a file is complete before the row that names it is committed, and a row's files are deleted only after
the transaction that drops the row. So a row always points at a complete file, and a file without a row (a crash between
the two, a result still being written, a fenced-out owner's upload) is never read as a result: `open` sweeps the
directory, and `collect_garbage` the blob store.

Durability. SQLite runs in WAL mode with `synchronous=NORMAL` by default: a committed transaction survives a
crash or SIGKILL of the process; only a power loss or kernel crash can lose the last transactions (never
corrupt the database). `synchronous="FULL"` also survives those, at one fsync per commit.

Claims. Moving a job to RUNNING claims it for this store's `owner` (leases.py); every later write of the job
names that claim and changes nothing once another replica claimed the job again (LeaseLost).

Threads. Every method may be called from any thread; all of them can block (the database, the files): call them
through `asyncio.to_thread`. The database lock is held only for a short transaction, never while writing a file.
Each job has one writer at a time (its own task).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from services.orchestrator.blobs.protocol import BlobStore
from services.orchestrator.store import retention
from services.orchestrator.store.database import (
    DB_NAME,
    LOCK_NAME,
    Database,
    JobDatabase,
    close_quietly,
    lock_state_dir,
)
from services.orchestrator.store.files import JOBS_DIR, JobFiles, check_name
from services.orchestrator.store.job_results import JobResults
from services.orchestrator.store.leases import HeldClaims, JobLeases
from services.orchestrator.store.models import ModelRows
from services.orchestrator.store.postgres import PostgresDatabase
from services.orchestrator.store.records import TERMINAL_STATES, JobRecord, JobState, SavedImages, Usage
from services.orchestrator.store.results import ResultFiles
from services.orchestrator.store.rows import JobRows
from services.orchestrator.store.schema import migrate
from services.orchestrator.store_errors import InvalidTransition, StoreError, io_error
from stagediff.v1 import image_pb2, stages_pb2, tensor_pb2

EMBEDDED_OWNER = "embedded"  # the owner of every job a lone orchestrator claims
DEFAULT_LEASE_TTL_S = 30.0
GARBAGE_MIN_AGE_S = 3600.0  # blobs no row names are deleted once this old (the clocks of replicas and store may differ)


class JobStore(JobResults):
    """Job records and their files; see the module docstring for the guarantees (its result operations are
    JobResults', job_results.py)."""

    def __init__(
        self,
        state_dir: Path,
        database: JobDatabase,
        lock_file: IO[bytes],
        clock: Callable[[], float],
        *,
        blobs: BlobStore | None = None,
        owner: str = EMBEDDED_OWNER,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        self.state_dir = state_dir
        self.jobs_dir = state_dir / JOBS_DIR
        self.clock = clock
        self.files = JobFiles(self.jobs_dir, blobs)
        self.result_files = ResultFiles(self.files)  # a result's files: the spool, completed, found again
        self.owner = owner
        self.lease_ttl_s = lease_ttl_s
        self._db = database
        self._rows = JobRows(database)
        self.models = ModelRows(database)  # the models DiT replicas reported (store/models.py)
        self._lock_file = lock_file
        self._leases = JobLeases(database, owner, lease_ttl_s)
        self._claims = HeldClaims(owner)  # the jobs this store moved to RUNNING and still runs

    @classmethod
    def open(
        cls,
        state_dir: str | os.PathLike[str],
        *,
        synchronous: str = "NORMAL",
        clock: Callable[[], float] = time.time,
        database_url: str | None = None,
        blobs: BlobStore | None = None,
        owner: str = EMBEDDED_OWNER,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    ) -> JobStore:
        """Opens (creating if needed) the store, takes ownership of the directory and sweeps crash leftovers.

        `database_url` (postgresql://) keeps the rows in PostgreSQL instead of the directory's SQLite file;
        `blobs` keeps stage outputs, input images and results in a blob store (S3) instead of the directory,
        which then holds only the spool of results being written. `owner` names this replica in the jobs
        it claims. A directory that cannot be used (not writable, a file in the way, a read-only volume)
        raises StoreError with a one-line message.
        """
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous: '{synchronous}' is not one of NORMAL, FULL")
        state_dir = Path(state_dir)
        try:
            (state_dir / JOBS_DIR).mkdir(parents=True, exist_ok=True)
            lock_file = open(state_dir / LOCK_NAME, "a+b")  # noqa: SIM115 - held for the store's lifetime
        except OSError as error:
            raise io_error(error, "cannot be used as the state dir", with_path=True) from None
        lock_state_dir(state_dir, lock_file)
        database: JobDatabase | None = None
        try:
            if not os.access(state_dir / JOBS_DIR, os.W_OK | os.X_OK):
                raise StoreError(f"cannot be used as the state dir: {state_dir / JOBS_DIR} is not writable")
            settings: dict[str, Any] = {"blobs": blobs, "owner": owner, "lease_ttl_s": lease_ttl_s}
            if database_url is None:
                database = Database.connect(state_dir / DB_NAME, synchronous)
                store = cls(state_dir, database, lock_file, clock, **settings)
                migrate(database, state_dir / DB_NAME, store.files.size_of)
            else:  # the rows in PostgreSQL, which brings its own schema up to date
                database = PostgresDatabase.connect(database_url)
                store = cls(state_dir, database, lock_file, clock, **settings)
            store.files.sweep(*store._rows.files_in_use())
        except sqlite3.Error as error:
            close_quietly(database, lock_file)
            raise StoreError(f"cannot be used as the state dir: {state_dir / DB_NAME}: {error}") from None
        except OSError as error:
            close_quietly(database, lock_file)
            raise io_error(error, "cannot be used as the state dir", with_path=True) from None
        except BaseException:
            close_quietly(database, lock_file)
            raise
        return store

    def close(self) -> None:
        self.files.close()
        with self._db.mutex:
            if self._db.close():
                self._lock_file.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def free_bytes(self) -> tuple[int, int]:
        """(free, total) bytes of the state directory's volume."""
        usage = shutil.disk_usage(self.state_dir)
        return usage.free, usage.total

    def _connection(self) -> Any:
        """The database connection (StoreError once closed), for inspection."""
        return self._db.connection()

    def insert(self, record: JobRecord, images: SavedImages | None = None) -> JobRecord:
        """Stores a new job, with the input images `save_input_images` wrote for it; returns the job with `seq`
        (and `created_at` if unset) filled in. The images' file is deleted if the job cannot be stored."""
        check_name("job_id", record.job_id)
        record = replace(record, created_at=record.created_at or self.clock())
        try:
            return self._rows.insert(record, images)
        except BaseException:
            if images is not None:
                self.discard_saved_images(record.job_id, images)
            raise

    def get(self, job_id: str) -> JobRecord | None:
        return self._rows.get(job_id)

    def find_by_request_id(self, tenant: str, request_id: str) -> JobRecord | None:
        """The tenant's job with this client-chosen id (idempotent resubmission), if any."""
        return self._rows.find_by_request_id(tenant, request_id) if request_id else None

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
        """Moves a job to RUNNING (a claim: it sets started_at and counts an attempt), back to QUEUED, or to FAILED
        or CANCELLED (finished_at, the error and timings set, the intermediates deleted). SUCCEEDED goes through
        `commit_result`, so that a succeeded job always has its result. A finished job cannot change."""
        at = self.clock() if at is None else at
        assignments: dict[str, object]
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
        # Claimed again (a requeued job this replica runs once more) the claim is a new one: no fence.
        fence = None if state == JobState.JOB_STATE_RUNNING else self._claims.fence(job_id)
        record, files = self._rows.update_state(
            job_id, state, assignments, fence=fence, claim_for=(self.owner, self.lease_ttl_s)
        )
        if state == JobState.JOB_STATE_RUNNING:
            self._claims.record(job_id, record.lease_epoch)
        else:
            self._claims.forget(job_id)
        self.files.unlink(job_id, files)
        return record

    def claimed(self) -> dict[str, int]:
        """{job id: lease epoch} of the jobs this store claimed and still runs."""
        return self._claims.held()

    def renew_claims(self) -> set[str]:
        """Extends the lease of every job this store claimed; returns the ids whose lease was lost (another
        replica runs them now: stop them, record nothing). Blocking."""
        return self._claims.renew(self._leases)

    def queued_ids(self) -> list[str]:
        """The ids of every queued job, in admission order."""
        return self._rows.queued_ids()

    def requeue_expired(self) -> list[str]:
        """Moves every running job whose owner's lease ran out back to QUEUED (the leader's duty); returns
        their ids. Blocking."""
        return self._leases.requeue_expired()

    def forget_claim(self, job_id: str) -> None:
        """Stops fencing `job_id`'s writes with this store's claim, once nothing here writes it any more (its
        run here ended). A lost claim is kept until then: every write under it keeps failing."""
        self._claims.forget(job_id)

    def recoverable(self) -> list[JobRecord]:
        """Queued and running jobs in admission order: what a restarted orchestrator must finish."""
        return self._rows.recoverable()

    def list_jobs(
        self,
        *,
        states: Collection[int] | None = None,
        tenant: str | None = None,
        limit: int = 100,
        before_seq: int | None = None,
    ) -> list[JobRecord]:
        """Jobs newest first, optionally of some states or one tenant; `before_seq` pages on."""
        return self._rows.list_jobs(states=states, tenant=tenant, limit=limit, before_seq=before_seq)

    def finished_jobs(
        self, *, tenant: str | None = None, limit: int = 100, before_seq: int | None = None
    ) -> list[JobRecord]:
        """Succeeded, failed and cancelled jobs, newest first."""
        return self.list_jobs(states=TERMINAL_STATES, tenant=tenant, limit=limit, before_seq=before_seq)

    def tenants(self) -> list[str]:
        """Every tenant that has a stored job."""
        return self._rows.tenants()

    # -------------------------------------------------------- input images --

    def save_input_images(self, job_id: str, images: Iterable[image_pb2.InputImage]) -> SavedImages | None:
        """Writes a new job's input images (with their bytes) to its folder, before `insert` stores the job;
        None without images. Blocking: use to_thread."""
        return self.files.save_input_images(job_id, images)

    def discard_saved_images(self, job_id: str, images: SavedImages) -> None:
        """Deletes images saved for a job that was never stored (refused after they were written)."""
        self.files.discard_input_images(job_id, images)

    def load_input_images(self, job_id: str) -> list[image_pb2.InputImage]:
        """The job's input images with their bytes, as `insert` stored them; blocking. StoreError once dropped."""
        file = self._rows.input_images_file(job_id)
        if file is None:
            raise StoreError(f"job {job_id}: its input images are no longer stored")
        return self.files.load_input_images(job_id, file)

    def drop_input_images(self, job_id: str) -> None:
        """Deletes the job's input images once the stages that encode them are done; blocking."""
        file = self._rows.drop_input_images(job_id)
        if file is not None:
            self.files.unlink(job_id, [file])

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
        Returns False (and keeps nothing) if the job finished meanwhile, e.g. it was cancelled."""
        check_name("stage", stage)
        if self._rows.state(job_id) in TERMINAL_STATES:
            return False
        try:
            file, size = self.files.save_stage(job_id, stage, chunks, self._claims.epoch(job_id))
        except FileNotFoundError:
            if self._rows.finished_or_gone(job_id):  # deleted while writing
                return False
            raise StoreError(f"job {job_id}: its folder disappeared while stage {stage} was saved") from None
        kept = self._rows.keep_stage(job_id, stage, file, size, self.clock, passes, self._claims.fence(job_id))
        if not kept:
            self.files.unlink(job_id, [file])
        return kept

    def set_notices(self, job_id: str, notices: Iterable[stages_pb2.Notice]) -> bool:
        """Replaces a running job's notices; blocking. False (nothing changed) if it finished or was claimed again."""
        return self._rows.set_notices(job_id, notices, self._claims.fence(job_id))

    def count_preemption(self, job_id: str) -> bool:
        """Counts one preemption of a running job; blocking. False if it finished or was claimed again."""
        return self._rows.count_preemption(job_id, self._claims.fence(job_id))

    def load_intermediates(self, job_id: str) -> dict[str, list[tensor_pb2.TensorChunk]]:
        """{stage: the chunks it sent} of every saved stage, in the order they finished; blocking."""
        return {stage: self.files.load_stage(job_id, stage, file) for stage, file in self._rows.stage_files(job_id)}

    # ---------------------------------------------------------- retention --

    def collect_garbage(self, *, min_age_s: float = GARBAGE_MIN_AGE_S) -> int:
        """Deletes the blobs no row names that were written more than `min_age_s` ago (a crashed or fenced-out
        owner's, a job deleted while its blobs could not be); returns how many. Blocking, lists every blob.

        The age keeps what a live replica wrote just before committing the row that names it. Without a
        blob store, `open` sweeps the state directory instead.
        """
        if self.files.blobs is None:
            return 0
        _, referenced = self._rows.files_in_use()
        return self.files.collect_garbage(referenced, time.time() - min_age_s)

    def usage(self, tenant: str) -> Usage:
        """Bytes the tenant's jobs hold: results of its finished jobs, intermediates of its queued and running ones.

        A running job's result file counts once it is committed; the caller
        reserves what running jobs are still writing (`prune`'s `reserved_bytes`).
        """
        return retention.usage(self._db, tenant)

    def delete(self, job_id: str) -> bool:
        """Forgets a finished job and its files; False if unknown. Queued or running jobs are refused."""
        if not self._rows.delete(job_id):
            return False
        self.files.remove_job(job_id)
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

        The limits hold for each tenant on its own (with `tenant`, that tenant's jobs only), so one tenant's jobs
        never make room for another's. A tenant keeps its newest finished jobs while they number at most `max_kept`
        and its bytes (its queued and running jobs' files, `reserved_bytes` for what they will still write, then
        its results from the newest) stay within `max_bytes`; the rest go, oldest first, as do jobs that finished
        more than `max_age_s` ago. `reserved_bytes` needs `tenant`.
        """
        doomed = retention.prune_rows(
            self._db,
            self.clock,
            tenant=tenant,
            max_kept=max_kept,
            max_bytes=max_bytes,
            reserved_bytes=reserved_bytes,
            max_age_s=max_age_s,
        )
        for job_id in doomed:
            self.files.remove_job(job_id)
        return sorted(doomed)
