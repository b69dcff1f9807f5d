"""The Prometheus metric names StageDiff's servers export, computed from the code, and the metric names a PromQL
expression reads: so that a dashboard or a scaler query that names a metric no server exports fails a test.

The exported names come from the registries the servers build: OrchestratorMetrics and ServerMetrics (every server),
the orchestrator's PoolDemandCollector (services/orchestrator/demand.py, given a pool with one replica per stage and
one served model) and TenantUsageCollector (services/orchestrator/tenant_usage.py). A family with no sample yet
(a labelled counter before its first increment) still tells, by its type, which sample names it will have.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from services.metrics import OrchestratorMetrics, ServerMetrics
from services.orchestrator.demand import PoolDemandCollector
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.tenant_usage import TenantUsageCollector
from stagediff.v1 import stages_pb2

# The sample names of a family of each type, after its name (OpenMetrics; prometheus-client writes these).
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}

# A metric name in PromQL: an identifier of the StageDiff prefix that is not inside a string (a label value or a
# regular expression), i.e. not right after a quote, nor part of a longer identifier.
_METRIC = re.compile(r"""(?<![\w:"'`])(stagediff_[A-Za-z0-9_:]*)""")


def registries(pool: StagePool) -> list[CollectorRegistry]:
    """Every registry a StageDiff server serves at /metrics: the orchestrator's (with its collectors, over `pool`)
    and a stage's."""
    server = ServerMetrics()
    orchestrator = OrchestratorMetrics(server.registry)
    pool.routes.remember(stages_pb2.StageInfo(stage="dit", model="m", family="wan-t2v"), "test")
    orchestrator.registry.register(PoolDemandCollector(pool, lambda: {}))
    orchestrator.registry.register(TenantUsageCollector({}, lambda: {}))
    return [orchestrator.registry, ServerMetrics().registry]


STAGE_PORTS = {"text-encoder": 50061, "dit": 50062, "vae": 50063, "interp": 50064}


@functools.cache
def exported_names() -> frozenset[str]:
    """Every sample name the servers export or will once they have samples."""
    return asyncio.run(_exported_names())


async def _exported_names() -> frozenset[str]:
    # The pool's channels belong to an event loop: it is made, read and closed in one.
    pool = StagePool({stage: f"127.0.0.1:{port}" for stage, port in STAGE_PORTS.items()})
    try:
        names: set[str] = set()
        for registry in registries(pool):
            for family in registry.collect():
                names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type])
                names.update(sample.name for sample in family.samples)
        return frozenset(names)
    finally:
        await pool.close()


def metrics_read(expression: str) -> set[str]:
    """The StageDiff metric names a PromQL expression reads."""
    return set(_METRIC.findall(expression))


def unknown_metrics(expressions: Iterable[str]) -> list[str]:
    """The metric names the expressions read that no server exports, sorted."""
    exported = exported_names()
    return sorted({name for expression in expressions for name in metrics_read(expression)} - exported)
