"""FLUX.2 klein VAE decode: the one latent frame of an image in, its frame out (AutoencoderKLFlux2).

The DiT sends the latents as the transformer leaves them, [1, 4C, 1, h, w]: 2x2 patches of the VAE's C channels,
normalised by the VAE's batch-norm statistics. Decoding is Flux2KleinPipeline's after its loop: multiplied by
sqrt(running_var + batch_norm_eps) and shifted by running_mean (the VAE's `bn` buffers, per patchified channel),
unpatchified to [1, C, 2h, 2w], `AutoencoderKLFlux2.decode`, then mapped to [0, 1] as its image processor does
(the decoder does not clamp; the mapping does).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline

from stagekit.decode import LatentDecoder, to_uint8_frames
from stagekit.weights import load_pretrained


class Flux2KleinDecoder(LatentDecoder):
    vae_class = AutoencoderKLFlux2

    def __init__(self, model_dir: str | Path, device: torch.device, dtype: torch.dtype, load_threads: int = 4) -> None:
        # The latents are normalised by the VAE's batch-norm buffers, not by config statistics.
        self.device = device
        self.vae = load_pretrained(
            self.vae_class, Path(model_dir) / "vae", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        config = self.vae.config
        self.latent_channels = config.latent_channels * config.patch_size[0] * config.patch_size[1]

    def session(self) -> Flux2KleinDecodeSession:
        return Flux2KleinDecodeSession(self)

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's latents [1, 4C, h, w] (normalised, patchified) as the VAE decodes them, [1, C, 2h, 2w]:
        the pipeline's de-normalisation, in the latents' dtype, and its unpatchify."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(
            latents.device, latents.dtype
        )
        return Flux2KleinPipeline._unpatchify_latents(latents * std + mean)


class Flux2KleinDecodeSession:
    """One request's decode; an image has a single latent frame, so nothing carries between calls."""

    def __init__(self, decoder: Flux2KleinDecoder) -> None:
        self.decoder = decoder
        self.frames_decoded = 0

    @torch.no_grad()
    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, 4C, 1, h, w] (normalised, patchified) to the decoded image [1, 3, 1, H, W],
        clamped to [-1, 1] (what the image processor's mapping to [0, 1] keeps)."""
        owner = self.decoder
        latents = owner.vae_latents(latent_frame[:, :, 0].to(owner.device))
        image = owner.vae.decode(latents.to(owner.vae.dtype), return_dict=False)[0]
        self.frames_decoded += 1
        return image.clamp(-1, 1).unsqueeze(2)

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, 4C, 1, h, w] (normalised, patchified) to uint8 frames [1, H, W, 3]."""
        return to_uint8_frames(self.decode_next_float(latent_frame))
