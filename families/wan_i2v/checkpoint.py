"""The geometry of a Wan image-to-video checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any

from families.wan.checkpoint import read_geometry as read_wan_geometry


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Wan's geometry (families/wan/checkpoint.py); the latent channels are the VAE's, since an I2V
    transformer takes more input channels (noise, mask and image latents) than it denoises.

    A first-last-frame checkpoint (Wan2.1 FLF2V: its image embedder has position embeddings for two
    images, `pos_embed_seq_len`) requires the last frame as well as the first.
    """
    geometry = read_wan_geometry(configs)
    transformer = configs["transformer"]
    geometry["latent_channels"] = transformer.get("out_channels", configs["vae"].get("z_dim", 16))
    if transformer.get("image_dim") is not None:
        if transformer.get("pos_embed_seq_len") is not None:
            geometry["image_roles"] = geometry["required_image_roles"] = ("first_frame", "last_frame")
        else:
            # One CLIP image embedding: WanImageToVideoPipeline's last_image needs the FLF2V embedder.
            geometry["image_roles"] = geometry["required_image_roles"] = ("first_frame",)
    return geometry
