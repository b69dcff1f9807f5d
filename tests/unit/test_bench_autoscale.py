"""bench/autoscale.py applies KEDA's rules as the manifests set them: a pool at zero starts on a waiting job, serves
after its load time, and goes back to zero a cooldown after its last activity; and the shipped policy runs."""

from __future__ import annotations

import math

import pytest

from bench import autoscale
from bench.autoscale import KedaPolicy, simulate

POLICY = KedaPolicy(
    query='sum(stagediff_pool_calls_waiting{stage="dit"}) + sum(stagediff_model_jobs_queued)',
    metrics=("stagediff_pool_calls_waiting", "stagediff_pool_calls_in_flight", "stagediff_model_jobs_queued"),
    threshold=1.0,
    activation=0.0,
    polling_s=15.0,
    cooldown_s=900.0,
    min_replicas=0,
    max_replicas=4,
    scale_down_window_s=600.0,
    scale_up_window_s=0.0,
)


def test_a_pool_at_zero_starts_on_a_job_and_returns_to_zero_after_its_cooldown() -> None:
    video = next(model for model in autoscale.MODELS if model.name == "video")
    result = simulate([(10.5, "video")], hours=1.0, policy=POLICY, fixed=None)["models"]["video"]
    # Polled at 15 s: one job waiting activates the pool; its replica serves after the load time, at 135 s.
    assert result["queueing"]["p50_s"] == pytest.approx(15 + video.load_s - 10.5, abs=0.1)
    # The job runs to 255 s; the last poll that saw it in flight was at 240 s, and the cooldown ends the replica at
    # the first poll 900 s after that (1140 s): it lived from 15 s to 1141 s.
    last_active = math.floor((15 + video.load_s + video.dit_s - 1) / 15) * 15
    assert result["replica_seconds"] == pytest.approx(last_active + POLICY.cooldown_s - 15 + 1, abs=1)


def test_the_shipped_policy_replays_a_few_hours() -> None:
    policy = KedaPolicy.from_manifests()
    assert policy.metrics and all(name.startswith("stagediff_") for name in policy.metrics)
    result = autoscale.run(hours=2.0, seed=1, policy=policy)
    assert result["autoscaled"]["jobs"] + result["autoscaled"]["refused"] == result["jobs_arrived"]
    assert result["fixed_for_peak"]["replica_seconds"] == 2 * 3600 * sum(result["fixed_for_peak"]["replicas"].values())
