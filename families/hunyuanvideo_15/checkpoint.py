"""The geometry of a HunyuanVideo 1.5 checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any

from families.base import RequestDefaults

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
    """(height, width) HunyuanVideo15Pipeline picks without a size: of the crop buckets of about
    `target_size`^2 pixels in steps of `spatial` (HunyuanVideo15ImageProcessor.calculate_default_height_width),
    the one whose height/width ratio is closest to 9/16 from above. 640 gives 480x848, 960 gives 720x1280."""
    patches = round((target_size / spatial) ** 2)
    buckets, columns, rows = [], patches, 1
    while columns > 0:
        if max(columns, rows) / min(columns, rows) <= 4.0:
            buckets.append((columns * spatial, rows * spatial))
        if (rows + 1) * columns <= patches:
            rows += 1
        else:
            columns -= 1
    wanted = DEFAULT_ASPECT[1] / DEFAULT_ASPECT[0]
    # The ratio is of the bucket's first entry over its second, as the processor computes it; the bucket lists
    # (first, second) and the pipeline reads it as (height, width).
    ratios = [round(first / second, 5) for first, second in buckets]
    above = [index for index, ratio in enumerate(ratios) if ratio - wanted >= 0]
    best = min(above, key=lambda index: abs(ratios[index] - wanted))
    return buckets[best]


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
