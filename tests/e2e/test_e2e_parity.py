"""Through the running cluster, frames equal WanPipeline's for the same checkpoint and arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stagediff import Client
from stagediff.media import load_npz
from tests.helpers.references import reference_frames

pytestmark = pytest.mark.e2e

CASES = [
    # square, CFG on with a negative prompt
    dict(
        prompt="a red fox running through snow",
        negative_prompt="blurry, low quality",
        height=64,
        width=64,
        num_frames=9,
        steps=2,
        guidance=5.0,
        seed=0,
    ),
    # non-square, CFG off, more steps, another seed
    dict(
        prompt="a lighthouse at dusk",
        negative_prompt="",
        height=48,
        width=80,
        num_frames=5,
        steps=3,
        guidance=1.0,
        seed=1234,
    ),
    # tall, more frames, fractional guidance, a seed above 2**32
    dict(
        prompt="waves on a beach, aerial view",
        negative_prompt="text, watermark",
        height=80,
        width=32,
        num_frames=13,
        steps=2,
        guidance=3.5,
        seed=2**40 + 5,
    ),
    # a single frame (an image), four steps
    dict(
        prompt="a bowl of fruit on a table",
        negative_prompt="dark",
        height=32,
        width=48,
        num_frames=1,
        steps=4,
        guidance=6.0,
        seed=7,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['height']}x{c['width']}x{c['num_frames']}" for c in CASES])
def test_cluster_frames_equal_wan_pipeline(cluster, reference_pipeline, case, tmp_path: Path) -> None:
    with Client(cluster.endpoint) as client:
        result = client.generate(
            case["prompt"],
            negative_prompt=case["negative_prompt"],
            height=case["height"],
            width=case["width"],
            num_frames=case["num_frames"],
            num_inference_steps=case["steps"],
            guidance_scale=case["guidance"],
            seed=case["seed"],
        )
    frames, fps = load_npz(result.save(tmp_path / "out.npz"))
    expected = reference_frames(reference_pipeline, **case)
    assert frames.dtype == np.uint8 and frames.shape == expected.shape
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16))
    assert difference.max() <= 1, f"max difference {difference.max()} levels"
    assert fps == result.fps
    assert set(result.timings) >= {"text-encoder", "dit", "vae", "total"}


def test_cli_generate_npz_equals_pipeline(cluster, reference_pipeline, tmp_path: Path) -> None:
    case = CASES[0]
    out = tmp_path / "cli.npz"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagediff.cli",
            "generate",
            "--endpoint",
            cluster.endpoint,
            "--prompt",
            case["prompt"],
            "--negative-prompt",
            case["negative_prompt"],
            "--height",
            str(case["height"]),
            "--width",
            str(case["width"]),
            "--frames",
            str(case["num_frames"]),
            "--steps",
            str(case["steps"]),
            "--guidance",
            str(case["guidance"]),
            "--seed",
            str(case["seed"]),
            "--fps",
            "12",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    summary = json.loads(completed.stdout)
    assert summary["frames"] == case["num_frames"] and summary["fps"] == 12
    assert "dit: 2/2" in completed.stderr
    frames, fps = load_npz(out)
    assert fps == 12
    expected = reference_frames(reference_pipeline, **case)
    assert np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max() <= 1


def test_interp_exp_zero_passes_frames_through(cluster) -> None:
    arguments = dict(height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=5.0, seed=3)
    with Client(cluster.endpoint) as client:
        plain = client.generate("a cat", **arguments)
        passthrough = client.generate("a cat", interp_exp=0, **arguments)
    assert np.array_equal(plain.frames, passthrough.frames)
    assert plain.fps == passthrough.fps


@pytest.mark.parametrize("exp", [1, 2])
def test_interpolation_keeps_originals_in_place(cluster, exp: int) -> None:
    arguments = dict(height=64, width=48, num_frames=5, num_inference_steps=2, guidance_scale=5.0, seed=11, fps=8)
    with Client(cluster.endpoint) as client:
        base = client.generate("a boat", **arguments)
        dense = client.generate("a boat", interp_exp=exp, **arguments)
    assert dense.frames.shape[0] == (base.frames.shape[0] - 1) * 2**exp + 1
    assert np.array_equal(dense.frames[:: 2**exp], base.frames)
    assert dense.fps == base.fps * 2**exp
    assert "interp" in dense.timings


@pytest.mark.parametrize("suffix", [".mp4", ".png"])
def test_cli_writes_mp4_and_png(cluster, tmp_path: Path, suffix: str) -> None:
    from stagediff.media import read_video_frames

    out = tmp_path / f"out{suffix}"
    frames = "9" if suffix == ".mp4" else "1"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagediff.cli",
            "generate",
            "--endpoint",
            cluster.endpoint,
            "--prompt",
            "a tree",
            "--height",
            "64",
            "--width",
            "64",
            "--frames",
            frames,
            "--steps",
            "2",
            "--seed",
            "1",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    assert out.stat().st_size > 0
    if suffix == ".mp4":
        assert read_video_frames(out).shape == (9, 64, 64, 3)
