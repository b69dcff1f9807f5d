"""Retention: what each tenant keeps of its finished jobs, and what stays in memory.

Retention belongs to tenants. Each tenant keeps at most `max_kept_jobs` finished
jobs and `max_stored_bytes` of files (its quotas in the tenants file, else the
orchestrator's defaults; `StorageLimits.limits`), and no finished job older than
`retention_s`; pruning runs tenant by tenant whenever a job finishes, after each
admission (room for the new job's reserved result) and at start-up, so one
tenant's jobs never push out another's (the age limit, for every tenant at
once, at most once a minute). At most `MAX_FINISHED_IN_MEMORY`
finished jobs stay in memory; the store answers for the others.
"""

from __future__ import annotations

import asyncio
import logging

from services.orchestrator.admission import StorageLimits
from services.orchestrator.job import JobTable
from services.orchestrator.store import JobStore, StoreError

logger = logging.getLogger(__name__)

# Finished jobs kept in memory (their logs hold no frames); older ones are answered from the store.
MAX_FINISHED_IN_MEMORY = 64
# The age limit is applied to every tenant at most this often: an hour's or a day's retention needs no more.
AGE_PRUNE_INTERVAL_S = 60.0


class Pruner:
    """Deletes the finished jobs a tenant may no longer keep, and forgets old finished jobs in memory."""

    def __init__(self, store: JobStore, limits: StorageLimits, table: JobTable, retention_s: float | None) -> None:
        self.store = store
        self.limits = limits
        self.table = table
        # The age limit of finished jobs, for every tenant (None: no age limit), and when it was last applied.
        self.retention_s = retention_s
        self._aged_at: float | None = None

    async def prune_tenant(self, tenant: str) -> None:
        """Keeps the tenant within its kept-jobs and stored-bytes limits, every tenant within the age limit,
        and in memory only the latest finished jobs. A store error is logged: pruning waits for the next job."""
        max_kept, max_bytes = self.limits.limits(tenant)
        try:
            removed = await asyncio.to_thread(
                self.store.prune,
                tenant=tenant,
                max_kept=max_kept,
                max_bytes=max_bytes,
                reserved_bytes=self.limits.reserved_bytes(tenant),
            )
            now = self.store.clock()
            if self.retention_s is not None and (self._aged_at is None or now - self._aged_at >= AGE_PRUNE_INTERVAL_S):
                self._aged_at = now
                removed += await asyncio.to_thread(self.store.prune, max_age_s=self.retention_s)
        except StoreError as error:
            logger.error("pruning finished jobs failed: %s", error)
            removed = []
        for job_id in removed:
            self.table.forget(job_id)
        finished = [job_id for job_id, job in self.table.jobs.items() if job.finished]
        for job_id in finished[: max(0, len(finished) - MAX_FINISHED_IN_MEMORY)]:
            self.table.forget(job_id)
