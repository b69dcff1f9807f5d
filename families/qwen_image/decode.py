"""Qwen-Image VAE decode: the one latent frame of an image in, its frame out.

The DiT sends the latents unpacked to [1, C, 1, h, w], the same per-frame layout as Wan's, so the
stream and its checks are shared. Decoding is QwenImagePipeline's: latents cast to the VAE's dtype,
denormalised with the VAE config's latents_mean / latents_std (dividing by 1/std, as the pipeline
does, for identical rounding), `AutoencoderKLQwenImage.decode` (which clamps to [-1, 1]), then mapped
to [0, 1] as its image processor does.

With --vae-patch-parallel-size N, vae_svc/patch_parallel.py runs this session on each rank's band of latent
rows (the decoder's spatial convolutions exchanging halo rows, its mid-block attention gathering keys and
values of the whole frame) and gathers the bands: the same decode, split by rows.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLQwenImage

from stagekit.decode import LatentDecoder, denormalize_latents, to_uint8_frames


class QwenImageDecoder(LatentDecoder):
    vae_class = AutoencoderKLQwenImage

    def session(self) -> QwenDecodeSession:
        return QwenDecodeSession(self)


class QwenDecodeSession:
    """One request's decode; an image has a single latent frame, so nothing carries between calls."""

    def __init__(self, decoder: QwenImageDecoder) -> None:
        self.decoder = decoder
        self.frames_decoded = 0

    @torch.no_grad()
    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to the decoded image [1, 3, 1, H, W] in [-1, 1]."""
        owner = self.decoder
        vae = owner.vae
        latents = latent_frame.to(owner.device, vae.dtype)
        latents = denormalize_latents(latents, owner.latents_mean, owner.latents_std)
        image = vae.decode(latents, return_dict=False)[0]  # clamped to [-1, 1]
        self.frames_decoded += image.shape[2]
        return image

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to uint8 frames [1, H, W, 3]."""
        return to_uint8_frames(self.decode_next_float(latent_frame))
