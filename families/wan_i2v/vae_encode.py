"""The VAE stage's Encode for Wan image-to-video: the input frames' latents, as WanImageToVideoPipeline makes them.

`prepare_latents` of the pipeline, less the noise and the mask (the DiT draws the noise and builds the mask,
families/wan_i2v/denoise.py): each image is resized to the output size by the pipeline's VideoProcessor,
then encoded with the served AutoencoderKLWan, the mode of its latent distribution taken and normalised
with the VAE's latents_mean and latents_std. Wan2.1 and Wan2.2 A14B encode a whole video of the output's
frame count, the first frame (and the last, when sent) with zeros between, so that the latents have the
DiT's frame count; Wan2.2 TI2V (`expand_timesteps`) encodes the first frame alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
from diffusers.video_processor import VideoProcessor

from stagekit.decode import LatentDecoder
from stagekit.images import DecodedImage

LATENTS_NAME = "image_latents"


class WanImageLatentEncoder:
    """Encodes a request's input frames with the VAE stage's decoder's VAE (the same weights)."""

    def __init__(self, model_dir: str | Path) -> None:
        index = json.loads((Path(model_dir) / "model_index.json").read_text())
        self.expand_timesteps = bool(index.get("expand_timesteps", False))

    def __call__(
        self, decoder: LatentDecoder, images: list[DecodedImage], height: int, width: int, num_frames: int
    ) -> dict[str, torch.Tensor]:
        return encode_images(decoder, images, height, width, num_frames, self.expand_timesteps)


@torch.no_grad()
def encode_images(
    decoder: LatentDecoder, images: list[DecodedImage], height: int, width: int, num_frames: int, expand_timesteps: bool
) -> dict[str, torch.Tensor]:
    """{"image_latents": float32 [1, z_dim, T, height / s, width / s]} of the first (and last) frame.

    T is the latent frame count of `num_frames` frames, or 1 with `expand_timesteps`.
    """
    vae = decoder.vae
    processor = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial)
    frames = {item.role: processor.preprocess(item.image, height=height, width=width) for item in images}
    first = frames["first_frame"].to(decoder.device, torch.float32).unsqueeze(2)  # [1, 3, 1, H, W]
    if expand_timesteps:
        video = first
    else:
        last = frames.get("last_frame")
        between = num_frames - 1 if last is None else num_frames - 2
        parts = [first, first.new_zeros(1, 3, between, height, width)]
        if last is not None:
            parts.append(last.to(decoder.device, torch.float32).unsqueeze(2))
        video = torch.cat(parts, dim=2)
    latents = retrieve_latents(vae.encode(video.to(decoder.device, vae.dtype)), sample_mode="argmax")
    latents = latents.to(decoder.device, torch.float32)
    mean = decoder.latents_mean.to(latents.device, torch.float32)
    inverse_std = decoder.latents_std.to(latents.device, torch.float32)  # LatentDecoder keeps 1/std
    return {LATENTS_NAME: ((latents - mean) * inverse_std).cpu()}
