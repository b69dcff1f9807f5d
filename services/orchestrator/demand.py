"""What each stage pool is asked for, per model: the demand an autoscaler scales the pools on.

The orchestrator stays up when pools are at zero, so it is where demand is seen. Each `Stage` keeps a
`StageDemand`: its calls in flight and waiting for a replica, per model, and how long its recent calls took. At
each scrape `PoolDemandCollector` exports, for every served model and every stage of its chain (a pool: the
replicas that serve that model there; a shared text-encoder pool is the sum over its models):

    stagediff_pool_replicas_serving{stage,model}    replicas serving the model's calls at the stage now
    stagediff_pool_calls_in_flight{stage,model}     calls running on them
    stagediff_pool_calls_waiting{stage,model}       calls waiting for a replica (a pool at zero, or all down)
    stagediff_pool_queued_work_seconds{stage,model} (jobs queued for the model + calls waiting) x the mean of the
                                                    stage's recent calls for the model (0 before any)
    stagediff_model_jobs_queued{model}              jobs admitted for the model and not started yet

deploy/k8s/autoscaling/ scales the pools on them with KEDA. Label values are served model ids and stage kinds
(routes.py bounds the models), and every count is read from memory at scrape time: nothing is kept per job.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from services.orchestrator.stage_clients import StagePool

RECENT_CALLS = 20  # calls per (stage, model) whose times give the mean


class StageDemand:
    """One stage's calls in flight and waiting, per model, and the times of its recent calls."""

    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()
        self.waiting: Counter[str] = Counter()
        self._times: dict[str, deque[float]] = {}

    @contextlib.contextmanager
    def waiting_for_replica(self, model: str) -> Iterator[None]:
        self.waiting[model] += 1
        try:
            yield
        finally:
            self.waiting[model] -= 1

    @contextlib.contextmanager
    def calling(self, model: str) -> Iterator[None]:
        """Counts a call in flight while the block runs, and records how long it took."""
        self.in_flight[model] += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            self.in_flight[model] -= 1
            self.record(model, time.perf_counter() - started)

    def record(self, model: str, seconds: float) -> None:
        """Notes how long a call for `model` took (the last RECENT_CALLS give the mean)."""
        self._times.setdefault(model, deque(maxlen=RECENT_CALLS)).append(seconds)

    def mean_call_s(self, model: str) -> float:
        """The mean time of the recent calls for `model`; 0 before any."""
        times = self._times.get(model)
        return sum(times) / len(times) if times else 0.0


class PoolDemandCollector(Collector):
    """The demand of every (stage, model) pool of `pool`, read at scrape time; `queued_by_model`: the jobs queued
    for each model (FairScheduler.queued_by_model)."""

    def __init__(self, pool: StagePool, queued_by_model: Callable[[], Mapping[str, int]]) -> None:
        self.pool = pool
        self.queued_by_model = queued_by_model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["stage", "model"]
        serving = GaugeMetricFamily(
            "stagediff_pool_replicas_serving", "Replicas serving a model's calls at a stage now.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "stagediff_pool_calls_in_flight", "A model's calls running at a stage.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "stagediff_pool_calls_waiting",
            "A model's calls waiting for a replica of a stage (a pool at zero, or all down).",
            labels=labels,
        )
        work = GaugeMetricFamily(
            "stagediff_pool_queued_work_seconds",
            "Seconds of work queued for a stage's pool for a model: (jobs queued + calls waiting) x recent call time.",
            labels=labels,
        )
        queued_jobs = GaugeMetricFamily(
            "stagediff_model_jobs_queued", "Jobs admitted for a model and not started yet.", labels=["model"]
        )
        queued = self.queued_by_model()
        for model, route in self.pool.routes.models().items():
            queued_jobs.add_metric([model], queued.get(model, 0))
            for name in route.family.chain:
                stage = self.pool.stages.get(name)
                if stage is None:
                    continue
                demand = stage.demand
                values = [name, model]
                serving.add_metric(values, len(stage.serving(route.accepts(name))))
                in_flight.add_metric(values, demand.in_flight[model])
                waiting.add_metric(values, demand.waiting[model])
                work.add_metric(values, (queued.get(model, 0) + demand.waiting[model]) * demand.mean_call_s(model))
        yield from (serving, in_flight, waiting, work, queued_jobs)
