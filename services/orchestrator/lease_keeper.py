"""Keeping job leases: every replica renews the leases of the jobs it runs, and the leader takes back the jobs
whose owner stopped renewing.

Every `interval_s` (a third of the job lease), in one statement per few hundred jobs, the replica extends the
leases it holds (store/leases.py). A lease it finds lost (another replica requeued and perhaps claimed the
job: this replica was paused, cut off or too slow) stops that job here without recording anything; the
fenced store would refuse its writes anyway. The leader then moves every running job whose lease ran out
back to the queue, on the database's clock, and queues it here from its last finished stage.
"""

from __future__ import annotations

import asyncio
import logging

from services.orchestrator.jobs import JobManager

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews this replica's job leases and, while it leads, takes back expired ones."""

    def __init__(self, jobs: JobManager, interval_s: float) -> None:
        self.jobs = jobs
        self.interval_s = interval_s

    async def run(self) -> None:
        """Until cancelled; a round that fails (the database is unreachable) is logged and tried again."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.round()
            except Exception as error:
                logger.warning("keeping job leases failed: %s", error)

    async def round(self) -> None:
        store = self.jobs.store
        for job_id in await asyncio.to_thread(store.renew_claims):
            logger.warning("job %s: its lease was lost to another replica; stopping it here", job_id)
            await self.jobs.lose(job_id)
        if self.jobs.leading:
            expired = await asyncio.to_thread(store.requeue_expired)
            if expired:
                logger.info("requeued %d job(s) whose owner's lease expired: %s", len(expired), ", ".join(expired))
            await self.jobs.adopt_queued()
