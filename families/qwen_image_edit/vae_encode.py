"""The VAE stage's Encode for Qwen-Image-Edit: the input images' latents, as the edit pipelines' prepare_latents
makes them.

Each image is resized and normalised by the pipelines' VaeImageProcessor to about 1024x1024 pixels with its
own aspect ratio (`calculate_dimensions(1024 * 1024, ...)`, sides multiples of 32), encoded by the served
AutoencoderKLQwenImage, the mode of its latent distribution taken (`sample_mode="argmax"`) and normalised
with the VAE's latents_mean and latents_std as `_encode_vae_image` does, then packed into 2x2 patches; the
images' tokens follow one another, in the order the request sent them, as
`torch.cat(all_image_latents, dim=1)` concatenates them. The output's size plays no part here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import QwenImagePipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

from families.base import calculate_dimensions
from families.qwen_image_edit.family import IMAGE_SIDE_MULTIPLE, VAE_IMAGE_AREA
from stagekit.decode import LatentDecoder
from stagekit.errors import RequestError
from stagekit.images import DecodedImage

LATENTS_NAME = "image_latents"


def vae_image_size(width: int, height: int) -> tuple[int, int]:
    """(width, height) the edit pipelines resize a `width` x `height` input image to for their VAE."""
    return calculate_dimensions(VAE_IMAGE_AREA, width, height, IMAGE_SIDE_MULTIPLE)


class QwenImageEditLatentEncoder:
    """Encodes a request's input images with the VAE stage's decoder's VAE (the same weights)."""

    def __init__(self, model_dir: str | Path) -> None:
        vae_config = json.loads((Path(model_dir) / "vae" / "config.json").read_text())
        vae_scale_factor = 2 ** len(vae_config.get("temperal_downsample", [False, True, True]))
        self.image_processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor * 2)

    def __call__(
        self, decoder: LatentDecoder, images: list[DecodedImage], height: int, width: int, num_frames: int
    ) -> dict[str, torch.Tensor]:
        return {LATENTS_NAME: self.encode([item.image for item in images], decoder)}

    @torch.no_grad()
    def encode(self, images: list, decoder: LatentDecoder) -> torch.Tensor:
        """float32 [1, N, 4 * z_dim]: each image's packed latents, one image after another."""
        vae = decoder.vae
        packed = []
        for index, image in enumerate(images):
            width, height = vae_image_size(*image.size)
            if width < 1 or height < 1:
                raise RequestError(
                    f"images[{index}]: a {image.width}x{image.height} image resizes to {width}x{height} for the "
                    "VAE; send an image with a less extreme aspect ratio"
                )
            pixels = self.image_processor.preprocess(image, height, width).unsqueeze(2)  # [1, 3, 1, H, W]
            latents = retrieve_latents(vae.encode(pixels.to(decoder.device, vae.dtype)), sample_mode="argmax")
            channels = latents.shape[1]
            mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
            latents = (latents - mean) / std
            rows, columns = latents.shape[3:]
            packed.append(QwenImagePipeline._pack_latents(latents, 1, channels, rows, columns))
        return torch.cat(packed, dim=1).to(torch.float32).cpu()
