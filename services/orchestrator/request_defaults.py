"""A GenerateRequest completed for the served model: every unset field given its default, every field checked.

Rules a reader must know:
- REQUEST_FIELDS is the table of the scalar fields: the default an unset field runs with (from the model's
  limits, or the output size a family takes from an input image) and, for the fields only the orchestrator
  bounds, the values allowed. Height, width, frames, steps, guidance and seed are bounded by the model's
  limits in services/validation.py, which the DiT stage runs again on what it receives.
- `complete_request` checks in a fixed order and the first failure is the error: prompts, images, size,
  sampling, seed, cache, adapters, the table's bounds, output format, sound (audio_codec), then the stages
  the request needs.
- Every refusal is a RequestError (INVALID_ARGUMENT) naming the field and what is allowed.
- The completed request is what the job stores and echoes: it holds only what runs (interpolation off
  clears its fields), with the cache, adapters and output format it runs with.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from google.protobuf.message import Message

from families.base import Family
from services.encoding import AUDIO_NONE, check_audio, check_output
from services.images import ImageInfo
from services.orchestrator.chain import check_request
from services.orchestrator.request_images import complete_images, size_from_images
from services.orchestrator.tenants import output_frames
from services.validation import (
    ALLOWED_INTERP_SCALES,
    MAX_FPS,
    MAX_INTERP_EXP,
    resolve_cache,
    resolve_loras,
    validate_sampling,
    validate_seed,
    validate_size,
    validate_sound_length,
)
from stagediff.v1 import generation_pb2, stages_pb2
from stagekit.errors import RequestError


@dataclass(frozen=True)
class DefaultsSource:
    """What an unset field's default comes from: the model's limits and the output size, (width, height)."""

    limits: stages_pb2.ModelLimits
    size: tuple[int, int]


@dataclass(frozen=True)
class Bound:
    """The values a field allows: `accepts` tells one, `allowed` completes "<field>: <value> is not allowed; use"."""

    accepts: Callable[[float], bool]
    allowed: str

    def check(self, field: str, value: float) -> None:
        if not self.accepts(value):
            raise RequestError(f"{field}: {value} is not allowed; use {self.allowed}")


@dataclass(frozen=True)
class FieldSpec:
    """One field of a GenerateRequest (a dotted path for a nested one): its default when unset, its bound."""

    name: str
    default: Callable[[DefaultsSource], float] | None = None
    bound: Bound | None = None


# The longest deadline a request may set (GenerateRequest.deadline_s): a week, beyond any job's time.
MAX_DEADLINE_S = 7 * 24 * 3600.0

REQUEST_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec("height", default=lambda source: source.size[1]),
    FieldSpec("width", default=lambda source: source.size[0]),
    FieldSpec("num_frames", default=lambda source: source.limits.default_num_frames),
    FieldSpec("num_inference_steps", default=lambda source: source.limits.default_inference_steps),
    FieldSpec("guidance_scale", default=lambda source: source.limits.default_guidance_scale),
    FieldSpec("seed", default=lambda source: random.randrange(2**31)),
    FieldSpec(
        "fps",
        default=lambda source: source.limits.default_fps,
        bound=Bound(lambda value: math.isfinite(value) and 0 < value <= MAX_FPS, f"a value in (0, {MAX_FPS:g}]"),
    ),
    FieldSpec(
        "deadline_s",
        bound=Bound(
            lambda value: math.isfinite(value) and 0 <= value <= MAX_DEADLINE_S,
            f"seconds in (0, {MAX_DEADLINE_S:g}], or 0 for none",
        ),
    ),
    # Checked once interpolation is known to be on: off, its fields are cleared (and so allowed).
    FieldSpec(
        "interpolation.exp",
        bound=Bound(lambda value: 0 <= value <= MAX_INTERP_EXP, f"0 (off) to {MAX_INTERP_EXP} (2**exp x fps)"),
    ),
    FieldSpec(
        "interpolation.scale",
        bound=Bound(
            lambda value: value in ALLOWED_INTERP_SCALES, f"one of {list(ALLOWED_INTERP_SCALES[1:])}, or 0 for 1"
        ),
    ),
)


def _owner(request: Message, name: str) -> tuple[Message, str]:
    """The message holding the field `name` (a dotted path) and the field's own name."""
    *parents, leaf = name.split(".")
    for parent in parents:
        request = getattr(request, parent)
    return request, leaf


def fill_defaults(request: generation_pb2.GenerateRequest, source: DefaultsSource) -> None:
    """Sets every field of the table that has a default and that `request` leaves unset."""
    for spec in REQUEST_FIELDS:
        if spec.default is not None:
            owner, leaf = _owner(request, spec.name)
            if not owner.HasField(leaf):
                setattr(owner, leaf, spec.default(source))


def check_bounds(request: generation_pb2.GenerateRequest) -> None:
    """Raises RequestError for the first field of the table outside its bound."""
    for spec in REQUEST_FIELDS:
        if spec.bound is not None:
            owner, leaf = _owner(request, spec.name)
            spec.bound.check(spec.name, getattr(owner, leaf))


def check_prompts(request: generation_pb2.GenerateRequest, limits: stages_pb2.ModelLimits) -> None:
    if not request.prompt.strip():
        raise RequestError("prompt: must not be empty")
    for field in ("prompt", "negative_prompt"):
        length = len(getattr(request, field))
        if length > limits.max_prompt_chars:
            raise RequestError(f"{field}: {length} characters; at most {limits.max_prompt_chars} are allowed")


def complete_request(
    request: generation_pb2.GenerateRequest,
    model: str,
    limits: stages_pb2.ModelLimits,
    family: Family,
    deployed: Collection[str],
    interp: stages_pb2.StageInfo | None,
    probed: Sequence[ImageInfo] | None = None,
) -> generation_pb2.GenerateRequest:
    """`request` for the served `model`, validated against its `limits`, with every default filled in; raises
    RequestError. `deployed` names the stages with endpoints, `interp` is the interpolator's StageInfo
    (None without one), `probed` what the image workers read of the request's images."""
    full = generation_pb2.GenerateRequest()
    full.CopyFrom(request)
    full.model = model
    check_prompts(request, limits)
    complete_images(full, limits, probed)
    # A family that takes the output size from an input image (Qwen-Image-Edit) does so for each side the
    # request leaves unset, as its pipeline does (`height = height or calculated_height`); the job
    # records the size it used.
    from_image = size_from_images(full, limits, family.images)
    size = from_image[2] if from_image else (limits.default_width, limits.default_height)
    if from_image is not None and family.images.size_from is not None and family.images.size_from.fixed:
        # The pipeline has no size of its own (HunyuanVideo 1.5 image-to-video): only the image's is served.
        index, image, (width, height) = from_image
        for side, made in (("width", width), ("height", height)):
            if request.HasField(side) and getattr(request, side) != made:
                raise RequestError(
                    f"{side}: {getattr(request, side)}; this model makes the size from images[{index}] "
                    f"({image.width}x{image.height}: {width}x{height}); leave height and width unset or send that"
                )
    fill_defaults(full, DefaultsSource(limits, size))
    try:
        validate_size(limits, full.height, full.width, full.num_frames)
    except RequestError as error:
        side = str(error).partition(":")[0]
        if from_image is None or side not in ("height", "width") or request.HasField(side):
            raise
        index, image, (width, height) = from_image
        raise RequestError(
            f"images[{index}]: the output size {width}x{height} made from this {image.width}x{image.height} "
            f"image is not allowed ({error}); send height and width"
        ) from None
    if limits.HasField("default_embedded_guidance_scale") and not full.HasField("embedded_guidance_scale"):
        full.embedded_guidance_scale = limits.default_embedded_guidance_scale
    embedded = full.embedded_guidance_scale if full.HasField("embedded_guidance_scale") else None
    validate_sampling(limits, full.num_inference_steps, full.guidance_scale, embedded)
    validate_sound_length(limits, full.num_frames, full.fps)
    validate_seed(full.seed)
    # The job records the cache it ran with, the model's default filled in.
    full.cache.CopyFrom(resolve_cache(limits, request.cache if request.HasField("cache") else None))
    # And the adapters with their scales (whether the tenant may use them is checked at admission).
    del full.loras[:]
    full.loras.extend(resolve_loras(limits, list(request.loras)))
    if not full.interpolation.enable:
        # Ignored fields are not kept: the stored and echoed request holds only what runs.
        full.ClearField("interpolation")
    check_bounds(full)
    # The result's format: the job records the format and quality it was encoded with.
    quality = request.output_quality if request.HasField("output_quality") else None
    try:
        output = check_output(request.output_format, quality, request.keep_raw_frames, output_frames(full))
    except ValueError as error:
        raise RequestError(str(error)) from None
    full.output_format = output.name
    try:
        full.audio_codec = check_audio(request.audio_codec, output, model, limits.audio_sample_rate)
    except ValueError as error:
        raise RequestError(str(error)) from None
    if limits.audio_sample_rate > 0 and not request.audio_codec and full.audio_codec == AUDIO_NONE:
        full.notices.append(
            stages_pb2.Notice(
                field="audio_codec",
                given="",
                used=AUDIO_NONE,
                message=f"output_format {output.name} carries no sound: the result is silent; "
                "use mp4, webm or raw to keep the sound",
                source="orchestrator",
            )
        )
    if quality is None and output.default_quality is not None:
        full.output_quality = output.default_quality
    # The family's chain and this deployment's stages: a stage the request asks for must be in both.
    check_request(family, deployed, full)
    model_path = full.interpolation.model_path
    if model_path and (interp is None or model_path != interp.weights_path):
        # Checked here, before the DiT runs; the interpolator's own path is not for tenants to read.
        raise RequestError(
            "interpolation.model_path: the interpolator does not serve these weights; "
            "leave it empty to use the weights it serves"
        )
    return full
