"""Which replica runs a job: claims under fenced leases, renewed by their owner, requeued when they expire.

A claim moves a queued job to RUNNING for one replica (`owner`), adds one to its `lease_epoch` and counts an
attempt; `FOR UPDATE SKIP LOCKED` lets two claimers pass each other without waiting or both winning. The
epoch fences: an owner's later writes name (owner, epoch), and once the job was requeued and claimed again
they change nothing (`holds` says so before a commit). Lease times are the database's clock, never a replica's.
An owner renews every lease it holds in one statement; the leader requeues expired ones, and the job resumes
from its last finished stage (attempts counted, so a crash loop still ends).
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass

from services.orchestrator.store.database import JobDatabase
from services.orchestrator.store.records import JobState
from services.orchestrator.store.rows import Fence

# Leases renewed in one statement at most; an owner with more renews them in several.
RENEW_BATCH = 500


@dataclass(frozen=True)
class Claim:
    """A job this replica runs, and the epoch that fences its writes."""

    job_id: str
    epoch: int


class JobLeases:
    """Claims and leases of jobs in either job database (SQLite: the one process owns every job it claims)."""

    def __init__(self, database: JobDatabase, owner: str, ttl_s: float = 30.0) -> None:
        if not owner:
            raise ValueError("owner: give the replica's id")
        self.database = database
        self.owner = owner
        self.ttl_s = ttl_s

    def claim(self, job_id: str) -> Claim | None:
        """Takes the queued job `job_id`; None if it is not queued or another claimer holds its row now."""
        now, skip_locked = self.database.now_sql, self.database.skip_locked
        with self.database.transaction() as db:
            row = db.execute(
                f"UPDATE jobs SET state = ?, owner = ?, lease_epoch = lease_epoch + 1, lease_until = {now} + ?,"
                " attempts = attempts + 1"
                f" WHERE seq = (SELECT seq FROM jobs WHERE job_id = ? AND state = ?{skip_locked})"
                " RETURNING lease_epoch",
                (int(JobState.JOB_STATE_RUNNING), self.owner, self.ttl_s, job_id, int(JobState.JOB_STATE_QUEUED)),
            ).fetchone()
        return None if row is None else Claim(job_id, int(row[0]))

    def renew(self, claims: Collection[Claim]) -> set[str]:
        """Extends the leases of `claims` still held; returns the job ids whose lease was lost (stop them)."""
        held: set[str] = set()
        listed = list(claims)
        for start in range(0, len(listed), RENEW_BATCH):
            batch = listed[start : start + RENEW_BATCH]
            pairs = ", ".join("(?, ?)" for _ in batch)
            values = [value for claim in batch for value in (claim.job_id, claim.epoch)]
            with self.database.transaction() as db:
                rows = db.execute(
                    f"UPDATE jobs SET lease_until = {self.database.now_sql} + ?"
                    f" WHERE owner = ? AND state = ? AND (job_id, lease_epoch) IN (VALUES {pairs}) RETURNING job_id",
                    (self.ttl_s, self.owner, int(JobState.JOB_STATE_RUNNING), *values),
                ).fetchall()
            held |= {row[0] for row in rows}
        return {claim.job_id for claim in listed} - held

    def holds(self, claim: Claim) -> bool:
        """Whether `claim` is still this replica's lease (checked in the transaction of a fenced write)."""
        with self.database.transaction() as db:
            row = db.execute(
                "SELECT 1 FROM jobs WHERE job_id = ? AND owner = ? AND lease_epoch = ? AND state = ?",
                (claim.job_id, self.owner, claim.epoch, int(JobState.JOB_STATE_RUNNING)),
            ).fetchone()
        return row is not None

    def requeue_expired(self) -> list[str]:
        """Moves every running job whose lease ran out back to QUEUED (the leader's duty); returns their ids."""
        with self.database.transaction() as db:
            rows = db.execute(
                f"UPDATE jobs SET state = ?, owner = '' WHERE state = ? AND lease_until < {self.database.now_sql}"
                " RETURNING job_id",
                (int(JobState.JOB_STATE_QUEUED), int(JobState.JOB_STATE_RUNNING)),
            ).fetchall()
        return [row[0] for row in rows]


class HeldClaims:
    """The claims this replica made and still runs, {job id: epoch}: what fences its writes of each job.

    A claim is recorded when this replica moves the job to RUNNING, and forgotten when its run here ends. A
    claim lost meanwhile (another replica claimed the job again) is kept until then, so that every write
    under it keeps failing. Every method may be called from any thread.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._epochs: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, job_id: str, epoch: int) -> None:
        with self._lock:
            self._epochs[job_id] = epoch

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._epochs.pop(job_id, None)

    def fence(self, job_id: str) -> Fence | None:
        """The claim this replica's writes of `job_id` are made under; None for a job it did not claim."""
        with self._lock:
            epoch = self._epochs.get(job_id)
        return None if epoch is None else Fence(self.owner, epoch)

    def epoch(self, job_id: str) -> int:
        """The epoch of this replica's claim of `job_id` (0 without one): what tags the job's blob keys."""
        with self._lock:
            return self._epochs.get(job_id, 0)

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._epochs)

    def renew(self, leases: JobLeases) -> set[str]:
        """Extends the lease of every claim held; returns the ids whose lease was lost (stop them, record
        nothing), which stay fenced until their run here ends."""
        claims = [Claim(job_id, epoch) for job_id, epoch in self.held().items()]
        return leases.renew(claims) if claims else set()
