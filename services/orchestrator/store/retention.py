"""Space: the bytes each tenant's jobs hold, and which finished jobs go when a tenant is over its limits.

Every file's size is recorded with the row that names it, so both answers come from the database alone.
The limits hold for each tenant on its own: one tenant's jobs are never deleted to make room for another's,
and queued or running jobs are never pruned. `prune_rows` deletes rows only; the caller deletes the jobs'
folders once it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.orchestrator.store.database import JobDatabase
from services.orchestrator.store.records import TERMINAL_STATES, Usage


def usage(database: JobDatabase, tenant: str) -> Usage:
    """Bytes the tenant's jobs hold: results of its finished jobs, intermediates of its queued and running ones."""
    row = database.fetchone(
        "SELECT"
        " (SELECT COALESCE(SUM(r.bytes), 0) FROM results r JOIN jobs j USING (job_id) WHERE j.tenant = ?)"
        " AS finished,"
        " (SELECT COALESCE(SUM(i.bytes), 0) FROM intermediates i JOIN jobs j USING (job_id) WHERE j.tenant = ?)"
        " AS active",
        (tenant, tenant),
    )
    assert row is not None  # an aggregate always answers one row
    return Usage(finished=row["finished"], active=row["active"])


def prune_rows(
    database: JobDatabase,
    clock: Callable[[], float],
    *,
    tenant: str | None,
    max_kept: int | None,
    max_bytes: int | None,
    reserved_bytes: int,
    max_age_s: float | None,
) -> list[str]:
    """Deletes the rows of finished jobs beyond the limits (see `JobStore.prune`); returns their ids."""
    if reserved_bytes and tenant is None:
        raise ValueError("reserved_bytes: give the tenant it is reserved for")
    terminal = tuple(int(s) for s in TERMINAL_STATES)
    only = " AND jobs.tenant = ?" if tenant is not None else ""
    scope: tuple[Any, ...] = (tenant,) if tenant is not None else ()
    cutoff = None if max_age_s is None else clock() - max_age_s
    if max_kept is None and max_bytes is None:  # age alone: only the expired jobs need looking at
        if cutoff is None:
            return []
        only += " AND jobs.finished_at < ?"
        scope = (*scope, cutoff)
    doomed: list[str] = []
    with database.transaction() as db:
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
    return doomed
