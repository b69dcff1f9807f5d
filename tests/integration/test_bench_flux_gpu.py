"""bench/flux_gpu.py's comparison on the CPU with the tiny checkpoint (its GPU run is `make bench-gpu`): both sides
denoise the same request, and the report has each side's seconds and their ratio."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "flux_gpu.py"


def test_the_comparison_runs_both_sides(flux_model: Path) -> None:
    spec = importlib.util.spec_from_file_location("flux_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.run(flux_model, 32, 2, False, "cpu", "float32")
    for side in ("ours", "diffusers"):
        assert report[side]["seconds"] > 0 and report[side]["seconds_per_step"] > 0
    assert report["ratio_ours_over_diffusers"] > 0
