"""Streaming Wan VAE decode: one latent frame in, its video frames out.

AutoencoderKLWan's decoder is causal in time: it decodes latent frame t from
frame t and a cache of features from earlier frames. `AutoencoderKLWan.decode`
runs that loop over the whole latent video and concatenates the result; here a
`DecodeSession` holds the cache for one request and runs one iteration per
latent frame as it arrives, so the first frames leave the stage while later
latent frames are still being denoised into the stream. The arithmetic is the
library's own decoder, applied in the same order, so the frames match
WanPipeline's (latents denormalised the same way, clamped to [-1, 1], mapped to
[0, 1] as its video processor does).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify

from services.weights import load_pretrained


class WanStreamingDecoder:
    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = 4) -> None:
        self.device = device
        self.vae = load_pretrained(
            AutoencoderKLWan, Path(model_dir) / "vae", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        config = self.vae.config
        self.latent_channels = config.z_dim
        self.latents_mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
        # WanPipeline divides by 1/std rather than multiplying by std; do the same for identical rounding.
        self.latents_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
        self.num_cached_convs = sum(isinstance(m, WanCausalConv3d) for m in self.vae.decoder.modules())

    def session(self) -> DecodeSession:
        return DecodeSession(self)


class DecodeSession:
    """The causal feature cache of one request's decode."""

    def __init__(self, decoder: WanStreamingDecoder) -> None:
        self.decoder = decoder
        self.feature_cache: list = [None] * decoder.num_cached_convs
        self.frames_decoded = 0
        self.latent_frames_seen = 0

    @torch.no_grad()
    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (float32, normalised) to uint8 frames [n, H, W, 3]."""
        owner = self.decoder
        vae = owner.vae
        latents = latent_frame.to(owner.device, vae.dtype)
        latents = denormalize_latents(latents, owner.latents_mean, owner.latents_std)
        x = vae.post_quant_conv(latents)
        first = self.latent_frames_seen == 0
        out = vae.decoder(x, feat_cache=self.feature_cache, feat_idx=[0], first_chunk=first)
        if vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=vae.config.patch_size)
        out = torch.clamp(out, min=-1.0, max=1.0)
        self.latent_frames_seen += 1
        frames = to_uint8_frames(out)
        self.frames_decoded += frames.shape[0]
        return frames


def denormalize_latents(latents: torch.Tensor, latents_mean: torch.Tensor, latents_std: torch.Tensor) -> torch.Tensor:
    """Undoes the VAE's latent normalisation as the diffusers pipelines do (`latents_std` holds 1/std)."""
    mean = latents_mean.to(latents.device, latents.dtype)
    std = latents_std.to(latents.device, latents.dtype)
    return latents / std + mean


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """[1, 3, n, H, W] in [-1, 1] -> uint8 [n, H, W, 3], as VideoProcessor.postprocess_video then x*255 rounded."""
    video = (video.float() / 2 + 0.5).clamp(0, 1)
    return (video[0].permute(1, 2, 3, 0) * 255).round().to(torch.uint8).cpu()
