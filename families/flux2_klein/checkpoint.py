"""The geometry of a FLUX.2 klein checkpoint, read from its JSON configs (no torch).

The stages exchange the latents as the transformer sees them: AutoencoderKLFlux2's latents (8x spatially) already
patchified 2x2 into `4 * latent_channels` channels and normalised by the VAE's batch-norm statistics, one latent
row per 16 pixels. So the geometry's spatial factor is 16 and its patch is 1x1; the VAE stage de-normalises and
unpatchifies them (decode.py).
"""

from __future__ import annotations

from typing import Any

from families.base import RequestDefaults

# FLUX.2-klein (step-distilled) as its model card runs it: 4 steps, no guidance (the pipeline ignores it).
DISTILLED_DEFAULTS = RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=4, guidance_scale=1.0)
# FLUX.2-klein-base: Flux2KleinPipeline's defaults, 50 steps with CFG 4.
BASE_DEFAULTS = RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=50, guidance_scale=4.0)
# Flux2KleinPipeline.tokenizer_max_length and its max_sequence_length default.
MAX_SEQUENCE_LENGTH = 512


def is_distilled(model_index: dict[str, Any]) -> bool:
    """Flux2KleinPipeline's `is_distilled` (False when model_index.json leaves it out, the pipeline's default)."""
    return bool(model_index.get("is_distilled", False))


def vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """Flux2KleinPipeline.vae_scale_factor: 2 ** (len(block_out_channels) - 1), before the 2x2 patches."""
    levels: list[int] = vae_config.get("block_out_channels", [128, 256, 512, 512])
    return int(2 ** (len(levels) - 1))


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An image model: 2x2 patchified AutoencoderKLFlux2 latents (`4 * latent_channels` channels, 16 pixels per
    latent row at the published size), one frame, Qwen3 sequences of at most 512 tokens; the defaults of the
    checkpoint's kind (model_index.json's `is_distilled`)."""
    vae = configs["vae"]
    patch = vae.get("patch_size", [2, 2])
    return {
        "vae_scale_spatial": vae_scale_factor(vae) * patch[0],
        "vae_scale_temporal": 1,
        "patch_size": (1, 1, 1),
        "latent_channels": vae.get("latent_channels", 32) * patch[0] * patch[1],
        "max_frames": 1,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "sequence_length_limit": MAX_SEQUENCE_LENGTH,
        "defaults": DISTILLED_DEFAULTS if is_distilled(configs.get("model_index", {})) else BASE_DEFAULTS,
    }
