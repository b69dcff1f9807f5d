"""Wan image-to-video inputs: a gradient input image, and the parallel specs and the conditioning a denoiser
takes for each."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from families.wan_i2v.denoise import WanImageToVideoDenoiser
from stagekit.denoise import DenoiseSpec


def input_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth gradient with noise: something a VAE and CLIP give distinct latents for."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    noisy = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(noisy)


PARALLEL_SPECS = {
    "wan-i2v": DenoiseSpec(64, 64, 9, 2, 5.0, 0, ("first_frame",)),
    "wan2.2-i2v-a14b": DenoiseSpec(64, 64, 9, 4, 5.0, 1, ("first_frame", "last_frame")),
    "wan2.2-ti2v": DenoiseSpec(64, 64, 9, 2, 5.0, 0, ("first_frame",)),
}


def parallel_conditioning(denoiser: WanImageToVideoDenoiser, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(spec.seed)
    conditioning = {
        "prompt_embeds": torch.randn(1, 24, denoiser.text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 24, denoiser.text_dim, generator=generator),
        "image_latents": torch.randn(denoiser.image_tensor_shape("image_latents", spec), generator=generator),
    }
    if denoiser.image_dim is not None:
        conditioning["image_embeds"] = torch.randn(len(spec.image_roles), 17, denoiser.image_dim, generator=generator)
    return conditioning
