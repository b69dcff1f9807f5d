"""MagCache's calibration (`stagediff calibrate-cache`) and what the DiT offers from it: the command writes
one ratio per step of each branch into the checkpoint, the DiT then offers `mag` with those ratios, and the
step cache flags a checkpoint cannot honour are refused at startup naming the flag."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dit_svc.cache_offer import MAG_RATIOS_FILE
from dit_svc.config import DitConfig
from dit_svc.denoise import denoise_request
from families.base import DEFAULT_CACHE_THRESHOLDS
from families.wan.denoise import WanDenoiser
from stagekit.denoise import CacheSpec, DenoiseSpec
from tests.helpers.serving import parse_serve

STEPS = 6
SPEC = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=STEPS, guidance_scale=4.0, seed=2)


@pytest.fixture(scope="module")
def calibrated_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("calibrated") / "tiny"
    shutil.copytree(tiny_model, model)
    completed = subprocess.run(
        [sys.executable, "-m", "stagediff.cli", "calibrate-cache", "--model", str(model), "--steps", str(STEPS),
         "--height", "48", "--width", "80", "--frames", "5", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == str(model / MAG_RATIOS_FILE)
    return model


def _conditioning(text_dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
    }


def test_calibrated_ratios_make_the_dit_offer_mag(calibrated_model: Path) -> None:
    document = json.loads((calibrated_model / MAG_RATIOS_FILE).read_text())
    ratios = document["ratios"]["transformer"]
    assert document["num_inference_steps"] == STEPS
    assert {branch: len(values) for branch, values in ratios.items()} == {"cond": STEPS, "uncond": STEPS}
    assert all(value > 0 for values in ratios.values() for value in values)

    offer = DitConfig.from_args(
        parse_serve(["dit", "--model", str(calibrated_model), "--cache-backend", "mag"])
    ).step_cache
    assert offer.thresholds == DEFAULT_CACHE_THRESHOLDS
    assert (offer.default.method, offer.default.threshold) == ("mag", DEFAULT_CACHE_THRESHOLDS["mag"])
    assert offer.mag_ratios == {"transformer": ratios["cond"]}

    # With those ratios a request at a higher threshold skips passes, and a request of another step count
    # runs too (diffusers resamples the ratios).
    denoiser = WanDenoiser(calibrated_model, torch.device("cpu"), torch.float32)
    conditioning = _conditioning(denoiser.text_dim)
    for steps in (STEPS, STEPS + 4):
        spec = dataclasses.replace(SPEC, num_inference_steps=steps, cache=CacheSpec("mag", 0.5))
        _, passes = denoise_request(
            denoiser, spec, conditioning, lambda s, t: None, lambda: False, mag_ratios=offer.mag_ratios
        )
        assert passes.skipped > 0 and passes.run + passes.skipped == 2 * steps, (steps, passes)
