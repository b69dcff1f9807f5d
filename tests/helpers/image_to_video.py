"""What the image-conditioned end-to-end tests share: encoded input images, the frame tolerance and the
parallel layouts they run."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from diffusers.utils import load_image
from PIL import Image

from stagediff import Client
from stagediff.local.supervisor import LocalCluster
from stagediff.v1 import generation_pb2


def encoded(image: Image.Image, format: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def assert_close(frames: np.ndarray, expected: np.ndarray) -> None:
    assert frames.dtype == np.uint8 and frames.shape == expected.shape, (frames.shape, expected.shape)
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16))
    assert difference.max() <= 1, f"max difference {difference.max()} levels"
    assert expected.std() > 1.0, "the reference is flat: the comparison would prove little"


# Ulysses and CFG-parallel run in every family's test, HSDP (sharded over the Ulysses ranks) and tensor
# parallelism here; the VAE decodes in bands over two ranks and encodes on its rank 0.
PATCH_PARALLEL_VAE = ["--vae-patch-parallel-size", "2"]


# 4 DiT ranks, the weights sharded over two of them and replicated over the other two.
ULYSSES_CFG_HSDP = [
    *("--ulysses-degree", "2", "--cfg-parallel-size", "2"),
    *("--use-hsdp", "--hsdp-shard-size", "2", "--hsdp-replicate-size", "2"),
]


def reference(model_dir: Path, case: dict) -> np.ndarray:
    """The diffusers pipeline's frames for a case, from the images as the server decodes them, uint8."""
    images = {role: load_image(Image.open(io.BytesIO(data))) for role, data in case.get("images", {}).items()}
    arguments = dict(
        prompt=case["prompt"],
        negative_prompt=case.get("negative_prompt", ""),
        height=case["height"],
        width=case["width"],
        num_frames=case["num_frames"],
        num_inference_steps=case["steps"],
        guidance_scale=case["guidance"],
        generator=torch.Generator("cpu").manual_seed(case["seed"]),
        output_type="np",
    )
    if images:
        pipeline = WanImageToVideoPipeline.from_pretrained(model_dir)
        output = pipeline(image=images["first"], last_image=images.get("last"), **arguments)
    else:
        output = WanPipeline.from_pretrained(model_dir)(**arguments)
    return (np.clip(output.frames[0], 0, 1) * 255).round().astype(np.uint8)


def generate(endpoint: str, case: dict, api_key: str | None = None, **extra) -> tuple[np.ndarray, generation_pb2.Job]:
    images = case.get("images", {})
    with Client(endpoint, api_key=api_key) as client:
        result = client.generate(
            case["prompt"],
            negative_prompt=case.get("negative_prompt", ""),
            height=case["height"],
            width=case["width"],
            num_frames=case["num_frames"],
            num_inference_steps=case["steps"],
            guidance_scale=case["guidance"],
            seed=case["seed"],
            image=images.get("first"),
            last_image=images.get("last"),
            **extra,
        )
        job = client.get_job(result.job_id)
    return result.frames, job


def check_cases(cluster: LocalCluster, model_dir: Path, cases: list[dict], **extra) -> None:
    """Each case's frames equal the pipeline's; `extra`: what `generate` takes besides (model=, api_key=)."""
    for case in cases:
        frames, job = generate(cluster.endpoint, case, **extra)
        assert_close(frames, reference(model_dir, case))
        # The job records the images it used (digest and size), not their bytes, and the size it made.
        assert [image.data for image in job.request.images] == [b""] * len(case.get("images", {}))
        assert all(image.sha256 and image.width > 0 for image in job.request.images)
        assert (job.request.height, job.request.width) == (case["height"], case["width"])
        if case.get("images"):
            assert job.timings["vae-encode"] > 0
