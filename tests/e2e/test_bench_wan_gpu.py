"""bench/wan_gpu.py --dry-run: the GPU benchmark's code path on the CPU (tiny preset, 2 steps), so that it
cannot rot between GPU runs. Checks the report's shape and that every figure it measured is a positive,
finite number; times are never compared."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # the end-to-end section starts the local cluster

REPOSITORY = Path(__file__).resolve().parents[2]
TIMINGS = ("request_s", "step_s")


def positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_run(run: dict, steps: int) -> None:
    """A timed run: its request and median step, one time per step, its peak memory."""
    assert all(positive(run[key]) for key in TIMINGS), run
    assert len(run["steps_s"]) == steps and all(positive(step) for step in run["steps_s"]), run
    assert positive(run["peak_memory"]["bytes"]) and positive(run["peak_memory"]["before_bytes"]), run
    assert run["peak_memory"]["bytes"] >= run["peak_memory"]["before_bytes"]


def check_sampled(memory: dict) -> None:
    assert positive(memory["peak_bytes"]) and memory["peak_bytes"] >= memory["baseline_bytes"] >= 0, memory
    assert memory["peak_over_baseline_bytes"] == memory["peak_bytes"] - memory["baseline_bytes"]


def test_dry_run_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "wan_gpu.json"
    finished = subprocess.run(
        [sys.executable, "bench/wan_gpu.py", "--dry-run", "--out", str(out)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stderr[-4000:]
    report = json.loads(finished.stdout)
    assert json.loads(out.read_text()) == report

    assert report["benchmark"] == "wan_gpu" and report["mode"] == "dry-run" and "dry run" in report["note"]
    assert report["environment"]["device_type"] == "cpu" and report["dtype"] == "fp32"
    assert report["environment"]["torch"] and report["environment"]["diffusers"]
    assert report["attention_backend"]["diffusers_backend"] == "native"
    assert report["checkpoint"]["preset"] == "tiny" and report["checkpoint"]["family"] == "wan-t2v"
    assert positive(report["checkpoint"]["bytes"]) and positive(report["checkpoint"]["write_s"])
    config = report["config"]
    assert (config["height"], config["width"], config["num_frames"], config["steps"]) == (64, 64, 9, 2)
    assert positive(config["video_tokens"]) and config["text_tokens"] == 512

    step_time = report["step_time"]
    check_run(step_time["ours"], config["timing_steps"])
    check_run(step_time["diffusers"], config["timing_steps"])
    assert step_time["ours"]["denoiser"] == "families.wan.denoise.WanDenoiser"
    assert positive(step_time["ratio_ours_over_diffusers"])

    caches = report["step_caches"]
    check_run(caches["uncached"], config["steps"])
    assert caches["uncached"]["passes_run"] == 2 * config["steps"] and caches["uncached"]["passes_skipped"] == 0
    assert set(caches["methods"]) == {"first_block", "mag", "teacache"}
    for method, run in caches["methods"].items():
        assert run["offered"], method  # wan-t2v offers every step cache
        check_run(run, config["steps"])
        assert run["passes_run"] + run["passes_skipped"] == 2 * config["steps"], method
        assert positive(run["speedup_vs_uncached"]) and positive(run["threshold"]), method
    assert positive(caches["methods"]["mag"]["calibration_s"])

    compiled = report["compile"]
    check_run(compiled, config["timing_steps"])
    assert compiled["blocks"] == report["checkpoint"]["transformer_config"]["num_layers"]
    assert positive(compiled["first_request_s"]) and positive(compiled["step_speedup_vs_eager"])

    end_to_end = report["end_to_end"]
    cluster, diffusers = end_to_end["ours_cluster"], end_to_end["diffusers"]
    assert cluster["compose_file"] == "deploy/docker-compose.single-gpu.yml"
    assert set(cluster["stage_devices"]) == {"text-encoder", "dit", "vae", "interp"}
    assert all(device == "cpu" for device in cluster["stage_devices"].values())
    assert positive(cluster["startup_s"]) and positive(cluster["request_s"])
    assert all(positive(cluster["stage_s"][stage]) for stage in ("text-encoder", "dit", "vae", "total"))
    check_sampled(cluster["sampled_memory"])
    assert positive(diffusers["load_s"]) and positive(diffusers["request_s"]) and positive(diffusers["denoise_step_s"])
    assert positive(diffusers["peak_memory"]["bytes"])
    check_sampled(diffusers["sampled_memory"])
    assert positive(end_to_end["ratio_ours_over_diffusers"])
    assert end_to_end["frames_shape"] == [config["num_frames"], config["height"], config["width"], 3]
    assert math.isfinite(end_to_end["frames_mean_abs_difference_levels"])

    sources = {anchor["source"]: anchor for anchor in report["anchors"]}
    assert sources["FastVideo"]["seconds"] == 259.7 and sources["LightX2V"]["seconds"] == 58.0
    # A dry run is not the anchors' request: no ratio to them.
    assert all(not anchor["same_request"] and anchor["ours_cluster_over_anchor"] is None for anchor in sources.values())
    assert set(report["section_wall_s"]) == {
        "checkpoint_write",
        "ours_step_time_and_caches",
        "compile",
        "diffusers",
        "cluster",
    }
    assert all(positive(seconds) for seconds in report["section_wall_s"].values())


def test_without_cuda_a_real_run_fails_with_a_clear_message() -> None:
    # No GPU visible, even on a machine that has one: the quick run must refuse rather than start.
    finished = subprocess.run(
        [sys.executable, "bench/wan_gpu.py", "--quick"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert finished.returncode != 0
    assert "needs a CUDA GPU" in finished.stderr and "--dry-run" in finished.stderr
    assert finished.stdout == ""
