"""Which replica runs a job: claims under fenced leases, renewed by their owner, requeued when they expire.

A claim moves a queued job to RUNNING for one replica (`owner`), adds one to its `lease_epoch` and counts an
attempt; `FOR UPDATE SKIP LOCKED` lets two claimers pass each other without waiting or both winning. The
epoch fences: an owner's later writes name (owner, epoch), and once the job was requeued and claimed again
they change nothing (`holds` says so before a commit). Lease times are the database's clock, never a replica's.
An owner renews every lease it holds in one statement; the leader requeues expired ones, and the job resumes
from its last finished stage (attempts counted, so a crash loop still ends).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from services.orchestrator.store.postgres import PostgresDatabase
from services.orchestrator.store.records import JobState

NOW = "EXTRACT(EPOCH FROM clock_timestamp())"


@dataclass(frozen=True)
class Claim:
    """A job this replica runs, and the epoch that fences its writes."""

    job_id: str
    epoch: int


class JobLeases:
    """Claims and leases of jobs in the PostgreSQL job database."""

    def __init__(self, database: PostgresDatabase, owner: str, ttl_s: float = 30.0) -> None:
        if not owner:
            raise ValueError("owner: give the replica's id")
        self.database = database
        self.owner = owner
        self.ttl_s = ttl_s

    def claim(self, job_id: str) -> Claim | None:
        """Takes the queued job `job_id`; None if it is not queued or another claimer holds its row now."""
        with self.database.transaction() as db:
            row = db.execute(
                f"UPDATE jobs SET state = ?, owner = ?, lease_epoch = lease_epoch + 1, lease_until = {NOW} + ?,"
                " attempts = attempts + 1"
                " WHERE seq = (SELECT seq FROM jobs WHERE job_id = ? AND state = ? FOR UPDATE SKIP LOCKED)"
                " RETURNING lease_epoch",
                (int(JobState.JOB_STATE_RUNNING), self.owner, self.ttl_s, job_id, int(JobState.JOB_STATE_QUEUED)),
            ).fetchone()
        return None if row is None else Claim(job_id, int(row[0]))

    def renew(self, claims: Collection[Claim]) -> set[str]:
        """Extends the leases of `claims` still held; returns the job ids whose lease was lost (stop them)."""
        if not claims:
            return set()
        ids = [claim.job_id for claim in claims]
        epochs = [claim.epoch for claim in claims]
        with self.database.transaction() as db:
            rows = db.execute(
                f"UPDATE jobs SET lease_until = {NOW} + ? FROM unnest(?::text[], ?::bigint[]) AS held(id, epoch)"
                " WHERE jobs.job_id = held.id AND jobs.lease_epoch = held.epoch AND jobs.owner = ?"
                " AND jobs.state = ? RETURNING jobs.job_id",
                (self.ttl_s, ids, epochs, self.owner, int(JobState.JOB_STATE_RUNNING)),
            ).fetchall()
        return set(ids) - {row[0] for row in rows}

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
                f"UPDATE jobs SET state = ?, owner = '' WHERE state = ? AND lease_until < {NOW} RETURNING job_id",
                (int(JobState.JOB_STATE_QUEUED), int(JobState.JOB_STATE_RUNNING)),
            ).fetchall()
        return [row[0] for row in rows]
