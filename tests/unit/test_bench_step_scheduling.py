"""bench/step_scheduling.py's decisions that do not need a cluster: every configuration gets the same seeded trace,
the p99 of a few jobs is their largest latency (nearest rank), and the ratios compare only the configurations that
ran. Its cluster path is what the end-to-end step-scheduling tests run (tests/e2e/test_e2e_step_scheduling.py);
`--quick` runs it in about a minute by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "step_scheduling.py"
_spec = importlib.util.spec_from_file_location("step_scheduling_bench", BENCH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up while they are made
_spec.loader.exec_module(bench)


def test_the_trace_is_the_same_for_every_configuration_and_within_its_bounds() -> None:
    first = bench.Trace.make(bench.SHAPE, 0, 90.0, 5.0, 2, bench.LOW_STEPS)
    again = bench.Trace.make(bench.SHAPE, 0, 90.0, 5.0, 2, bench.LOW_STEPS)
    assert first == again and first != bench.Trace.make(bench.SHAPE, 1, 90.0, 5.0, 2, bench.LOW_STEPS)
    assert first.high_offsets == sorted(first.high_offsets) and 0 < first.high_offsets[-1] < 90.0
    assert len(first.low_steps) == 2
    assert all(60 <= steps <= 100 for client in first.low_steps for steps in client)
    # A window too short for any arrival still gets one high job, in its middle.
    assert bench.Trace.make(bench.SHAPE, 0, 1e-6, 5.0, 1, bench.LOW_STEPS).high_offsets == [0.0]


def test_the_p99_of_a_few_jobs_is_their_largest_latency() -> None:
    values = [float(v) for v in range(1, 18)]
    assert bench.percentile(values, 0.99) == 17.0
    assert bench.percentile(values, 0.5) == 9.0
    assert bench.percentile([float(v) for v in range(1, 201)], 0.99) == 198.0


def test_the_ratios_compare_only_what_ran() -> None:
    load = {
        "unbatched": [{"concurrency": 1, "jobs_per_s": 2.0, "mean_latency_s": 0.5}],
        "continuous_batching": [{"concurrency": 1, "jobs_per_s": 3.0, "mean_latency_s": 0.6}],
    }
    scheduling = {"b_preemption": {"high_p99_over_idle_p99": 1.4, "high_dit_finish_max_over_idle_max": 1.1}}
    ratios = bench.ratios(scheduling, load)
    assert ratios["high_p99_over_idle_p99"] == {"b_preemption": 1.4}
    assert ratios["high_dit_finish_max_over_idle_max"] == {"b_preemption": 1.1}
    assert ratios["throughput_continuous_over_unbatched"] == {"1": 1.5}
    assert ratios["latency_at_concurrency_1_over_unbatched"] == {"unbatched": 1.0, "continuous_batching": 1.2}
    assert "throughput_continuous_over_request_level" not in ratios


def test_the_load_blocks_rotate_so_that_drift_falls_on_every_configuration() -> None:
    names = ["unbatched", "request_level_batching", "continuous_batching"]
    orders = [bench.rotated(names, block) for block in range(3)]
    assert [order[0] for order in orders] == names  # each configuration goes first once
    assert all(sorted(order) == sorted(names) for order in orders)
    assert bench.rotated(names, 3) == names


def test_the_report_compares_the_loaded_p99_with_the_same_trace_alone() -> None:
    def job(kind: str, latency: float, dit_finish: float) -> object:
        return bench.JobRecord(kind, 8, submitted=0.0, first_dit=0.1, last_dit=dit_finish, done=latency)

    idle = [job("high", 1.0, 0.7)]
    alone = [job("high", 1.0, 0.7), job("high", 2.0, 1.4)]
    loaded = [job("high", 1.5, 0.8), job("high", 2.5, 1.6), job("low", 9.0, 8.0)]
    report = bench.scheduling_report(idle, alone, loaded, wall=60.0)
    assert report["high_p99_over_idle_p99"] == 1.25
    assert report["high_p99_over_idle_median"] == 2.5
    assert report["high_dit_finish_max_over_idle_max"] == round(1.6 / 1.4, 3)
    assert report["jobs"] == {"high": 2, "low": 1, "idle_high": 1, "alone_high": 2, "failed": 0}
    assert report["throughput"]["jobs_per_min"] == 3.0
