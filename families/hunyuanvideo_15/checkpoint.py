"""The geometry of a HunyuanVideo 1.5 checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any

from families.base import RequestDefaults, crop_bucket

# HunyuanVideo15Pipeline's call defaults: 121 frames, 50 steps; the size is chosen from the transformer's
# `target_size` (below) and the guidance scale is the guider's (ClassifierFreeGuidance's own default 7.5 when the
# checkpoint ships none). The published videos are 24 frames per second.
NUM_FRAMES = 121
NUM_INFERENCE_STEPS = 50
FPS = 24.0
GUIDER_DEFAULT_SCALE = 7.5
# HunyuanVideo15Pipeline.tokenizer_max_length: Qwen2.5-VL tokens kept after the chat template's system message.
MAX_SEQUENCE_LENGTH = 1000
# The pipeline's default aspect ratio (width:height) for a request without a size.
DEFAULT_ASPECT = (16, 9)


def default_size(target_size: int, spatial: int) -> tuple[int, int]:
    """(height, width) HunyuanVideo15Pipeline picks without a size: the crop bucket of about `target_size`^2
    pixels nearest 16:9 (HunyuanVideo15ImageProcessor.calculate_default_height_width). 640 gives 480x848, 960
    gives 720x1280."""
    width, height = crop_bucket(DEFAULT_ASPECT[0], DEFAULT_ASPECT[1], target_size, spatial)
    return height, width


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A video model: AutoencoderKLHunyuanVideo15 latents (its spatial and temporal compression ratios, 16x and
    4x in the published VAE), the transformer's patch sizes (1x1x1 published), Qwen2.5-VL prompts of at most 1000
    tokens after the template, and the pipeline's defaults with the guider's scale."""
    vae, transformer = configs["vae"], configs["transformer"]
    spatial = int(vae.get("spatial_compression_ratio", 16))
    height, width = default_size(int(transformer.get("target_size", 640)), spatial)
    guider = configs.get("guider") or {}
    patch, patch_t = int(transformer.get("patch_size", 1)), int(transformer.get("patch_size_t", 1))
    return {
        "vae_scale_spatial": spatial,
        "vae_scale_temporal": int(vae.get("temporal_compression_ratio", 4)),
        "patch_size": (patch_t, patch, patch),
        "latent_channels": int(vae.get("latent_channels", 32)),
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "sequence_length_limit": MAX_SEQUENCE_LENGTH,
        "defaults": RequestDefaults(
            height=height,
            width=width,
            num_frames=NUM_FRAMES,
            num_inference_steps=NUM_INFERENCE_STEPS,
            guidance_scale=float(guider.get("guidance_scale", GUIDER_DEFAULT_SCALE)),
            fps=FPS,
        ),
    }


def read_image_to_video_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Text-to-video's geometry, and the transformer's `target_size` as the base of the crop buckets the output size
    is made from the input image (HunyuanVideo15ImageToVideoPipeline takes no height or width)."""
    return {**read_geometry(configs), "image_size_base": int(configs["transformer"].get("target_size", 640))}
