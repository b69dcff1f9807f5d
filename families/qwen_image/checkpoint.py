"""The geometry of a Qwen-Image checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An image model: 2x2 patches over the latent image (an int patch_size), VAE latents of z_dim channels,
    one frame; QwenImagePipeline refuses max_sequence_length above 1024."""
    vae, transformer = configs["vae"], configs["transformer"]
    temporal_downsample = vae.get("temperal_downsample", [False, True, True])
    patch = transformer.get("patch_size", 2)
    return {
        "vae_scale_spatial": 2 ** len(temporal_downsample),
        "vae_scale_temporal": 2 ** sum(temporal_downsample),
        "patch_size": (1, patch, patch),
        "latent_channels": vae.get("z_dim", 16),
        "max_frames": 1,
        "sequence_length_limit": 1024,
    }
