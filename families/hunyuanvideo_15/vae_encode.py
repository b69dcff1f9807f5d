"""The VAE stage's Encode for HunyuanVideo 1.5 image-to-video: the first frame's latents, as
HunyuanVideo15ImageToVideoPipeline makes them.

`prepare_cond_latents_and_mask` of the pipeline less the repetition over frames and the mask (the DiT builds
those, families/hunyuanvideo_15/denoise.py): the image is resized and centre-cropped to the output size by the
pipeline's image processor, encoded with the served AutoencoderKLHunyuanVideo15, the mode of its latent
distribution taken and multiplied by the VAE's scaling_factor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import retrieve_latents

from stagekit.decode import LatentDecoder
from stagekit.images import DecodedImage

LATENTS_NAME = "image_latents"


def cropped(image: object, height: int, width: int, spatial: int) -> object:
    """The image resized to cover `width` x `height` and centre-cropped to it, as the pipeline crops it."""
    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=spatial, do_resize=False, do_convert_rgb=True)
    return processor.resize(image, height=height, width=width, resize_mode="crop")


class HunyuanVideo15ImageLatentEncoder:
    """Encodes a request's first frame with the VAE stage's decoder's VAE (the same weights)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)

    @torch.no_grad()
    def __call__(
        self, decoder: LatentDecoder, images: list[DecodedImage], height: int, width: int, num_frames: int
    ) -> dict[str, torch.Tensor]:
        """{"image_latents": float32 [1, C, 1, height / 16, width / 16]} of the first frame."""
        vae = decoder.vae
        spatial = vae.config.spatial_compression_ratio
        first = next(item.image for item in images if item.role == "first_frame")
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=spatial, do_resize=False, do_convert_rgb=True)
        pixels = processor.preprocess(cropped(first, height, width, spatial), height=height, width=width)
        pixels = pixels.to(decoder.device, vae.dtype).unsqueeze(2)
        latents = retrieve_latents(vae.encode(pixels), sample_mode="argmax") * vae.config.scaling_factor
        return {LATENTS_NAME: latents.float().cpu()}
