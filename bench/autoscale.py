"""An autoscaling policy checked before it is deployed: the KEDA settings of deploy/k8s/autoscaling/ replayed on a
day of traffic, in seconds.

The DiT pools, which hold nearly all of a cluster's GPUs, are simulated second by second in virtual time:

- Traffic: three models (an image model, a video model and a large video model, each with its DiT time per job and
  its load time; MODELS) arrive as Poisson processes on a diurnal curve (a quiet night, a peak at noon) with
  bursts (BURSTS: one model's rate tripled for a quarter of an hour).
- The orchestrator's own code: its FairScheduler admits each job (refusing what its queue cannot hold, as
  --max-queued-jobs does) and starts jobs under --max-running-jobs; a started job waits for a replica of its
  model (--cold-start-timeout), and each replica runs one job at a time. The metrics the autoscaler reads are those
  of services/orchestrator/demand.py, with its StageDemand keeping the recent DiT times per model.
- The autoscaler is KEDA as the DiT's ScaledObject sets it (read from the manifests, not restated here): every
  `pollingInterval` it evaluates the trigger's query (the sum of the stagediff_ metrics it names, for the pool's
  model), activates a pool at zero when the value is above `activationThreshold`, sizes it to ceil(value /
  threshold) within the replica bounds (the HPA's 10% tolerance included), holds a scale-down for the HPA's
  scale-down stabilization window, adds and removes no faster than its `Pods` policies allow, and takes the pool
  to zero `cooldownPeriod` after the value was last above the activation threshold (its initialCooldownPeriod is
  not modelled: every pool starts at zero). A new replica serves after its model's load time; one removed while
  busy finishes its job first (the drain), and counts until then.

The same traffic then runs on fixed pools sized for the peak (each model's replicas for its peak rate, bursts
included) and on fixed pools of the autoscaled run's cost. For each: replica-seconds, the queueing delay (arrival to
the start of the DiT call) p50/p99, and jobs refused. Prints one JSON object.

    python bench/autoscale.py [--hours 24] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from services.orchestrator.demand import StageDemand
from services.orchestrator.scheduler import AdmissionRefused, FairScheduler

AUTOSCALING = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "autoscaling"
DAY_S = 24 * 3600
MAX_QUEUED_JOBS = 256  # the orchestrator's --max-queued-jobs default
MAX_RUNNING_JOBS = 64  # --max-running-jobs of a cluster with pools this size (the default, 4, is for one machine)
HPA_TOLERANCE = 0.1  # the HPA leaves a pool alone while the value is within 10% of its target


@dataclass(frozen=True)
class Model:
    name: str
    dit_s: float  # DiT time per job (one replica)
    load_s: float  # from a replica's creation to its first call: the pod, the weights, the warm-up
    peak_rate: float  # jobs per second at the diurnal peak, before bursts


# Real-size orders of magnitude on one GPU group: a Qwen-Image 1328x1328 image in 50 steps, a Wan2.1-1.3B 480p
# video (SGLang measured 312.8 s for 50 steps on one H100; fewer steps and a group of GPUs make it ~2 minutes), a
# Wan2.1-14B 720p video; load times grow with the weights read.
MODELS = (
    Model("image", dit_s=10.0, load_s=90.0, peak_rate=0.15),
    Model("video", dit_s=120.0, load_s=120.0, peak_rate=0.015),
    Model("large-video", dit_s=600.0, load_s=300.0, peak_rate=0.003),
)
# (model, start hour, minutes, rate factor): a campaign, a batch of renders.
BURSTS = (("image", 10.0, 15, 3.0), ("video", 15.5, 15, 3.0), ("large-video", 20.0, 15, 3.0))


@dataclass(frozen=True)
class KedaPolicy:
    """What the DiT's ScaledObject says, as KEDA and the HPA apply it."""

    query: str
    metrics: tuple[str, ...]  # the stagediff_ metrics the query sums
    threshold: float
    activation: float
    polling_s: float
    cooldown_s: float
    min_replicas: int
    max_replicas: int
    scale_down_window_s: float
    scale_up_window_s: float
    # The HPA's rate limits: at most `value` pods added (removed) per `periodSeconds`; None: unlimited.
    scale_up_limit: tuple[int, float] | None = None
    scale_down_limit: tuple[int, float] | None = None

    @classmethod
    def from_manifests(cls, directory: Path = AUTOSCALING) -> KedaPolicy:
        """The ScaledObject whose target is the DiT, in the kustomize component's files."""
        for path in sorted(directory.glob("*.yaml")):
            for document in yaml.safe_load_all(path.read_text()):
                if not document or document.get("kind") != "ScaledObject":
                    continue
                spec = document["spec"]
                if "dit" not in spec["scaleTargetRef"]["name"]:
                    continue
                (trigger,) = [t for t in spec["triggers"] if t["type"] == "prometheus"]
                behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
                query = trigger["metadata"]["query"]
                return cls(
                    query=query,
                    metrics=tuple(dict.fromkeys(re.findall(r"\bstagediff_[a-z_]+", query))),
                    threshold=float(trigger["metadata"]["threshold"]),
                    activation=float(trigger["metadata"].get("activationThreshold", 0)),
                    polling_s=float(spec.get("pollingInterval", 30)),
                    cooldown_s=float(spec.get("cooldownPeriod", 300)),
                    min_replicas=int(spec.get("minReplicaCount", 0)),
                    max_replicas=int(spec.get("maxReplicaCount", 100)),
                    scale_down_window_s=float(behavior.get("scaleDown", {}).get("stabilizationWindowSeconds", 300)),
                    scale_up_window_s=float(behavior.get("scaleUp", {}).get("stabilizationWindowSeconds", 0)),
                    scale_up_limit=_pods_policy(behavior.get("scaleUp", {})),
                    scale_down_limit=_pods_policy(behavior.get("scaleDown", {})),
                )
        raise SystemExit(f"no ScaledObject targeting the DiT in {directory}")


def _pods_policy(rules: dict[str, Any]) -> tuple[int, float] | None:
    """The HPA `Pods` policy of a scaling direction (the simulation models that kind only)."""
    policies = rules.get("policies") or []
    if any(policy["type"] != "Pods" for policy in policies):
        raise SystemExit(f"HPA policies {policies}: this simulation models `type: Pods` only")
    if not policies:
        return None
    policy = min(policies, key=lambda policy: policy["value"] / policy["periodSeconds"])
    return int(policy["value"]), float(policy["periodSeconds"])


@dataclass
class Replica:
    ready_at: float
    busy_until: float = 0.0
    job: str | None = None
    leaving: bool = False


@dataclass
class Pool:
    """One model's DiT replicas and what waits for them."""

    model: Model
    replicas: list[Replica] = field(default_factory=list)
    waiting: deque[tuple[str, float]] = field(default_factory=deque)  # started jobs: (id, arrival)
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)  # (time, desired) for the window
    changes: deque[tuple[float, int]] = field(default_factory=deque)  # (time, replicas added > 0 or removed < 0)
    last_active: float = -math.inf
    replica_seconds: float = 0.0


def arrivals(hours: float, seed: int) -> list[tuple[float, str]]:
    """(time, model) of every job: Poisson on the diurnal curve, bursts included."""
    rng = np.random.default_rng(seed)
    horizon = int(hours * 3600)
    seconds = np.arange(horizon)
    diurnal = 0.05 + 0.95 * 0.5 * (1 - np.cos(2 * np.pi * seconds / DAY_S))  # 5% at midnight, 100% at noon
    jobs: list[tuple[float, str]] = []
    for model in MODELS:
        rate = model.peak_rate * diurnal
        for name, hour, minutes, factor in BURSTS:
            if name == model.name:
                start = int(hour * 3600)
                rate[start : start + minutes * 60] *= factor
        counts = rng.poisson(rate)
        for second in np.nonzero(counts)[0]:
            jobs += [(float(second) + rng.random(), model.name)] * int(counts[second])
    return sorted(jobs)


def peak_replicas(model: Model) -> int:
    """Replicas that keep up with the model's peak rate, bursts included."""
    factor = max([1.0, *(f for name, _, _, f in BURSTS if name == model.name)])
    return max(1, math.ceil(model.peak_rate * factor * model.dit_s))


def simulate(
    jobs: list[tuple[float, str]], hours: float, policy: KedaPolicy | None, fixed: dict[str, int] | None
) -> dict[str, Any]:
    """One run: autoscaled by `policy`, or `fixed` replicas per model from the start (serving at once)."""
    scheduler = FairScheduler(max_queued=MAX_QUEUED_JOBS, max_running=MAX_RUNNING_JOBS)
    demand = StageDemand()
    pools = {model.name: Pool(model) for model in MODELS}
    if fixed is not None:
        for name, count in fixed.items():
            pools[name].replicas = [Replica(ready_at=0.0) for _ in range(count)]
    arrived: dict[str, tuple[float, str]] = {}
    delays: dict[str, list[float]] = {model.name: [] for model in MODELS}
    refused = dict.fromkeys(pools, 0)
    horizon = hours * 3600
    pending = deque(jobs)
    next_poll = 0.0
    t = 0.0
    while t < horizon or any(pool.waiting or any(r.job for r in pool.replicas) for pool in pools.values()):
        while pending and pending[0][0] <= t:
            when, name = pending.popleft()
            job_id = f"job-{len(arrived)}"
            try:
                scheduler.admit(job_id, "default", model=name)
                arrived[job_id] = (when, name)
            except AdmissionRefused:
                refused[name] += 1
        while (job_id := scheduler.next_runnable()) is not None:
            when, name = arrived[job_id]
            pools[name].waiting.append((job_id, when))
        for pool in pools.values():
            for replica in pool.replicas:
                if replica.job is not None and replica.busy_until <= t:
                    scheduler.finished(replica.job)
                    demand.record(pool.model.name, pool.model.dit_s)
                    replica.job = None
            pool.replicas = [r for r in pool.replicas if not (r.leaving and r.job is None)]
            for replica in pool.replicas:
                if replica.job is None and not replica.leaving and replica.ready_at <= t and pool.waiting:
                    job_id, when = pool.waiting.popleft()
                    replica.job, replica.busy_until = job_id, t + pool.model.dit_s
                    delays[pool.model.name].append(t - when)
            pool.replica_seconds += len(pool.replicas)
        if policy is not None and t >= next_poll:
            queued = scheduler.queued_by_model()
            for pool in pools.values():
                _autoscale(pool, policy, t, _metrics(pool, queued.get(pool.model.name, 0), demand, t))
            next_poll = t + policy.polling_s
        t += 1.0
    return _summary(pools, delays, refused, horizon)


def _metrics(pool: Pool, queued: int, demand: StageDemand, t: float) -> dict[str, float]:
    """The pool's series as demand.py exports them for its model."""
    waiting = len(pool.waiting)
    return {
        "stagediff_pool_calls_waiting": waiting,
        "stagediff_pool_calls_in_flight": sum(1 for r in pool.replicas if r.job is not None),
        "stagediff_pool_replicas_serving": sum(1 for r in pool.replicas if r.ready_at <= t and not r.leaving),
        "stagediff_model_jobs_queued": queued,
        "stagediff_pool_queued_work_seconds": (queued + waiting) * demand.mean_call_s(pool.model.name),
    }


def _autoscale(pool: Pool, policy: KedaPolicy, t: float, series: dict[str, float]) -> None:
    unknown = [name for name in policy.metrics if name not in series]
    if unknown:
        raise SystemExit(f"the DiT's ScaledObject query names {unknown}, which this simulation does not model")
    value = sum(series[name] for name in policy.metrics)
    current = sum(1 for r in pool.replicas if not r.leaving)
    if value > policy.activation:
        pool.last_active = t
    if current == 0:
        desired = max(1, math.ceil(value / policy.threshold)) if value > policy.activation else 0
    elif value <= policy.activation and t - pool.last_active >= policy.cooldown_s and policy.min_replicas == 0:
        desired = 0  # KEDA takes an idle pool back to zero after its cooldown
    else:
        if abs(value / (policy.threshold * current) - 1) <= HPA_TOLERANCE:
            raw = current
        else:
            raw = math.ceil(value / policy.threshold)
        raw = min(policy.max_replicas, max(1, policy.min_replicas, raw))
        pool.recommendations.append((t, raw))
        while pool.recommendations and pool.recommendations[0][0] < t - policy.scale_down_window_s:
            pool.recommendations.popleft()
        # Scale-down takes the highest recommendation of its window; scale-up (window 0 here) the current one.
        desired = raw if raw >= current else max(r for _, r in pool.recommendations)
    desired = _rate_limited(pool, policy, t, current, desired)
    if desired > current:
        pool.replicas += [Replica(ready_at=t + pool.model.load_s) for _ in range(desired - current)]
    elif desired < current:
        # The idle first (those still loading, then those without a job); a busy one drains its job.
        staying = sorted((r for r in pool.replicas if not r.leaving), key=lambda r: (r.job is not None, -r.ready_at))
        for replica in staying[: current - desired]:
            replica.leaving = True


def _rate_limited(pool: Pool, policy: KedaPolicy, t: float, current: int, desired: int) -> int:
    """`desired` within the HPA's Pods policies (a pool at zero is KEDA's to activate, without them)."""
    limit = policy.scale_up_limit if desired > current else policy.scale_down_limit
    if limit is not None and current > 0 and desired != current:
        value, period = limit
        sign = 1 if desired > current else -1
        done = sum(abs(change) for when, change in pool.changes if when > t - period and change * sign > 0)
        desired = current + sign * min(abs(desired - current), max(0, value - done))
    if desired != current:
        pool.changes.append((t, desired - current))
        while pool.changes and pool.changes[0][0] < t - 3600:
            pool.changes.popleft()
    return desired


def _summary(
    pools: dict[str, Pool], delays: dict[str, list[float]], refused: dict[str, int], horizon: float
) -> dict[str, Any]:
    every = [delay for model_delays in delays.values() for delay in model_delays]

    def quantiles(values: list[float]) -> dict[str, float]:
        if not values:
            return {"p50_s": 0.0, "p99_s": 0.0}
        return {
            "p50_s": round(float(np.percentile(values, 50)), 1),
            "p99_s": round(float(np.percentile(values, 99)), 1),
        }

    return {
        "replica_seconds": round(sum(pool.replica_seconds for pool in pools.values())),
        "queueing": quantiles(every),
        "jobs": len(every),
        "refused": sum(refused.values()),
        "models": {
            name: {
                "replica_seconds": round(pool.replica_seconds),
                "mean_replicas": round(pool.replica_seconds / horizon, 2),
                "queueing": quantiles(delays[name]),
                "jobs": len(delays[name]),
                "refused": refused[name],
            }
            for name, pool in pools.items()
        },
    }


def run(hours: float, seed: int, policy: KedaPolicy) -> dict[str, Any]:
    jobs = arrivals(hours, seed)
    autoscaled = simulate(jobs, hours, policy, None)
    peak = {model.name: peak_replicas(model) for model in MODELS}
    fixed_peak = simulate(jobs, hours, None, peak)
    same_cost = {
        name: max(1, round(model["replica_seconds"] / (hours * 3600))) for name, model in autoscaled["models"].items()
    }
    fixed_same_cost = simulate(jobs, hours, None, same_cost)
    return {
        "bench": "autoscale",
        "hours": hours,
        "seed": seed,
        "jobs_arrived": len(jobs),
        "models": {m.name: {"dit_s": m.dit_s, "load_s": m.load_s, "peak_rate_per_s": m.peak_rate} for m in MODELS},
        "bursts": [{"model": m, "hour": h, "minutes": n, "factor": f} for m, h, n, f in BURSTS],
        "policy": policy.__dict__ | {"metrics": list(policy.metrics)},
        "autoscaled": autoscaled,
        "fixed_for_peak": fixed_peak | {"replicas": peak},
        "fixed_same_cost": fixed_same_cost | {"replicas": same_cost},
        "autoscaled_over_fixed_peak": round(autoscaled["replica_seconds"] / fixed_peak["replica_seconds"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hours", type=float, default=24.0, help="virtual hours of traffic (default: a day)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--manifests", type=Path, default=AUTOSCALING, help="the autoscaling component's folder")
    args = parser.parse_args()
    print(json.dumps(run(args.hours, args.seed, KedaPolicy.from_manifests(args.manifests)), indent=2))


if __name__ == "__main__":
    main()
