"""The video families beside Wan through one running cluster, each equal to its diffusers pipeline within one level:
HunyuanVideo 1.5 text-to-video (both its text encoders in one text-encoder process, its guider's CFG, its causal VAE
decoded frame by frame as the latents stream in, in row bands over two ranks), with and without guidance, and
through the interpolation stage; HunyuanVideo 1.5 image-to-video (SigLIP in its text-encoder process, the first
frame through its VAE process's Encode), its size made from the image as its pipeline makes it.

What each family does stage by stage, and every parallel layout and option on gloo, is in
tests/integration/test_family_hunyuanvideo_15.py, test_hunyuanvideo_15_decode.py and test_family_features.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance

from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.helpers.feature_mixins.base import tiny_checkpoint
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.wan_i2v import input_image

PROMPT = 'a red fox holding a sign that says "hello" trots through snow'


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """By the ids the cluster serves them under (their directories' names)."""
    root = tmp_path_factory.mktemp("video-models")
    given = {
        "hunyuanvideo-1.5": tiny_checkpoint("hunyuanvideo-1.5", tmp_path_factory),
        "hunyuanvideo-1.5-i2v": tiny_checkpoint("hunyuanvideo-1.5-i2v", tmp_path_factory),
    }
    return {name: Path(shutil.copytree(model, root / name)) for name, model in given.items()}


@pytest.fixture(scope="module")
def cluster(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(
        list(models.values()),
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=tmp_path_factory.mktemp("video-families-logs"),
        extra_args={"vae": ["--vae-patch-parallel-size", "2"]},
    )
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


def _reference(pipeline: Any, seed: int, guidance_scale: float, **arguments: Any) -> np.ndarray:
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)
    frames = pipeline(**arguments, generator=torch.Generator("cpu").manual_seed(seed), output_type="np").frames[0]
    return (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)


def _assert_close(frames: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert frames.shape == expected.shape, (what, frames.shape, expected.shape)
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max()
    print(f"{what}: {difference} levels off its pipeline")
    assert difference <= 1 and expected.std() > 1.0, what


def test_hunyuanvideo_15_cluster_equals_pipeline(cluster: LocalCluster, models: dict[str, Path]) -> None:
    """CFG with a negative prompt and glyph text in the prompt; the guider's one branch at scale 1 with the
    model's default size; the same request through the interpolation stage keeps the decoded frames in place."""
    pipeline = HunyuanVideo15Pipeline.from_pretrained(models["hunyuanvideo-1.5"])
    pipeline.set_progress_bar_config(disable=True)
    size = dict(height=48, width=80, num_frames=9, num_inference_steps=2)
    with Client(cluster.endpoint) as client:
        limits = next(model for model in client.list_models() if model.id == "hunyuanvideo-1.5").limits
        assert limits.default_guidance_scale == 6.0 and limits.temporal_factor == 4 and limits.height_multiple == 16

        result = client.generate(
            PROMPT, model="hunyuanvideo-1.5", negative_prompt="blurry", guidance_scale=6.0, seed=3, **size
        )
        expected = _reference(pipeline, 3, 6.0, prompt=PROMPT, negative_prompt="blurry", **size)
        _assert_close(result.frames, expected, "CFG 6 with a negative prompt and glyphs")

        plain = client.generate("a blue ball rolls", model="hunyuanvideo-1.5", guidance_scale=1.0, seed=5)
        default = dict(height=limits.default_height, width=limits.default_width)
        expected = _reference(
            pipeline, 5, 1.0, prompt="a blue ball rolls", num_frames=9, num_inference_steps=2, **default
        )
        _assert_close(plain.frames, expected, "one branch at the model's default size")

        doubled = client.generate(
            "a blue ball rolls", model="hunyuanvideo-1.5", guidance_scale=1.0, seed=5, interp_exp=1
        )
    assert doubled.frames.shape[0] == 2 * plain.frames.shape[0] - 1
    np.testing.assert_array_equal(doubled.frames[::2], plain.frames)


def test_hunyuanvideo_15_i2v_cluster_equals_pipeline(cluster: LocalCluster, models: dict[str, Path]) -> None:
    """A 100x70 first frame gives the 64x48 video the pipeline makes of it (the tiny model's crop bucket), equal to
    the pipeline's within one level; a size other than the image's is refused naming the field, the image's own is
    taken; the interpolation stage keeps the decoded frames in place."""
    pipeline = HunyuanVideo15ImageToVideoPipeline.from_pretrained(models["hunyuanvideo-1.5-i2v"])
    pipeline.set_progress_bar_config(disable=True)
    frame = input_image(100, 70, 3)
    arguments = dict(num_frames=9, num_inference_steps=2)
    with Client(cluster.endpoint) as client:
        result = client.generate(
            PROMPT, model="hunyuanvideo-1.5-i2v", image=frame, negative_prompt="blurry", seed=4, **arguments
        )
        expected = _reference(pipeline, 4, 6.0, image=frame, prompt=PROMPT, negative_prompt="blurry", **arguments)
        _assert_close(result.frames, expected, "image-to-video, CFG 6")
        job = client.get_job(result.job_id)
        assert (job.request.width, job.request.height) == (64, 48) and job.timings["vae-encode"] > 0

        with pytest.raises(StageDiffError) as refused:
            client.generate(PROMPT, model="hunyuanvideo-1.5-i2v", image=frame, height=64, width=64, **arguments)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "height: 64; this model makes the size from images[0] (100x70: 64x48)" in str(refused.value)
        same = client.generate(
            PROMPT, model="hunyuanvideo-1.5-i2v", image=frame, height=48, width=64, seed=4, negative_prompt="blurry",
            interp_exp=1, **arguments,
        )  # fmt: skip
    assert same.frames.shape[0] == 2 * result.frames.shape[0] - 1
    np.testing.assert_array_equal(same.frames[::2], result.frames)
