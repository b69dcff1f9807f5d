"""The geometry of a Qwen-Image 2.1 checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any

# QwenImage21Pipeline does not truncate the Qwen3-VL sequence; the DiT takes embeddings up to this many tokens.
SEQUENCE_LENGTH_LIMIT = 32768


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An image model: AutoencoderKLQwenImage21 latents of z_dim channels at the VAE's scale_factor_spatial (16),
    taken unpatched by the transformer, one frame. The sides must be multiples of 2 latent rows (32 pixels, the
    pipeline's `multiple_of`): each of the text encoder's image slots stands for a 2x2 group of latent tokens,
    so the patch size the request's size is checked against is 2x2."""
    vae = configs["vae"]
    return {
        "vae_scale_spatial": int(vae.get("scale_factor_spatial", 16)),
        "vae_scale_temporal": 1,
        "patch_size": (1, 2, 2),
        "latent_channels": vae.get("z_dim", 64),
        "max_frames": 1,
        "sequence_length_limit": SEQUENCE_LENGTH_LIMIT,
    }
