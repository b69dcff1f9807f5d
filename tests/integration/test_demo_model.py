"""The trained demo model: the committed checkpoint loads unchanged in diffusers, `init-model --preset demo`
copies it, diffusers' video shows what the prompt says, and the training script runs end to end."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from families.init_model import init_model
from shapeworld.demo_model import CHECKPOINT, DEFAULT_REQUEST, FLOW_SHIFT
from shapeworld.score import ATTRIBUTES, read_video, score
from shapeworld.world import parse_prompt
from tests.helpers.demo_model import PROMPTS, diffusers_frames

ROOT = Path(__file__).resolve().parents[2]


def test_committed_checkpoint_is_a_plain_wan_checkpoint(demo_pipeline) -> None:
    from diffusers import AutoencoderKLWan

    index = json.loads((CHECKPOINT / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert type(getattr(demo_pipeline, name)).__name__ == index[name][1]
    assert demo_pipeline.scheduler.config.flow_shift == FLOW_SHIFT
    # The latent statistics are the trained autoencoder's own, not the class defaults.
    signature = inspect.signature(AutoencoderKLWan.__init__).parameters
    assert demo_pipeline.vae.config.latents_mean != signature["latents_mean"].default
    assert all(std > 0 for std in demo_pipeline.vae.config.latents_std)
    record = json.loads((CHECKPOINT / "training.json").read_text())
    assert record["command"].startswith("python scripts/train_demo_model.py") and record["seed"] == 0
    weights = sum(path.stat().st_size for path in CHECKPOINT.rglob("*.safetensors"))
    assert weights < 16 * 2**20, f"the committed weights are {weights} bytes"


def test_diffusers_video_shows_what_the_prompt_says(demo_pipeline) -> None:
    """The committed model's video through diffusers reads right on every attribute (the fractions over the
    whole evaluation set are in BENCHMARKS.md, measured by bench/demo_quality.py)."""
    prompt, seed = PROMPTS[0]
    frames = diffusers_frames(demo_pipeline, prompt, seed)
    assert frames.shape == (DEFAULT_REQUEST["num_frames"], DEFAULT_REQUEST["height"], DEFAULT_REQUEST["width"], 3)
    assert score(read_video(frames), parse_prompt(prompt)) == {name: True for name in ATTRIBUTES}
    # Not noise: neighbouring pixels differ by about 2 levels on average here (85 in uniform noise).
    assert np.abs(np.diff(frames.astype(int), axis=2)).mean() < 10


def test_init_model_demo_preset_copies_the_checkpoint(tmp_path: Path) -> None:
    out = init_model("wan-t2v", "demo", tmp_path / "demo")
    for path in CHECKPOINT.rglob("*"):
        if path.is_file():
            assert (out / path.relative_to(CHECKPOINT)).read_bytes() == path.read_bytes(), path
    with pytest.raises(ValueError, match="unknown preset 'demo' for qwen-image; allowed: tiny, small"):
        init_model("qwen-image", "demo", tmp_path / "qwen")
    with pytest.raises(ValueError, match="trained weights"):
        init_model("wan-t2v", "demo", tmp_path / "seeded", seed=3)
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagediff.cli",
            "init-model",
            "--family",
            "qwen-image",
            "--preset",
            "demo",
            "--out",
            str(tmp_path / "q"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert cli.returncode == 2 and "allowed: tiny, small" in cli.stderr


def run_training_script(*args: str) -> subprocess.CompletedProcess:
    """scripts/train_demo_model.py run with `args`, its output captured."""
    return subprocess.run(
        [sys.executable, "scripts/train_demo_model.py", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def train_quick(*args: str) -> None:
    """Runs scripts/train_demo_model.py with `args` and checks it succeeded."""
    run = run_training_script(*args)
    assert run.returncode == 0, run.stderr[-3000:]


def test_training_script_runs_every_phase_and_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    from diffusers import WanPipeline

    out = tmp_path / "quick"
    train_quick("--out", str(out), "--quick", "--threads", "1")
    phases = {json.loads(line)["phase"] for line in (out / "training_log.jsonl").read_text().splitlines()}
    assert phases == {"vae", "dit"}
    record = json.loads((out / "training.json").read_text())
    assert set(record["final_losses"]) == {"vae", "dit"} and record["command"].endswith("--quick --threads 1")
    assert all(np.isfinite(value) for value in record["final_losses"]["vae"].values())
    pipeline = WanPipeline.from_pretrained(out)
    pipeline.set_progress_bar_config(disable=True)
    frames = pipeline(
        prompt="a red circle moving right on a dark background",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
    ).frames
    assert frames.shape == (1, 5, 32, 32, 3) and np.isfinite(frames).all()

    # --vae-from keeps that autoencoder (its weights, and where it came from) and trains the rest again.
    again = tmp_path / "again"
    train_quick("--out", str(again), "--quick", "--vae-from", str(out))
    phases = {json.loads(line)["phase"] for line in (again / "training_log.jsonl").read_text().splitlines()}
    assert phases == {"dit"}
    kept = json.loads((again / "training.json").read_text())
    assert kept["vae_from"]["command"] == record["command"] and "vae_schedule" not in kept
    assert kept["final_losses"]["vae"] == record["final_losses"]["vae"]
    weights = [load_file(path / "vae" / "diffusion_pytorch_model.safetensors") for path in (out, again)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def test_autoencoder_ceiling_benchmark_reads_renders_and_reconstructions() -> None:
    """bench/demo_autoencoder.py: the rendered scenes read right on every attribute (else the ceiling it
    reports would be the check's, not the autoencoder's), and every reconstruction is scored."""
    run = subprocess.run(
        [
            sys.executable,
            "bench/demo_autoencoder.py",
            "--limit",
            "3",
            "--frames",
            "9",
            "--seeds",
            "0",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["rendered"] == {**{name: 1.0 for name in ATTRIBUTES}, "all": 1.0, "videos": 3}
    assert result["reconstructed"]["videos"] == 3 and result["frames_shape"] == [9, 64, 64, 3]
    wrong = sum(len(miss["wrong"]) for miss in result["misses"])
    right = sum(result["reconstructed"][name] * 3 for name in ATTRIBUTES)
    assert round(right) + wrong == 3 * len(ATTRIBUTES)


def test_training_refuses_to_reuse_the_autoencoder_of_the_checkpoint_it_overwrites(tmp_path: Path) -> None:
    from shapeworld.demo_model import train

    with pytest.raises(ValueError, match="vae_from must be another checkpoint than out"):
        train(tmp_path / "demo", vae_from=tmp_path / "demo")
    assert not (tmp_path / "demo").exists()
    # And the script names the flag when the directory holds no trained autoencoder.
    run = run_training_script("--out", str(tmp_path / "x"), "--vae-from", str(tmp_path))
    assert run.returncode == 2 and "--vae-from" in run.stderr and "no vae or training.json" in run.stderr
