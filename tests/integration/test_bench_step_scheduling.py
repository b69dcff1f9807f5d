"""bench/step_scheduling.py's short form runs end to end: one configuration ((d) preemption with continuous
batching, and part two's continuous batching), every job succeeds, and the JSON has the fields BENCHMARKS.md
reads. No assertion on time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_the_quick_step_scheduling_bench_runs_every_job_and_reports_each_configuration() -> None:
    command = [sys.executable, str(REPOSITORY / "bench" / "step_scheduling.py"), "--quick"]
    finished = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-4000:]
    report = json.loads(finished.stdout)
    assert report["benchmark"] == "step_scheduling" and report["quick"] is True

    scheduling = report["scheduling"]
    assert scheduling["workload"]["high_arrivals"] >= 1
    assert set(scheduling["configurations"]) == {"d_both"}
    for name, configuration in scheduling["configurations"].items():
        jobs = configuration["jobs"]
        assert jobs["failed"] == 0, (name, configuration["errors"])
        assert jobs["high"] == scheduling["workload"]["high_arrivals"], (name, jobs)
        assert jobs["idle_high"] == scheduling["workload"]["idle_highs"] and jobs["low"] >= 1, (name, jobs)
        assert set(configuration["high_latency_s"]) == {"p50", "p99", "p99_is_max", "mean"}
        assert configuration["high_latency_s"]["p99_is_max"] is True
        for field in ("high_p99_over_idle", "low_mean_latency_s", "low_preemptions"):
            assert field in configuration, (name, field)
        assert set(configuration["throughput"]) == {"jobs_per_min", "dit_steps_per_s"}
        assert configuration["throughput"]["jobs_per_min"] > 0

    load = report["load"]
    assert set(load["levels"]) == {"continuous_batching"}
    for name, levels in load["levels"].items():
        assert [level["concurrency"] for level in levels] == load["workload"]["concurrency"], name
        for level in levels:
            assert level["failed"] == 0, (name, level["errors"])
            assert level["jobs"] == level["concurrency"] * load["workload"]["rounds_per_client"], (name, level)
            assert level["jobs_per_s"] > 0 and level["mean_latency_s"] > 0

    ratios = report["ratios"]
    assert set(ratios["high_p99_over_idle"]) == {"d_both"}
