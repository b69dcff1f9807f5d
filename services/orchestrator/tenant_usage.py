"""Each tenant's jobs against its quota, for the people on call (deploy/grafana/): read at scrape time.

    stagediff_tenant_jobs{tenant,state}        the tenant's jobs queued and running (state: queued, running)
    stagediff_tenant_job_limit{tenant,limit}   its limits on them (limit: max_queued_jobs, max_running_jobs), where
                                               its quotas set one

Tenants are those of the tenants file (bounded label values) and, for the jobs, any the scheduler counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.orchestrator.scheduler import TenantCounts
from services.orchestrator.tenants import Tenant


class TenantUsageCollector(Collector):
    """`tenants`: the tenants file's; `counts`: every tenant's queued and running jobs (FairScheduler.tenants)."""

    def __init__(self, tenants: Mapping[str, Tenant], counts: Callable[[], Mapping[str, TenantCounts]]) -> None:
        self.tenants = tenants
        self.counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily(
            "stagediff_tenant_jobs", "A tenant's jobs, queued and running.", labels=["tenant", "state"]
        )
        limits = GaugeMetricFamily(
            "stagediff_tenant_job_limit", "A tenant's quota on its queued and running jobs.", labels=["tenant", "limit"]
        )
        counts = self.counts()
        for name in sorted({*self.tenants, *counts}):
            count = counts.get(name, TenantCounts(0, 0))
            jobs.add_metric([name, "queued"], count.queued)
            jobs.add_metric([name, "running"], count.running)
            tenant = self.tenants.get(name)
            if tenant is None:
                continue
            for limit, value in (
                ("max_queued_jobs", tenant.quotas.max_queued_jobs),
                ("max_running_jobs", tenant.quotas.max_running_jobs),
            ):
                if value is not None:
                    limits.add_metric([name, limit], value)
        yield from (jobs, limits)
