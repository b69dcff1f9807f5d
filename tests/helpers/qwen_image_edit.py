"""The Qwen-Image-Edit parallel cases: the specs and the conditioning a denoiser takes for each."""

from __future__ import annotations

import torch

from families.qwen_image_edit.denoise import QwenImageEditDenoiser
from families.qwen_image_edit.family import QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS
from stagekit.denoise import DenoiseSpec

EDIT, PLUS = QWEN_IMAGE_EDIT.name, QWEN_IMAGE_EDIT_PLUS.name


# 48x80 packs into 3x5 = 15 noise tokens and the images into 76x54 (and 42x98): an odd sequence, padded for
# Ulysses; the negative prompt's embeddings are masked.
PARALLEL_SPECS = {
    EDIT: DenoiseSpec(48, 80, 1, 2, 4.0, 0, ("reference",), ((56, 40),)),
    PLUS: DenoiseSpec(48, 80, 1, 2, 4.0, 1, ("reference", "reference"), ((56, 40), (30, 70))),
}


def parallel_conditioning(denoiser: QwenImageEditDenoiser, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(spec.seed)
    negative_mask = torch.ones(1, 24, dtype=torch.long)
    negative_mask[:, 17:] = 0
    return {
        "prompt_embeds": torch.randn(1, 21, denoiser.text_dim, generator=generator),
        "negative_prompt_embeds": torch.randn(1, 24, denoiser.text_dim, generator=generator),
        "negative_prompt_embeds_mask": negative_mask,
        "image_latents": torch.randn(denoiser.image_tensor_shape("image_latents", spec), generator=generator),
    }
