"""The job database's rows: what each store operation reads and changes in the jobs, intermediates and results
tables, each write in one transaction.

This module touches no file: a row names a file by (job_id, file name), and operations that drop rows
return the names of the files that the caller deletes once the transaction is committed. States move only
as `update_state` and `commit_result` allow; a finished job's row never changes again.

Fencing. Moving a job to RUNNING claims it for one replica (`owner`) and adds one to its `lease_epoch`, as
leases.py's claim does. A write that passes `fence=Fence(owner, epoch)` changes the job only while that
claim still holds, checked on the row locked in the write's own transaction; otherwise it raises LeaseLost
(or, for a stage output, keeps nothing), so a replica that lost its job can never commit over the new owner.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from services.orchestrator import notices as job_notices
from services.orchestrator.store.database import JobDatabase
from services.orchestrator.store.postgres import UniqueViolation
from services.orchestrator.store.records import (
    ACTIVE_STATES,
    INPUT_IMAGES,
    TERMINAL_STATES,
    JobRecord,
    JobState,
    SavedImages,
    record_from_row,
)
from services.orchestrator.store_errors import DuplicateRequestId, InvalidTransition, LeaseLost, StoreError, UnknownJob
from stagediff.v1 import stages_pb2


@dataclass(frozen=True)
class Fence:
    """The claim a write is made under: the job's owner and its lease epoch when this replica claimed it."""

    owner: str
    epoch: int


class JobRows:
    """The rows of every job in one SQLite database."""

    def __init__(self, database: JobDatabase) -> None:
        self.database = database

    # ------------------------------------------------------------ records --

    def insert(self, record: JobRecord, images: SavedImages | None) -> JobRecord:
        """Stores a new job (and the row of its input images); returns it with `seq` filled in."""
        with self.database.transaction() as db:
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
                    " last_stage, attempts, notices) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " RETURNING seq",
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
                        job_notices.to_json(record.notices),
                    ),
                )
                seq = int(cursor.fetchone()[0])
            except (sqlite3.IntegrityError, UniqueViolation):
                raise StoreError(f"job_id '{record.job_id}' is already stored") from None
            if images is not None:
                db.execute(
                    "INSERT INTO intermediates (job_id, stage, file, done_at, bytes) VALUES (?, ?, ?, ?, ?)",
                    (record.job_id, INPUT_IMAGES, images.file, record.created_at, images.size),
                )
            return replace(record, seq=seq)

    def get(self, job_id: str) -> JobRecord | None:
        row = self.database.fetchone("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
        return record_from_row(row) if row is not None else None

    def find_by_request_id(self, tenant: str, request_id: str) -> JobRecord | None:
        row = self.database.fetchone("SELECT * FROM jobs WHERE tenant = ? AND request_id = ?", (tenant, request_id))
        return record_from_row(row) if row is not None else None

    def update_state(
        self,
        job_id: str,
        state: int,
        assignments: dict[str, Any],
        *,
        fence: Fence | None = None,
        claim_for: tuple[str, float] | None = None,
    ) -> tuple[JobRecord, list[str]]:
        """Moves the job to `state` (not SUCCEEDED) setting `assignments` {column: value}, if its state (and
        `fence`) allow; returns the job and, once it is finished, the files of the intermediates it no longer has.

        RUNNING is a claim: `claim_for` (owner, lease seconds) becomes the job's owner, with its epoch + 1.
        A move to RUNNING or QUEUED is one conditional statement; only a refused one (to say why) and a finish
        (whose intermediates go in the same transaction) take a transaction that locks the row first.
        """
        allowed_from: dict[int, tuple[int, ...]] = {
            JobState.JOB_STATE_RUNNING: (JobState.JOB_STATE_QUEUED,),
            JobState.JOB_STATE_QUEUED: (JobState.JOB_STATE_RUNNING,),
        }
        allowed = tuple(int(s) for s in allowed_from.get(state, ACTIVE_STATES))
        columns = ", ".join(f"{name} = ?" for name in assignments)
        params: list[Any] = [int(state), *assignments.values()]
        if state == JobState.JOB_STATE_RUNNING:
            owner, ttl_s = claim_for or ("", 0.0)
            columns += ", attempts = attempts + 1, owner = ?, lease_epoch = lease_epoch + 1,"
            columns += f" lease_until = {self.database.now_sql} + ?"
            params += [owner, ttl_s]
        elif state == JobState.JOB_STATE_QUEUED:
            columns += ", owner = ''"
        update = f"UPDATE jobs SET state = ?, {columns} WHERE job_id = ?"
        if state not in TERMINAL_STATES:
            fenced = " AND owner = ? AND lease_epoch = ?" if fence is not None else ""
            row = self.database.fetchone(
                f"{update} AND state IN ({', '.join('?' * len(allowed))}){fenced} RETURNING *",
                (*params, job_id, *allowed, *((fence.owner, fence.epoch) if fence is not None else ())),
            )
            if row is not None:
                return record_from_row(row), []
        with self.database.transaction() as db:
            current = self._locked_state(db, job_id, fence)
            if current not in allowed:
                raise InvalidTransition(
                    f"job {job_id} is {JobState.Name(current)}; it cannot become {JobState.Name(state)}"
                )
            row = db.execute(f"{update} RETURNING *", (*params, job_id))
            record = record_from_row(row.fetchone())
            files = self._drop_intermediates(db, job_id) if state in TERMINAL_STATES else []
        return record, files

    def list_jobs(
        self, *, states: Collection[int] | None, tenant: str | None, limit: int, before_seq: int | None
    ) -> list[JobRecord]:
        where: list[str] = []
        params: list[Any] = []
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
        rows = self.database.fetchall(f"SELECT * FROM jobs {clause} ORDER BY seq DESC LIMIT ?", (*params, limit))
        return [record_from_row(row) for row in rows]

    def recoverable(self) -> list[JobRecord]:
        rows = self.database.fetchall(
            "SELECT * FROM jobs WHERE state IN (?, ?) ORDER BY seq", tuple(int(s) for s in ACTIVE_STATES)
        )
        return [record_from_row(row) for row in rows]

    def queued_ids(self) -> list[str]:
        rows = self.database.fetchall(
            "SELECT job_id FROM jobs WHERE state = ? ORDER BY seq", (int(JobState.JOB_STATE_QUEUED),)
        )
        return [row["job_id"] for row in rows]

    def tenants(self) -> list[str]:
        return [row["tenant"] for row in self.database.fetchall("SELECT DISTINCT tenant FROM jobs ORDER BY tenant", ())]

    def delete(self, job_id: str) -> bool:
        """Deletes a finished job's rows; False if unknown, InvalidTransition if it is queued or running."""
        with self.database.transaction() as db:
            row = db.execute("SELECT state FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                return False
            if row["state"] not in TERMINAL_STATES:
                raise InvalidTransition(f"job {job_id} is {JobState.Name(row['state'])}; finish it before deleting")
            db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
        return True

    # ------------------------------------------------------ intermediates --

    def input_images_file(self, job_id: str) -> str | None:
        row = self.database.fetchone(
            "SELECT file FROM intermediates WHERE job_id = ? AND stage = ?", (job_id, INPUT_IMAGES)
        )
        return None if row is None else row["file"]

    def drop_input_images(self, job_id: str) -> str | None:
        """Deletes the row of the job's input images; returns their file, if it had one."""
        with self.database.transaction() as db:
            row = db.execute(
                "SELECT file FROM intermediates WHERE job_id = ? AND stage = ?", (job_id, INPUT_IMAGES)
            ).fetchone()
            db.execute("DELETE FROM intermediates WHERE job_id = ? AND stage = ?", (job_id, INPUT_IMAGES))
        return None if row is None else row["file"]

    def keep_stage(
        self,
        job_id: str,
        stage: str,
        file: str,
        size: int,
        clock: Callable[[], float],
        passes: tuple[int, int] | None,
        fence: Fence | None = None,
    ) -> bool:
        """Records a finished stage's output file (and the DiT's passes) unless the job finished meanwhile
        or `fence` no longer holds."""
        with self.database.transaction() as db:
            try:
                if self._locked_state(db, job_id, fence) in TERMINAL_STATES:
                    return False
            except LeaseLost:
                return False
            db.execute(
                "INSERT INTO intermediates (job_id, stage, file, done_at, bytes, position) VALUES (?, ?, ?, ?, ?,"
                " (SELECT COALESCE(MAX(position), 0) + 1 FROM intermediates WHERE job_id = ?))"
                " ON CONFLICT (job_id, stage) DO UPDATE SET file = excluded.file, done_at = excluded.done_at,"
                " bytes = excluded.bytes, position = excluded.position",
                (job_id, stage, file, clock(), size, job_id),
            )
            if passes is None:
                db.execute("UPDATE jobs SET last_stage = ? WHERE job_id = ?", (stage, job_id))
            else:
                db.execute(
                    "UPDATE jobs SET last_stage = ?, passes_run = ?, passes_skipped = ? WHERE job_id = ?",
                    (stage, *passes, job_id),
                )
            return True

    def set_notices(self, job_id: str, notices: Iterable[stages_pb2.Notice], fence: Fence | None = None) -> bool:
        """Replaces the job's notices (services/orchestrator/notices.py) unless the job finished meanwhile or
        `fence` no longer holds; returns whether they were written."""
        with self.database.transaction() as db:
            try:
                if self._locked_state(db, job_id, fence) in TERMINAL_STATES:
                    return False
            except LeaseLost:
                return False
            db.execute("UPDATE jobs SET notices = ? WHERE job_id = ?", (job_notices.to_json(notices), job_id))
            return True

    def count_preemption(self, job_id: str, fence: Fence | None = None) -> bool:
        """Adds one to the job's preemptions unless it finished meanwhile or `fence` no longer holds."""
        with self.database.transaction() as db:
            try:
                if self._locked_state(db, job_id, fence) in TERMINAL_STATES:
                    return False
            except LeaseLost:
                return False
            db.execute("UPDATE jobs SET preemptions = preemptions + 1 WHERE job_id = ?", (job_id,))
            return True

    def stage_files(self, job_id: str) -> list[tuple[str, str]]:
        """(stage, file) of every saved stage output, in the order the stages finished."""
        rows = self.database.fetchall(
            "SELECT stage, file FROM intermediates WHERE job_id = ? AND stage != ? ORDER BY done_at, position",
            (job_id, INPUT_IMAGES),
        )
        return [(row["stage"], row["file"]) for row in rows]

    def _drop_intermediates(self, db: sqlite3.Connection, job_id: str) -> list[str]:
        """Deletes the rows in this transaction; the caller deletes the returned files after commit."""
        rows = db.execute("DELETE FROM intermediates WHERE job_id = ? RETURNING file", (job_id,)).fetchall()
        return [row["file"] for row in rows]

    # ------------------------------------------------------------ results --

    def commit_result(
        self,
        job_id: str,
        *,
        file: str,
        shape: tuple[int, ...],
        fps: float,
        pieces: list[tuple[int, int]],
        at: float,
        nbytes: int,
        media_type: str,
        encoded_file: str | None,
        encoded_bytes: int,
        raw_kept: bool,
        timings: Mapping[str, float] | None,
        passes: tuple[int, int] | None = None,
        fence: Fence | None = None,
        audio: tuple[str, tuple[int, int], int] | None = None,
    ) -> tuple[JobRecord, list[str]]:
        """Records a running job's result and marks it SUCCEEDED; returns the job and the files of the
        intermediates it no longer has. InvalidTransition (keeping nothing) if the job is not running,
        LeaseLost if `fence` no longer holds. `audio`: the sound's (file, [channels, samples], rate), if kept."""
        audio_file, audio_shape, audio_rate = audio if audio is not None else (None, (), 0)
        with self.database.transaction() as db:
            _require(job_id, self._locked_state(db, job_id, fence), (JobState.JOB_STATE_RUNNING,))
            db.execute(
                "INSERT INTO results (job_id, file, shape, fps, pieces, saved_at, bytes, media_type, encoded_file,"
                " encoded_bytes, raw_kept, audio_file, audio_shape, audio_rate)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id) DO UPDATE SET"
                " file = excluded.file, shape = excluded.shape, fps = excluded.fps, pieces = excluded.pieces,"
                " saved_at = excluded.saved_at, bytes = excluded.bytes, media_type = excluded.media_type,"
                " encoded_file = excluded.encoded_file, encoded_bytes = excluded.encoded_bytes,"
                " raw_kept = excluded.raw_kept, audio_file = excluded.audio_file,"
                " audio_shape = excluded.audio_shape, audio_rate = excluded.audio_rate",
                (
                    job_id,
                    file,
                    json.dumps(list(shape)),
                    fps,
                    json.dumps(pieces),
                    at,
                    nbytes,
                    media_type,
                    encoded_file,
                    encoded_bytes,
                    int(raw_kept),
                    audio_file,
                    json.dumps(list(audio_shape)),
                    audio_rate,
                ),
            )
            updates = "state = ?, finished_at = ?, num_frames_out = ?, fps_out = ?, error_code = NULL"
            params: list[Any] = [int(JobState.JOB_STATE_SUCCEEDED), at, int(shape[0]), fps]
            if timings is not None:
                updates += ", timings = ?"
                params.append(json.dumps(dict(timings)))
            if passes is not None:
                updates += ", passes_run = ?, passes_skipped = ?"
                params.extend(passes)
            row = db.execute(f"UPDATE jobs SET {updates} WHERE job_id = ? RETURNING *", (*params, job_id))
            record = record_from_row(row.fetchone())
            files = self._drop_intermediates(db, job_id)
        return record, files

    def result(self, job_id: str) -> Any:
        """The job's results row (by column name), with its job's timings, pass counts and notices; None without
        one."""
        return self.database.fetchone(
            "SELECT results.*, jobs.timings, jobs.passes_run, jobs.passes_skipped, jobs.notices FROM results"
            " JOIN jobs USING (job_id) WHERE job_id = ?",
            (job_id,),
        )

    # ------------------------------------------------------------- states --

    def state(self, job_id: str) -> int:
        row = self.database.fetchone("SELECT state FROM jobs WHERE job_id = ?", (job_id,))
        if row is None:
            raise UnknownJob(job_id)
        state: int = row["state"]
        return state

    def finished_or_gone(self, job_id: str) -> bool:
        try:
            return self.state(job_id) in TERMINAL_STATES
        except UnknownJob:
            return True

    def require_state(self, job_id: str, states: tuple[int, ...], fence: Fence | None = None) -> None:
        """InvalidTransition unless the job is in one of `states` now; LeaseLost if `fence` does not hold."""
        row = self.database.fetchone("SELECT state, owner, lease_epoch FROM jobs WHERE job_id = ?", (job_id,))
        _require(job_id, _fenced_state(job_id, row, fence), states)

    def _locked_state(self, db: Any, job_id: str, fence: Fence | None) -> int:
        """The job's state, its row locked for the rest of the transaction; LeaseLost if `fence` does not hold."""
        row = db.execute(
            f"SELECT state, owner, lease_epoch FROM jobs WHERE job_id = ?{self.database.for_update}", (job_id,)
        ).fetchone()
        return _fenced_state(job_id, row, fence)

    # --------------------------------------------------------------- sweep --

    def files_in_use(self) -> tuple[set[str], set[tuple[str, str]]]:
        """Every stored job id, and the (job_id, file) of every file a row names.

        Runs at open, whose caller reports sqlite3.Error itself.
        """
        with self.database.mutex:
            db = self.database.connection()
            known = {row["job_id"] for row in db.execute("SELECT job_id FROM jobs")}
            referenced = {
                (row["job_id"], row["file"])
                for row in db.execute(
                    "SELECT job_id, file FROM intermediates UNION ALL SELECT job_id, file FROM results"
                    " UNION ALL SELECT job_id, encoded_file FROM results WHERE encoded_file IS NOT NULL"
                    " UNION ALL SELECT job_id, audio_file FROM results WHERE audio_file IS NOT NULL"
                )
            }
        return known, referenced


def _fenced_state(job_id: str, row: Any, fence: Fence | None) -> int:
    """The state of the job `row` (state, owner, lease_epoch); UnknownJob without a row, LeaseLost if `fence`
    does not hold while the job is unfinished."""
    if row is None:
        raise UnknownJob(job_id)
    lost = fence is not None and (row["owner"], row["lease_epoch"]) != (fence.owner, fence.epoch)
    if fence is not None and lost and row["state"] not in TERMINAL_STATES:
        raise LeaseLost(
            f"job {job_id} lost the lease of epoch {fence.epoch} (now epoch {row['lease_epoch']},"
            f" owner '{row['owner']}'); this replica's writes of it change nothing"
        )
    state: int = row["state"]
    return state


def _require(job_id: str, current: int, states: tuple[int, ...]) -> None:
    if current not in states:
        wanted = " or ".join(JobState.Name(s) for s in states)
        raise InvalidTransition(f"job {job_id} is {JobState.Name(current)}, not {wanted}")
