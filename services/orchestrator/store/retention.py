"""Space: the bytes each tenant's jobs hold, and which finished jobs go when a tenant is over its limits.

Every file's size is recorded with the row that names it, so both answers come from the database alone.
The limits hold for each tenant on its own: one tenant's jobs are never deleted to make room for another's,
and queued or running jobs are never pruned. `prune_rows` deletes rows only, in one statement that answers
with the deleted ids alone (however many finished jobs a tenant keeps); the caller deletes the jobs' folders
once it returns.
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
    """Deletes the rows of finished jobs beyond the limits (see `JobStore.prune`); returns their ids.

    One statement, which answers with the deleted ids alone: a tenant's finished jobs are ranked newest first,
    each with the bytes of its results and every newer one's, and a job goes when its rank passes `max_kept`,
    when those bytes (with the tenant's queued and running jobs' intermediates and `reserved_bytes`) pass
    `max_bytes`, or when it is older than `max_age_s`. Both running counts only grow down the ranking, so once a
    tenant is over a limit every older job goes too.
    """
    if reserved_bytes and tenant is None:
        raise ValueError("reserved_bytes: give the tenant it is reserved for")
    terminal = tuple(int(s) for s in TERMINAL_STATES)
    only = " AND jobs.tenant = ?" if tenant is not None else ""
    scope: tuple[Any, ...] = (tenant,) if tenant is not None else ()
    cutoff = None if max_age_s is None else clock() - max_age_s
    if max_kept is None and max_bytes is None:  # age alone: no ranking needed
        if cutoff is None:
            return []
        rows = database.fetchall(
            f"DELETE FROM jobs WHERE state IN (?, ?, ?){only} AND COALESCE(finished_at, 0) < ? RETURNING job_id",
            (*terminal, *scope, cutoff),
        )
        return [row["job_id"] for row in rows]
    conditions: list[str] = []
    params: list[Any] = []
    if max_kept is not None:
        conditions.append("finished.position > ?")
        params.append(max_kept)
    if max_bytes is not None:
        conditions.append("COALESCE(active.bytes, 0) + ? + finished.newer_bytes > ?")
        params.extend((reserved_bytes, max_bytes))
    if cutoff is not None:
        conditions.append("COALESCE(finished.finished_at, 0) < ?")
        params.append(cutoff)
    rows = database.fetchall(
        "DELETE FROM jobs WHERE job_id IN (SELECT finished.job_id FROM ("
        " SELECT jobs.job_id, jobs.tenant, jobs.finished_at, ROW_NUMBER() OVER newest AS position,"
        " SUM(COALESCE(results.bytes, 0)) OVER newest AS newer_bytes"
        f" FROM jobs LEFT JOIN results USING (job_id) WHERE jobs.state IN (?, ?, ?){only}"
        " WINDOW newest AS (PARTITION BY jobs.tenant ORDER BY jobs.finished_at DESC, jobs.seq DESC"
        " ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)) AS finished"
        " LEFT JOIN (SELECT jobs.tenant, SUM(intermediates.bytes) AS bytes FROM intermediates JOIN jobs USING (job_id)"
        f" WHERE jobs.state NOT IN (?, ?, ?){only} GROUP BY jobs.tenant) AS active USING (tenant)"
        f" WHERE {' OR '.join(conditions)}) RETURNING job_id",
        (*terminal, *scope, *terminal, *scope, *params),
    )
    return [row["job_id"] for row in rows]
