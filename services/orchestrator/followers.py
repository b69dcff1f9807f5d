"""The streams that follow jobs: how many follow each job and replay for each tenant, and what becomes of a
job whose Generate stream was lost.

A Generate stream that ends before its job is either a lost connection (a load
balancer's reset, a client's network) or a client that stopped listening; the
server cannot tell them apart. A job whose request has a request id can be
attached to again (the SDK retries Generate with the same id), so `detach`
keeps it running for a grace period and cancels it only if no stream follows it
when the period ends. An explicit CancelJob (which the SDK sends when its caller
stops) cancels at once, as before.

Replays (WatchJob, and a Generate retry that attaches to a job already there)
read a whole result from disk; each tenant may hold at most its
`max_watch_streams` of them open at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import grpc

from services.orchestrator.job import Job
from services.orchestrator.jobs import JobManager
from services.orchestrator.tenants import Tenant


class TooManyWatchers(Exception):
    """The tenant already holds its `max_watch_streams` replays (RESOURCE_EXHAUSTED, retry later)."""


class JobFollowers:
    def __init__(self, jobs: JobManager, detach_grace_s: float) -> None:
        self.jobs = jobs
        self.detach_grace_s = detach_grace_s
        self._by_job: dict[str, int] = {}  # job id -> streams following it now
        self._replays: dict[str, int] = {}  # tenant name -> replay streams open now
        self._pending: dict[str, asyncio.Task] = {}  # job id -> its grace-period check

    @contextlib.contextmanager
    def following(self, job: Job) -> Iterator[None]:
        """Counts a stream that follows `job` while the block runs."""
        self._by_job[job.job_id] = self._by_job.get(job.job_id, 0) + 1
        try:
            yield
        finally:
            self._by_job[job.job_id] -= 1
            if self._by_job[job.job_id] == 0:
                del self._by_job[job.job_id]

    def replaying(self, tenant: Tenant) -> contextlib.AbstractContextManager[None]:
        """Counts a replay stream of `tenant`; raises TooManyWatchers at its `max_watch_streams`."""
        limit = tenant.quotas.max_watch_streams
        if limit is not None and self._replays.get(tenant.name, 0) >= limit:
            raise TooManyWatchers(
                f"tenant '{tenant.name}' has {limit} streams watching jobs, its max_watch_streams; "
                "close one or retry later"
            )
        self._replays[tenant.name] = self._replays.get(tenant.name, 0) + 1
        return self._release_replay(tenant.name)

    @contextlib.contextmanager
    def _release_replay(self, tenant: str) -> Iterator[None]:
        try:
            yield
        finally:
            self._replays[tenant] -= 1

    def detach(self, job: Job) -> None:
        """Cancels `job` unless a stream follows it again within the grace period; a later loss restarts it."""

        async def check() -> None:
            await asyncio.sleep(self.detach_grace_s)
            self._pending.pop(job.job_id, None)
            if not job.finished and job.job_id not in self._by_job:
                await self.jobs.cancel(
                    job,
                    grpc.StatusCode.CANCELLED,
                    f"the client disconnected and did not attach again within {self.detach_grace_s:g} s",
                )

        previous = self._pending.pop(job.job_id, None)
        if previous is not None:
            previous.cancel()
        self._pending[job.job_id] = asyncio.get_running_loop().create_task(check(), name=f"detached-{job.job_id}")

    async def close(self) -> None:
        """Stops the pending grace-period checks (the jobs themselves are stopped by the JobManager)."""
        tasks = list(self._pending.values())
        self._pending.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
