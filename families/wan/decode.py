"""Streaming Wan VAE decode: one latent frame in, its video frames out.

AutoencoderKLWan's decoder is causal in time: it decodes latent frame t from
frame t and a cache of features from earlier frames. `AutoencoderKLWan.decode`
runs that loop over the whole latent video and concatenates the result; here a
`WanDecodeSession` holds the cache for one request and runs one iteration per
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

from stagekit.decode import LatentDecoder, denormalize_latents, to_uint8_frames


class WanStreamingDecoder(LatentDecoder):
    vae_class = AutoencoderKLWan

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = 4) -> None:
        super().__init__(model_dir, device, dtype, load_threads)
        self.num_cached_convs = sum(isinstance(m, WanCausalConv3d) for m in self.vae.decoder.modules())

    def session(self) -> WanDecodeSession:
        return WanDecodeSession(self)


class WanDecodeSession:
    """The causal feature cache of one request's decode."""

    def __init__(self, decoder: WanStreamingDecoder) -> None:
        self.decoder = decoder
        self.feature_cache: list = [None] * decoder.num_cached_convs
        self.frames_decoded = 0
        self.latent_frames_seen = 0

    @torch.no_grad()
    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to the clamped decoder output [1, 3, n, H, W]."""
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
        self.frames_decoded += out.shape[2]
        return out

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (float32, normalised) to uint8 frames [n, H, W, 3]."""
        return to_uint8_frames(self.decode_next_float(latent_frame))
