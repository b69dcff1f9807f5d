"""Qwen-Image 2.1 VAE decode: the one latent frame of an image in, its RGB frame out.

Decoding is QwenImage21Pipeline's: latents cast to the VAE's dtype, denormalised as `latents * std + mean`
(2.1 multiplies by the std, where Qwen-Image divides by 1/std), `AutoencoderKLQwenImage21.decode` (which clamps
to [-1, 1]), then mapped to [0, 1] and to 8 bits as its image processor does.

The VAE's out_channels are 4: the pipeline's images are RGBA. StageDiff's results are RGB frames [F, H, W, 3]
throughout (the job store, the encoders, the clients), so the stage sends the red, green and blue channels and
drops the alpha: the frame equals the pipeline's image `.convert("RGB")`, which drops it the same way.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLQwenImage21

from families.qwen_image.decode import QwenDecodeSession, QwenImageDecoder
from stagekit.decode import to_uint8_frames


class QwenImage21Decoder(QwenImageDecoder):
    vae_class = AutoencoderKLQwenImage21

    def session(self) -> Qwen21DecodeSession:
        return Qwen21DecodeSession(self)


class Qwen21DecodeSession(QwenDecodeSession):
    """One request's decode; an image has a single latent frame, so nothing carries between calls."""

    @torch.no_grad()
    def decode_next_float(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to the decoded image's RGB [1, 3, 1, H, W] in [-1, 1]
        (the VAE's alpha channel dropped)."""
        vae = self.decoder.vae
        latents = latent_frame.to(self.decoder.device, vae.dtype)
        config = vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        image = vae.decode(latents * std + mean, return_dict=False)[0]  # clamped to [-1, 1]
        self.frames_decoded += image.shape[2]
        return image[:, :3]

    def decode_next(self, latent_frame: torch.Tensor) -> torch.Tensor:
        """Decodes latent frame [1, C, 1, h, w] (normalised) to uint8 RGB frames [1, H, W, 3]."""
        return to_uint8_frames(self.decode_next_float(latent_frame))
