"""The geometry of a Qwen-Image-Edit checkpoint, read from its JSON configs (no torch)."""

from __future__ import annotations

from typing import Any

from families.qwen_image.checkpoint import read_geometry as read_qwen_geometry

# The edit pipelines do not truncate the Qwen2.5-VL sequence (QwenImagePipeline cuts it at 1024 tokens): it
# holds each input image's vision tokens, up to the processor's max_pixels / 28^2 (16384 for the published
# checkpoints' 12845056), and the prompt's. The DiT takes embeddings up to this many tokens.
SEQUENCE_LENGTH_LIMIT = 32768


def read_geometry(configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Qwen-Image's geometry (families/qwen_image/checkpoint.py), with the edit pipelines' longer sequences."""
    return {**read_qwen_geometry(configs), "sequence_length_limit": SEQUENCE_LENGTH_LIMIT}
