"""Qwen-Image VAE decode: the one latent frame of an image in, its frame out.

The DiT sends the latents unpacked to [1, C, 1, h, w], the same per-frame layout as Wan's, so the
stream and its checks are shared. Decoding is QwenImagePipeline's: latents cast to the VAE's dtype,
denormalised with the VAE config's latents_mean / latents_std (dividing by 1/std, as the pipeline
does, for identical rounding), `AutoencoderKLQwenImage.decode` (which clamps to [-1, 1]), then mapped
to [0, 1] as its image processor does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLQwenImage

from services.weights import load_pretrained
from vae_svc.decode import denormalize_latents, to_uint8_frames


class QwenImageDecoder:
    """AutoencoderKLQwenImage, its weights read with the stage's --num-weight-load-threads."""

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = 4) -> None:
        self.device = device
        self.vae = load_pretrained(
            AutoencoderKLQwenImage, Path(model_dir) / "vae", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        config = self.vae.config
        self.latent_channels = config.z_dim
        self.latents_mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
        self.latents_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)

    def session(self) -> QwenDecodeSession:
        return QwenDecodeSession(self)


class QwenDecodeSession:
    """One request's decode; an image has a single latent frame, so nothing carries between calls."""

    def __init__(self, decoder: QwenImageDecoder) -> None:
        self.decoder = decoder
        self.frames_decoded = 0

    @torch.no_grad()
    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to uint8 frames [1, H, W, 3]."""
        owner = self.decoder
        vae = owner.vae
        latents = latent_frame.to(owner.device, vae.dtype)
        latents = denormalize_latents(latents, owner.latents_mean, owner.latents_std)
        image = vae.decode(latents, return_dict=False)[0]  # [1, 3, 1, H, W] in [-1, 1]
        frames = to_uint8_frames(image)
        self.frames_decoded += frames.shape[0]
        return frames
