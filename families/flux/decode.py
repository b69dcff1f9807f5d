"""FLUX.1 VAE decode: the one latent frame of an image in, its frame out (AutoencoderKL, 16 channels).

The DiT sends the latents unpacked to [1, C, 1, h, w], the per-frame layout every family's stream shares.
Decoding is FluxPipeline's: the latents divided by the VAE config's `scaling_factor` plus its `shift_factor`,
`AutoencoderKL.decode` of the [1, C, h, w] image, then mapped to [0, 1] as its image processor does (the
decoder does not clamp; the mapping does). Z-Image uses the same VAE and decode.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL

from stagekit.decode import LatentDecoder, to_uint8_frames
from stagekit.weights import load_pretrained


class FluxDecoder(LatentDecoder):
    vae_class = AutoencoderKL

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = 4) -> None:
        # AutoencoderKL normalises with one scale and shift, not per-channel statistics.
        self.device = device
        self.vae = load_pretrained(
            self.vae_class, Path(model_dir) / "vae", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        config = self.vae.config
        self.latent_channels = config.latent_channels
        self.scaling_factor = config.scaling_factor
        self.shift_factor = config.shift_factor if config.shift_factor is not None else 0.0

    def session(self) -> FluxDecodeSession:
        return FluxDecodeSession(self)


class FluxDecodeSession:
    """One request's decode; an image has a single latent frame, so nothing carries between calls."""

    def __init__(self, decoder: FluxDecoder) -> None:
        self.decoder = decoder
        self.frames_decoded = 0

    @torch.no_grad()
    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to the decoded image [1, 3, 1, H, W], clamped to [-1, 1]
        (what the image processor's mapping to [0, 1] keeps)."""
        owner = self.decoder
        latents = latent_frame[:, :, 0].to(owner.device, owner.vae.dtype)
        latents = latents / owner.scaling_factor + owner.shift_factor
        image = owner.vae.decode(latents, return_dict=False)[0]
        self.frames_decoded += 1
        return image.clamp(-1, 1).unsqueeze(2)

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to uint8 frames [1, H, W, 3]."""
        return to_uint8_frames(self.decode_next_float(latent_frame))
