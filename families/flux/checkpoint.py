"""The geometry of a FLUX.1 checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any

from families.base import RequestDefaults

# FluxPipeline's defaults: 1024x1024, 28 steps, guidance 3.5 (embedded in FLUX.1-dev), true CFG off.
DEV_DEFAULTS = RequestDefaults(
    height=1024, width=1024, num_frames=1, num_inference_steps=28, guidance_scale=1.0, embedded_guidance_scale=3.5
)
# FLUX.1-schnell, as its model card runs it: 4 steps, no guidance of either kind (it has no guidance embedding).
SCHNELL_DEFAULTS = RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=4, guidance_scale=1.0)


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An image model: 2x2 patches packed over the latent image, AutoencoderKL latents (8x spatially, one per
    `block_out_channels` level after the first), one frame, T5 sequences of at most 512 tokens.

    FLUX.1-dev and FLUX.1-schnell share FluxPipeline and every config key but the transformer's
    `guidance_embeds` (dev's guidance distillation): that decides the defaults, and schnell's 256-token T5 limit.
    """
    vae, transformer = configs["vae"], configs["transformer"]
    guidance_distilled = bool(transformer.get("guidance_embeds", False))
    return {
        "vae_scale_spatial": 2 ** (len(vae.get("block_out_channels", [128, 256, 512, 512])) - 1),
        "vae_scale_temporal": 1,
        "patch_size": (1, 2, 2),
        "latent_channels": vae.get("latent_channels", 16),
        "max_frames": 1,
        "max_sequence_length": 512 if guidance_distilled else 256,
        "sequence_length_limit": 512,
        "defaults": DEV_DEFAULTS if guidance_distilled else SCHNELL_DEFAULTS,
        "embedded_guidance": guidance_distilled,
    }
