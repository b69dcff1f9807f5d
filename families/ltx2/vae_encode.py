"""The VAE stage's Encode for LTX-2 image-to-video: the first frame's latents, as LTX2ImageToVideoPipeline makes
them.

The pipeline's __call__ and `prepare_latents` less the repetition over frames, the conditioning mask and the noise
(the DiT builds those, families/ltx2/denoise.py): the image is re-compressed as one H.264 frame at the checkpoint's
CRF (`apply_image_conditioning_crf`: 33 for the Gemma 3 generations, LTX-2.0 to LTX-2.3, 18 for a Gemma 4 text
encoder, as `resolve_default_image_crf` picks it from the text encoder's model_type), resized to the request's size
with the pipeline's video processor (bilinear, the aspect ratio not kept), encoded with the served
AutoencoderKLLTX2Video, the mode of its latent distribution taken and normalised with the VAE's latents_mean and
latents_std in float32 (`_normalize_latents` at its default scaling factor 1, as the pipeline calls it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import retrieve_latents
from diffusers.pipelines.ltx2.utils import DEFAULT_IMAGE_CRF, LTX2_5_IMAGE_CRF, apply_image_conditioning_crf
from diffusers.video_processor import VideoProcessor
from PIL import Image

from stagekit.decode import LatentDecoder
from stagekit.images import DecodedImage

LATENTS_NAME = "image_latents"
# The text encoders of the generation trained on CRF 18 (resolve_default_image_crf's).
GEMMA_4_MODEL_TYPES = ("gemma4_unified", "gemma4")


def image_crf(model_dir: str | Path) -> int:
    """The H.264 CRF the pipeline re-compresses the image at by default, from the checkpoint's text encoder."""
    config = Path(model_dir) / "text_encoder" / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    return LTX2_5_IMAGE_CRF if model_type in GEMMA_4_MODEL_TYPES else DEFAULT_IMAGE_CRF


def recompressed(image: Image.Image, crf: int) -> Image.Image:
    """The image as the pipeline conditions on it before resizing: through H.264 at `crf` (0: as it is)."""
    if crf == 0:
        return image
    return Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))


class LTX2ImageLatentEncoder:
    """Encodes a request's first frame with the VAE stage's decoder's video VAE (the same weights)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.crf = image_crf(self.model_dir)

    @torch.no_grad()
    def __call__(
        self, decoder: LatentDecoder, images: list[DecodedImage], height: int, width: int, num_frames: int
    ) -> dict[str, torch.Tensor]:
        """{"image_latents": float32 [1, C, 1, height / 32, width / 32]} of the first frame, normalised."""
        vae = decoder.vae
        first = next(item.image for item in images if item.role == "first_frame")
        processor = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio, resample="bilinear")
        pixels = processor.preprocess(recompressed(first, self.crf), height=height, width=width)
        pixels = pixels.to(decoder.device, vae.dtype).unsqueeze(2)
        latents = retrieve_latents(vae.encode(pixels), sample_mode="argmax").float()
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
        return {LATENTS_NAME: ((latents - mean) / std).cpu()}
