"""The geometry of a Z-Image checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any

from families.base import RequestDefaults

# ZImagePipeline's defaults, the base model's: 1024x1024, 50 steps, guidance 5.
BASE_DEFAULTS = RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=50, guidance_scale=5.0)
# Z-Image-Turbo as its model card runs it: guidance 0 (distilled, no CFG) and 8 transformer passes. The card says
# num_inference_steps=9 for "8 DiT forwards", written for an earlier ZImagePipeline; the pinned one (0.42.1) runs
# one forward per step (its sigmas end at 1/steps), so 8 steps are the 8 passes the model was distilled for.
TURBO_DEFAULTS = RequestDefaults(height=1024, width=1024, num_frames=1, num_inference_steps=8, guidance_scale=0.0)
# The scheduler shift Z-Image-Turbo ships (scheduler_config.json: shift 3.0, no dynamic shifting); the base model
# ships another. The transformer, VAE and text encoder configs of the two are the same.
TURBO_SHIFT = 3.0
# ZImageTransformer2DModel pads the caption to a multiple of this many tokens (its SEQ_MULTI_OF).
CAPTION_MULTIPLE = 32


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An image model: 2x2 patches over the latent image, AutoencoderKL latents (8x spatially, one per
    `block_out_channels` level after the first), one frame, prompts of at most 512 tokens by default.

    The caption's rotary positions run from 1 to its padded length, and the image's start after it, all within
    the first rotary axis (`axes_lens[0]`): the longest sequence the text encoder may be asked for is the largest
    multiple of 32 that leaves room for the image's position.
    """
    vae, transformer, scheduler = configs["vae"], configs["transformer"], configs["scheduler"]
    patch = transformer.get("all_patch_size", [2])[0]
    caption_positions = transformer.get("axes_lens", [1024, 512, 512])[0]
    turbo = float(scheduler.get("shift", 1.0)) == TURBO_SHIFT
    return {
        "vae_scale_spatial": 2 ** (len(vae.get("block_out_channels", [128, 256, 512, 512])) - 1),
        "vae_scale_temporal": 1,
        "patch_size": (1, patch, patch),
        "latent_channels": vae.get("latent_channels", 16),
        "max_frames": 1,
        "max_sequence_length": 512,
        "sequence_length_limit": (caption_positions - 2) // CAPTION_MULTIPLE * CAPTION_MULTIPLE,
        "defaults": TURBO_DEFAULTS if turbo else BASE_DEFAULTS,
        # ZImageTransformer2DModel names its heads n_heads.
        "attention_heads": transformer.get("n_heads", 30),
    }
