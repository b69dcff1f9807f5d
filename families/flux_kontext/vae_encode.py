"""The VAE stage's Encode for FLUX.1 Kontext: the reference image's latents, as FluxKontextPipeline makes them.

The image is resized by the pipeline's VaeImageProcessor (Lanczos) to the preferred resolution nearest its
aspect ratio (`REFERENCE_SIZE`, families/flux_kontext/family.py: `_auto_resize`, sides floored to the VAE's
factor times 2), normalised to [-1, 1], encoded by the served AutoencoderKL, the mode of its latent
distribution taken (`sample_mode="argmax"`) and normalised as `_encode_vae_image` does
(`(latents - shift_factor) * scaling_factor`), then packed into 2x2 patches. The output's size plays no part.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import FluxKontextPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux_kontext import retrieve_latents
from PIL import Image

from families.flux_kontext.family import REFERENCE_SIZE
from stagekit.decode import LatentDecoder
from stagekit.errors import RequestError
from stagekit.images import DecodedImage

LATENTS_NAME = "image_latents"


def vae_scale_factor(model_dir: str | Path) -> int:
    """FluxKontextPipeline's: 2 ** (len(block_out_channels) - 1) of the checkpoint's VAE."""
    vae_config = json.loads((Path(model_dir) / "vae" / "config.json").read_text())
    return 2 ** (len(vae_config.get("block_out_channels", [128, 256, 512, 512])) - 1)


def reference_size(width: int, height: int, scale_factor: int) -> tuple[int, int]:
    """(width, height) the pipeline resizes a `width` x `height` reference image to; (0, 0) for an image
    less than `2 * scale_factor` pixels on a side."""
    return REFERENCE_SIZE.size(width, height, 2 * scale_factor)


class FluxKontextLatentEncoder:
    """Encodes a request's reference image with the VAE stage's decoder's VAE (the same weights)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.vae_scale_factor = vae_scale_factor(model_dir)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    def __call__(
        self, decoder: LatentDecoder, images: list[DecodedImage], height: int, width: int, num_frames: int
    ) -> dict[str, torch.Tensor]:
        (image,) = images  # the family takes one reference image (families/flux_kontext/family.py)
        return {LATENTS_NAME: self.encode(image.image, decoder)}

    @torch.no_grad()
    def encode(self, image: Image.Image, decoder: LatentDecoder) -> torch.Tensor:
        """float32 [1, N, 4 * latent_channels]: the image's packed latents."""
        width, height = reference_size(*image.size, self.vae_scale_factor)
        if width < 1 or height < 1:
            side = 2 * self.vae_scale_factor
            raise RequestError(
                f"images[0]: a {image.width}x{image.height} image has a side under {side} pixels; the pipeline "
                f"takes the aspect ratio of its sides floored to multiples of {side}"
            )
        resized = self.image_processor.resize(image, height, width)
        pixels = self.image_processor.preprocess(resized, height, width)
        vae = decoder.vae
        latents = retrieve_latents(vae.encode(pixels.to(decoder.device, vae.dtype)), sample_mode="argmax")
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        channels, rows, columns = latents.shape[1:]
        packed = FluxKontextPipeline._pack_latents(latents, 1, channels, rows, columns)
        return packed.to(torch.float32).cpu()
