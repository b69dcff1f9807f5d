"""Which orchestrator replica answers a call, and this replica's part in the group of replicas.

Alone (SoloMembership, the embedded store) this replica answers every call. Replicated (membership.py), one
replica leads: it admits and dispatches, and it answers for the queued jobs; a running job is answered for by
the replica that owns its claim; a finished job by any replica, from the store. A call that reaches another
replica than the one that answers it is relayed there (relay.py), once: a relayed call that reaches a replica
which no longer answers it, or any call while no replica leads (a takeover), ends UNAVAILABLE with a retry delay.
"""

from __future__ import annotations

import asyncio

import grpc

from services.orchestrator.job import JobState
from services.orchestrator.jobs import JobManager
from services.orchestrator.lease_keeper import LeaseKeeper
from services.orchestrator.membership import Membership, SoloMembership
from services.orchestrator.refusals import abort_store_unavailable
from services.orchestrator.relay import Relay, is_relayed
from services.orchestrator.store.jobstore import DEFAULT_LEASE_TTL_S
from services.orchestrator.store_errors import StoreUnavailable
from services.orchestrator.tenant_auth import current_tenant
from stagediff.status_details import abort_with_retry

# When to retry a call that reached no replica able to answer it (a takeover, a job changing hands).
PEER_RETRY_S = 1.0


class Placement:
    """This replica's membership of the group, and where each call is answered."""

    def __init__(
        self,
        jobs: JobManager,
        membership: Membership | None = None,
        relay: Relay | None = None,
        job_lease_s: float = DEFAULT_LEASE_TTL_S,
    ) -> None:
        self.jobs = jobs
        self.membership: Membership = membership if membership is not None else SoloMembership(jobs.store.owner)
        self.relay = relay
        self.job_lease_s = job_lease_s
        jobs.shared_store = self.replicated
        self._background: list[asyncio.Task[None]] = []

    @property
    def replicated(self) -> bool:
        return not isinstance(self.membership, SoloMembership)

    async def join(self) -> None:
        """Takes part: alone, leads at once (the stored jobs queued again before any new admission); replicated,
        runs the membership rounds (the leader queues the stored jobs when it takes the lease) and renews the
        leases of the jobs this replica runs."""
        if not self.replicated:
            await self.jobs.lead()
            return
        self._background = [
            asyncio.create_task(self.membership.run(self._lead, self.jobs.follow), name="membership"),
            asyncio.create_task(LeaseKeeper(self.jobs, self.job_lease_s / 3).run(), name="lease-keeper"),
        ]

    async def _lead(self) -> None:
        await self.jobs.lead(requeue_running=False)

    async def leave(self, drain_s: float) -> None:
        """Leaves the group: resigns leadership at once (a follower leads at its next round), lets the running
        jobs finish within `drain_s` while still renewing their leases, then stops taking part."""
        if not self.replicated:
            return
        await self.membership.resign()
        await self.jobs.follow()
        await self.jobs.drain(drain_s)
        await self.jobs.release()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.relay is not None:
            await self.relay.close()

    async def admission_peer(self, context: grpc.aio.ServicerContext) -> str | None:
        """Where an admission is answered: None here (this replica leads), else the leader's endpoint."""
        if self.membership.is_leader():
            return None
        endpoint = self.membership.leader_endpoint()
        if endpoint is None or self.relay is None or is_relayed(context, self.relay.secret):
            await abort_with_retry(
                context,
                "no orchestrator replica leads at the moment; retry",
                PEER_RETRY_S,
                code=grpc.StatusCode.UNAVAILABLE,
            )
        return endpoint

    async def job_peer(self, job_id: str, context: grpc.aio.ServicerContext) -> str | None:
        """Where a call about a job is answered: None here (the job is held here, finished, or not the caller's),
        else the endpoint of the replica holding it (its owner while running, the leader while queued)."""
        if not self.replicated or not job_id:
            return None
        live = self.jobs.jobs.get(job_id)
        if live is not None and not live.finished:
            return None
        try:
            record = await asyncio.to_thread(self.jobs.store.get, job_id)
        except StoreUnavailable as error:
            await abort_store_unavailable(context, error)
        if record is None or record.finished or record.tenant != current_tenant().name:
            return None
        endpoint: str | None = None
        if record.state == JobState.JOB_STATE_RUNNING and record.owner != self.membership.replica_id:
            endpoint = await self.membership.endpoint_of(record.owner)
        elif record.state == JobState.JOB_STATE_QUEUED and not self.membership.is_leader():
            endpoint = self.membership.leader_endpoint()
        if endpoint is None or self.relay is None or is_relayed(context, self.relay.secret):
            await abort_with_retry(
                context,
                f"job {job_id} is moving between orchestrator replicas; retry",
                PEER_RETRY_S,
                code=grpc.StatusCode.UNAVAILABLE,
            )
        return endpoint
