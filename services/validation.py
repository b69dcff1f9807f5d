"""Validation of generation arguments against a model's limits.

The orchestrator runs it on every request before queueing, and the DiT stage
runs it again on what it receives, since a stage can be called directly. Each
error names the field and what is allowed.
"""

from __future__ import annotations

import math
import re

from families.base import MAX_CACHE_THRESHOLD
from stagediff.v1 import stages_pb2
from stagekit.errors import RequestError

MAX_GUIDANCE_SCALE = 100.0
MAX_SEED = 2**63 - 1
MAX_FPS = 240.0
# Frame interpolation: 2**exp x the frames and frame rate; the flow scales a learned interpolator takes (0: 1).
MAX_INTERP_EXP = 4
ALLOWED_INTERP_SCALES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
# A LoRA adapter's name: its file's name in --lora-dir without ".safetensors", behind "TENANT/" for one in a
# tenant's subdirectory (each part as a tenant's name). A name is never a path: no "..", no leading "/".
# Use LORA_NAME.fullmatch: a name is the whole string (a trailing newline is not part of any name).
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,63})?")
# diffusers' set_adapters takes any weight; beyond this no style or distillation adapter is meant to be used.
MAX_LORA_SCALE = 10.0
# The most adapters a DiT lets one request apply (--max-loras-per-request is at most this).
MAX_LORAS_PER_REQUEST = 16


def nearest_allowed(value: int, first: int, step: int, last: int) -> list[int]:
    """The allowed values nearest `value` on either side, among first, first + step, ... up to last (at most two,
    in order); [] when none is allowed (last < first)."""
    if last < first:
        return []
    top = first + (last - first) // step * step
    below = first + (value - first) // step * step
    candidates = {min(max(below, first), top), min(max(below + step, first), top)}
    return sorted(candidates - {value})


def _nearest_phrase(values: list[int]) -> str:
    """ "; the nearest allowed are 9 and 13" (or "is 81"), for a refusal's message."""
    if not values:
        return ""
    if len(values) == 1:
        return f"; the nearest allowed is {values[0]}"
    return f"; the nearest allowed are {values[0]} and {values[1]}"


def validate_size(limits: stages_pb2.ModelLimits, height: int, width: int, num_frames: int) -> None:
    """Refuses a size or frame count the model cannot make, naming the field, the rule and the nearest values
    the rule allows: nothing is rounded, as diffusers' pipelines round silently."""
    for field, value, multiple, largest in (
        ("height", height, limits.height_multiple, limits.max_height),
        ("width", width, limits.width_multiple, limits.max_width),
    ):
        if value <= 0 or value % multiple != 0 or value > largest:
            nearest = _nearest_phrase(nearest_allowed(value, multiple, multiple, largest))
            raise RequestError(
                f"{field}: {value} is not allowed; use a positive multiple of {multiple} up to {largest}{nearest}"
            )
    if limits.max_frames == 1 and num_frames != 1:
        raise RequestError(f"num_frames: {num_frames} is not allowed; this model makes single images, use 1")
    factor = limits.temporal_factor
    if num_frames < 1 or (num_frames - 1) % factor != 0 or num_frames > limits.max_frames:
        nearest = _nearest_phrase(nearest_allowed(num_frames, 1, factor, limits.max_frames))
        raise RequestError(
            f"num_frames: {num_frames} is not allowed; the VAE takes {factor}*k+1 frames "
            f"(1, {factor + 1}, {2 * factor + 1}, ...) up to {limits.max_frames}{nearest}"
        )


def validate_sound_length(limits: stages_pb2.ModelLimits, num_frames: int, fps: float) -> None:
    """For a model that makes sound with its video (ModelLimits.audio_sample_rate > 0), the video, whose length
    the sound has, lasts at most as long as its longest at its default frame rate (max_frames / default_fps):
    a low fps would otherwise ask for hours of sound from a few frames."""
    if limits.audio_sample_rate <= 0 or limits.default_fps <= 0:
        return
    longest = limits.max_frames / limits.default_fps
    seconds = num_frames / fps
    if seconds > longest:
        raise RequestError(
            f"fps: {num_frames} frames at {fps:g} fps last {seconds:.3g} s; this model makes at most {longest:.3g} s "
            f"of video with its sound ({limits.max_frames} frames at {limits.default_fps:g} fps); raise fps or "
            "send fewer frames"
        )


def validate_sampling(
    limits: stages_pb2.ModelLimits,
    num_inference_steps: int,
    guidance_scale: float,
    embedded_guidance_scale: float | None = None,
) -> None:
    """Steps, the CFG scale and, for a guidance-distilled model only, the guidance its transformer embeds."""
    if not 1 <= num_inference_steps <= limits.max_inference_steps:
        raise RequestError(
            f"num_inference_steps: {num_inference_steps} is not allowed; use 1 to {limits.max_inference_steps}"
        )
    if not math.isfinite(guidance_scale) or not 0.0 <= guidance_scale <= MAX_GUIDANCE_SCALE:
        raise RequestError(
            f"guidance_scale: {guidance_scale} is not allowed; use 0 to {MAX_GUIDANCE_SCALE:g} "
            "(above 1 enables CFG; above 0 for Z-Image)"
        )
    if embedded_guidance_scale is None:
        return
    if not limits.HasField("default_embedded_guidance_scale"):
        raise RequestError(
            "embedded_guidance_scale: this model has no guidance embedding (only guidance-distilled models such as "
            "FLUX.1-dev take one); leave it unset, and use guidance_scale for CFG"
        )
    if not math.isfinite(embedded_guidance_scale) or not 0.0 <= embedded_guidance_scale <= MAX_GUIDANCE_SCALE:
        raise RequestError(
            f"embedded_guidance_scale: {embedded_guidance_scale} is not allowed; use 0 to {MAX_GUIDANCE_SCALE:g}"
        )


def validate_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise RequestError(f"seed: {seed} is not allowed; use 0 to {MAX_SEED}")


def resolve_cache(
    limits: stages_pb2.ModelLimits, cache: stages_pb2.StepCache | None, field: str = "cache"
) -> stages_pb2.StepCache:
    """The step cache a request runs with, method and threshold both set: `cache` as sent (None or an empty
    method: the model's default_cache), checked against the methods the model offers (`cache_methods`).

    "none" is always allowed and carries no threshold; a method sent without a threshold gets the one the
    model lists for it. A model that lists no default (an older DiT) runs every pass.
    """
    offered = {entry.method: entry.threshold for entry in limits.cache_methods}
    default = limits.default_cache if limits.default_cache.method else stages_pb2.StepCache(method="none")
    if cache is None:
        cache = stages_pb2.StepCache()
    method = cache.method or default.method
    if method != "none" and method not in offered:
        allowed = ", ".join(["none", *offered])
        raise RequestError(f"{field}.method: '{method[:32]}' is not offered for this model; allowed: {allowed}")
    if method == "none":
        if cache.HasField("threshold") and cache.method:
            raise RequestError(f"{field}.threshold: set with method 'none', which takes none; leave it unset")
        if cache.HasField("threshold"):
            raise RequestError(
                f"{field}.threshold: set without a method, and the model's default cache is 'none'; "
                f"name a method ({', '.join(offered) or 'none is offered'})"
            )
        return stages_pb2.StepCache(method="none")
    if cache.HasField("threshold"):
        threshold = cache.threshold
    elif not cache.method and default.method == method and default.HasField("threshold"):
        threshold = default.threshold
    else:
        threshold = offered[method]
    if not math.isfinite(threshold) or not 0.0 < threshold <= MAX_CACHE_THRESHOLD:
        raise RequestError(
            f"{field}.threshold: {threshold} is not allowed; use a value in (0, {MAX_CACHE_THRESHOLD:g}] "
            "(higher skips more)"
        )
    return stages_pb2.StepCache(method=method, threshold=threshold)


def lora_owner(name: str) -> str | None:
    """The tenant a private adapter ("TENANT/NAME") belongs to; None for one every allowed tenant may use."""
    owner, slash, _ = name.partition("/")
    return owner if slash else None


def resolve_loras(
    limits: stages_pb2.ModelLimits, loras: list[stages_pb2.LoraAdapter], field: str = "loras"
) -> list[stages_pb2.LoraAdapter]:
    """The request's adapters with each scale set (unset: 1): well-formed names, none twice, finite scales in
    [-MAX_LORA_SCALE, MAX_LORA_SCALE], at most the model's max_loras. Whether each exists, and whether the
    tenant may use it, is for the caller (NOT_FOUND and PERMISSION_DENIED, not INVALID_ARGUMENT)."""
    if limits.max_loras and len(loras) > limits.max_loras:
        raise RequestError(f"{field}: {len(loras)} adapters; this model applies at most {limits.max_loras} at once")
    resolved = []
    seen: set[str] = set()
    for index, lora in enumerate(loras):
        if not LORA_NAME.fullmatch(lora.name):
            raise RequestError(
                f"{field}[{index}].name: '{lora.name[:64]}' is not an adapter name; use NAME or TENANT/NAME "
                "(letters, digits, '_', '.', '-'; up to 64 each) as ModelLimits.loras lists them"
            )
        if lora.name in seen:
            raise RequestError(f"{field}[{index}].name: '{lora.name}' is named twice; name each adapter once")
        seen.add(lora.name)
        scale = lora.scale if lora.HasField("scale") else 1.0
        if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
            raise RequestError(
                f"{field}[{index}].scale: {scale} is not allowed; use -{MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g} "
                "(0 leaves the base model's output, 1 is the adapter as trained)"
            )
        resolved.append(stages_pb2.LoraAdapter(name=lora.name, scale=scale))
    return resolved
