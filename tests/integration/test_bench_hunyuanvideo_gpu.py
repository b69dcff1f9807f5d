"""bench/hunyuanvideo_gpu.py --dry-run: the GPU benchmark's code path on the CPU (tiny preset, 48x80, 9 frames, 2
steps, float32), so that it cannot rot between GPU runs (its GPU run is `make bench-gpu`). Both sides run every
stage of the same request and agree on its result; times are positive and never compared."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
STAGES = ("text_encoder", "dit", "vae")


def positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_dry_run_times_both_sides_on_the_same_request(tmp_path: Path) -> None:
    out = tmp_path / "hunyuanvideo_gpu.json"
    finished = subprocess.run(
        [sys.executable, "bench/hunyuanvideo_gpu.py", "--dry-run", "--out", str(out)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stderr[-4000:]
    report = json.loads(finished.stdout)
    assert json.loads(out.read_text()) == report

    assert report["benchmark"] == "hunyuanvideo_gpu" and report["mode"] == "dry-run"
    request = report["request"]
    assert (request["preset"], request["height"], request["width"], request["num_frames"]) == ("tiny", 48, 80, 9)
    assert (request["steps"], request["device"], request["dtype"]) == (2, "cpu", "float32")
    assert report["guidance_scale"] == 6.0 and positive(report["checkpoint_write_s"])

    for side in ("ours", "diffusers"):
        for stage in STAGES:
            timing = report[side][stage]
            assert positive(timing["seconds"]), (side, stage)
            # Memory is measured on CUDA only.
            assert timing["peak_bytes"] is None and timing["before_bytes"] is None, (side, stage)
        assert math.isclose(
            report[side]["total_s"], sum(report[side][stage]["seconds"] for stage in STAGES), abs_tol=2e-3
        )
    assert set(report["ratio_ours_over_diffusers"]) == {*STAGES, "total"}
    assert all(positive(ratio) for ratio in report["ratio_ours_over_diffusers"].values())

    # The same texts: our encoder sends the real tokens the pipeline pads to 1000 (Qwen) and 256 (ByT5).
    ours, theirs = report["ours"]["text_encoder"]["tokens"], report["diffusers"]["text_encoder"]["tokens"]
    assert ours["embeds"] == theirs["embeds"] > 0 and ours["glyph_embeds"] == theirs["glyph_embeds"] > 0
    assert theirs["padded_to"] == [1000, 256]
    # The same request: latents within float32 rounding, frames within a fraction of a level.
    assert report["latents_shape"] == [1, 8, 3, 3, 5] and report["latents_max_abs_difference"] <= 1e-4
    assert report["frames_shape"] == [9, 48, 80, 3] and report["frames_mean_abs_difference_levels"] <= 1.0
    assert set(report["section_wall_s"]) == {"ours", "diffusers"}


def test_without_cuda_a_real_run_fails_with_a_clear_message() -> None:
    # No GPU visible, even on a machine that has one: the real run must refuse rather than write 33 GB.
    finished = subprocess.run(
        [sys.executable, "bench/hunyuanvideo_gpu.py"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert finished.returncode != 0
    assert "needs a CUDA GPU" in finished.stderr and "--dry-run" in finished.stderr
    assert finished.stdout == ""
