"""Validation of generation arguments against a model's limits.

The orchestrator runs it on every request before queueing, and the DiT stage
runs it again on what it receives, since a stage can be called directly. Each
error names the field and what is allowed.
"""

from __future__ import annotations

import math

from services.errors import RequestError
from stagediff.v1 import stages_pb2

MAX_GUIDANCE_SCALE = 100.0
MAX_SEED = 2**63 - 1


def validate_size(limits: stages_pb2.ModelLimits, height: int, width: int, num_frames: int) -> None:
    for field, value, multiple, largest in (
        ("height", height, limits.height_multiple, limits.max_height),
        ("width", width, limits.width_multiple, limits.max_width),
    ):
        if value <= 0 or value % multiple != 0 or value > largest:
            raise RequestError(
                f"{field}: {value} is not allowed; use a positive multiple of {multiple} up to {largest}"
            )
    if limits.max_frames == 1 and num_frames != 1:
        raise RequestError(f"num_frames: {num_frames} is not allowed; this model makes single images, use 1")
    factor = limits.temporal_factor
    if num_frames < 1 or (num_frames - 1) % factor != 0 or num_frames > limits.max_frames:
        raise RequestError(
            f"num_frames: {num_frames} is not allowed; the VAE takes {factor}*k+1 frames "
            f"(1, {factor + 1}, {2 * factor + 1}, ...) up to {limits.max_frames}"
        )


def validate_sampling(limits: stages_pb2.ModelLimits, num_inference_steps: int, guidance_scale: float) -> None:
    if not 1 <= num_inference_steps <= limits.max_inference_steps:
        raise RequestError(
            f"num_inference_steps: {num_inference_steps} is not allowed; use 1 to {limits.max_inference_steps}"
        )
    if not math.isfinite(guidance_scale) or not 0.0 <= guidance_scale <= MAX_GUIDANCE_SCALE:
        raise RequestError(
            f"guidance_scale: {guidance_scale} is not allowed; use 0 to {MAX_GUIDANCE_SCALE:g} (above 1 enables CFG)"
        )


def validate_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise RequestError(f"seed: {seed} is not allowed; use 0 to {MAX_SEED}")
