"""QwenImagePipeline's images for the Qwen cases, and a cluster's images for the same cases, to compare."""

from __future__ import annotations

import numpy as np
import torch

from stagediff import Client


def qwen_reference(pipeline, *, prompt, negative_prompt, height, width, steps, guidance, seed) -> np.ndarray:
    """QwenImagePipeline's image for the arguments (guidance = true_cfg_scale) as uint8 [1, H, W, 3]."""
    images = pipeline(
        prompt,
        negative_prompt=negative_prompt,
        true_cfg_scale=guidance,
        height=height,
        width=width,
        num_inference_steps=steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).images
    return (np.clip(images, 0, 1) * 255).round().astype(np.uint8)


def generate(endpoint: str, case: dict, api_key: str | None = None, **extra) -> np.ndarray:
    """The cluster's image for a case; `extra`: more request options (model=)."""
    with Client(endpoint, api_key=api_key) as client:
        result = client.generate(
            case["prompt"],
            **extra,
            negative_prompt=case["negative_prompt"],
            height=case["height"],
            width=case["width"],
            num_frames=case.get("num_frames", 1),
            num_inference_steps=case["steps"],
            guidance_scale=case["guidance"],
            seed=case["seed"],
        )
    return result.frames


def assert_close(frames: np.ndarray, expected: np.ndarray) -> None:
    assert frames.dtype == np.uint8 and frames.shape == expected.shape, (frames.shape, expected.shape)
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16))
    assert difference.max() <= 1, f"max difference {difference.max()} levels"
    assert expected.std() > 1.0, "the reference is flat: the comparison would prove little"


QWEN_CASES = [
    # square, true CFG with a negative prompt
    dict(
        prompt="a red fox running through snow",
        negative_prompt="blurry, low quality",
        height=64,
        width=64,
        steps=2,
        guidance=4.0,
        seed=0,
    ),
    # non-square, CFG off, more steps, another seed
    dict(prompt="a lighthouse at dusk", negative_prompt="", height=48, width=80, steps=3, guidance=1.0, seed=1234),
    # tall, a negative prompt longer than the prompt (the prompt's embeddings travel padded), a seed above 2**32
    dict(
        prompt="waves",
        negative_prompt="text, watermark, jpeg artifacts, extra fingers, worst quality",
        height=80,
        width=32,
        steps=2,
        guidance=2.5,
        seed=2**40 + 5,
    ),
    # CFG with an empty negative prompt, as the pipeline runs it when negative_prompt="" is given
    dict(
        prompt="a bowl of fruit on a wooden table",
        negative_prompt="",
        height=32,
        width=48,
        steps=4,
        guidance=6.0,
        seed=7,
    ),
]
