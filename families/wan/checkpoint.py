"""The geometry of a Wan checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """VAE and patch factors and latent channels: the CheckpointSpec fields that decide valid sizes."""
    vae, transformer = configs["vae"], configs["transformer"]
    temporal_downsample = vae.get("temperal_downsample", [False, True, True])
    return {
        "vae_scale_spatial": vae.get("scale_factor_spatial", 2 ** len(temporal_downsample)),
        "vae_scale_temporal": vae.get("scale_factor_temporal", 2 ** sum(temporal_downsample)),
        "patch_size": tuple(transformer.get("patch_size", (1, 2, 2))),
        "latent_channels": transformer.get("in_channels", vae.get("z_dim", 16)),
    }
