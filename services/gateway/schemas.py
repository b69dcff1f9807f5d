"""The HTTP bodies of the OpenAI-style routes, and how each becomes a GenerateRequest or comes from a Job.

Field names are OpenAI's where OpenAI has the field (`prompt`, `size`, `seconds`, `n`, `response_format`,
`output_format`, `output_compression`, `input_reference`) and the diffusion serving convention's elsewhere
(`negative_prompt`, `width`, `height`, `num_frames`, `fps`, `num_inference_steps`, `guidance_scale`,
`embedded_guidance_scale`, `seed`, `lora`), so that a body written for vLLM-Omni's or SGLang-Diffusion's
/v1/videos works here. Unknown fields are refused (400 naming the field): a misspelled `num_inference_step` must
not silently take the default.

Every field is bounded here (docs/http_api.md lists the bounds): strings and lists by length, floats to
finite values, and every number to what the orchestrator allows or, where that depends on the model (a size,
a frame or step count), to its GenerateRequest field's int32 range, so that no value fails as a protobuf
overflow. The orchestrator checks the values against the model's limits.

Where a field of OpenAI's has no exact counterpart (`seconds` becomes a frame count the model makes, clamped
to the most it makes; `output_compression` 100 a quality of 1), the change is sent with the request as a
notice (GenerateRequest.notices, source "http"): the job reports it, and every answer about the job lists its
notices (`notices` of the video object and of the images answer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Annotated, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from families.base import MAX_CACHE_THRESHOLD
from services.gateway.errors import invalid
from services.images import MAX_IMAGE_BYTES
from services.orchestrator.request_bounds import MAX_CACHE_METHOD_CHARS, MAX_LORA_NAME_CHARS, MAX_MODEL_ID_CHARS
from services.validation import (
    ALLOWED_INTERP_SCALES,
    MAX_FPS,
    MAX_GUIDANCE_SCALE,
    MAX_INTERP_EXP,
    MAX_LORA_SCALE,
    MAX_SEED,
)
from stagediff.v1 import generation_pb2, stages_pb2

MAX_TEXT = 16_384  # characters of a prompt (the model's own max_prompt_chars is checked by the orchestrator)
MAX_IMAGES_PER_REQUEST = 10  # OpenAI's `n` bound
MAX_LORAS = 16
MAX_NAME = 256  # characters of the names and ids taken for compatibility (`user`, `style`)
MAX_SIZE_CHARS = 16  # "WIDTHxHEIGHT", 5 digits each, or "auto"
MAX_SECONDS = 3600.0
INT32_MAX = 2**31 - 1  # the GenerateRequest's sizes, counts and qualities are int32
# A data URL of one image: its base64 (4 characters per 3 bytes) and a media type.
MAX_DATA_URL_CHARS = 4 * -(-MAX_IMAGE_BYTES // 3) + 256
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")


# Strings bounded by length (pydantic takes only valid Unicode: no lone surrogates).
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
Name = Annotated[str, StringConstraints(max_length=MAX_NAME)]
ModelId = Annotated[str, StringConstraints(max_length=MAX_MODEL_ID_CHARS)]
LoraName = Annotated[str, StringConstraints(max_length=MAX_LORA_NAME_CHARS)]
LoraSpec = Annotated[str, StringConstraints(max_length=MAX_LORA_NAME_CHARS + 32)]  # "NAME" or "NAME:SCALE"
DataUrl = Annotated[str, StringConstraints(max_length=MAX_DATA_URL_CHARS)]
SizeText = Annotated[str, StringConstraints(max_length=MAX_SIZE_CHARS)]
CacheMethod = Annotated[str, StringConstraints(max_length=MAX_CACHE_METHOD_CHARS)]
ImageKey = Annotated[str, StringConstraints(max_length=16)]
Side = Annotated[int, Field(ge=1, le=INT32_MAX)]
# Finite floats in [low, high], or (low, high] where the low end is excluded (gt).
LoraScale = Annotated[float, Field(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)]
GuidanceScale = Annotated[float, Field(ge=0.0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False)]
CacheThreshold = Annotated[float, Field(gt=0.0, le=MAX_CACHE_THRESHOLD, allow_inf_nan=False)]
Seconds = Annotated[float, Field(gt=0.0, le=MAX_SECONDS, allow_inf_nan=False)]
Fps = Annotated[float, Field(gt=0.0, le=MAX_FPS, allow_inf_nan=False)]
InterpScale = Annotated[float, Field(ge=0.0, le=max(ALLOWED_INTERP_SCALES), allow_inf_nan=False)]


class LoraField(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: LoraName
    scale: LoraScale | None = None


# `lora`: "name", "name:scale", {"name": ..., "scale": ...}, or a list of those.
LoraValue = LoraSpec | LoraField | Annotated[list[LoraSpec | LoraField], Field(max_length=MAX_LORAS)]


class Diffusion(BaseModel):
    """The fields every generation route shares."""

    model_config = ConfigDict(extra="forbid")

    model: ModelId = ""
    prompt: Text
    negative_prompt: Text = ""
    size: SizeText | None = None
    width: Side | None = None
    height: Side | None = None
    num_inference_steps: Side | None = None
    guidance_scale: GuidanceScale | None = None
    # A guidance-distilled model's (FLUX.1-dev's) embedded guidance; refused by every other model.
    embedded_guidance_scale: GuidanceScale | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    lora: LoraValue | None = None
    # The DiT's step cache: "none" or a method the model lists (GET /v1/models), and its threshold.
    cache: CacheMethod | None = None
    cache_threshold: CacheThreshold | None = None
    # OpenAI's end-user id: accepted for compatibility, not used.
    user: Name | None = None


class VideoCreate(Diffusion):
    seconds: Seconds | None = None
    num_frames: Side | None = None
    fps: Fps | None = None
    # Frame interpolation (RIFE, when the cluster runs the interpolator): 2**exp x the frames and frame rate.
    enable_frame_interpolation: bool = False
    frame_interpolation_exp: Annotated[int, Field(ge=0, le=MAX_INTERP_EXP)] = 1
    # The interpolator's flow scale: one of ALLOWED_INTERP_SCALES (0 means 1).
    frame_interpolation_scale: InterpScale = 0.0
    output_format: Literal["mp4", "webm", "gif"] = "mp4"
    # A model that makes sound (LTX-2): the sound's codec, "" the format's own (aac in mp4, opus in webm), "none" a
    # silent video; refused for a model without sound (GenerateRequest.audio_codec).
    audio_codec: Literal["", "none", "aac", "opus"] = ""
    # 1 (smallest) to 100 (best); unset, the format's default.
    output_quality: Annotated[int, Field(ge=1, le=100)] | None = None
    # An image as a data URL ("data:image/png;base64,...") or {"image_url": "data:..."}; as a file in a
    # multipart body. The first frame of image-to-video.
    input_reference: DataUrl | Annotated[dict[ImageKey, DataUrl], Field(max_length=1)] | None = None

    @model_validator(mode="after")
    def _known_scale(self) -> VideoCreate:
        if self.enable_frame_interpolation and self.frame_interpolation_scale not in ALLOWED_INTERP_SCALES:
            allowed = ", ".join(f"{scale:g}" for scale in ALLOWED_INTERP_SCALES[1:])
            value = self.frame_interpolation_scale
            raise invalid("frame_interpolation_scale", f"{value:g} is not allowed; use {allowed}, or 0 for 1")
        return self


class ImageGenerate(Diffusion):
    n: int = Field(default=1, ge=1, le=MAX_IMAGES_PER_REQUEST)
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    # OpenAI's 0-100 compression of jpeg and webp; here the encoder's quality is 100 - compression.
    output_compression: int | None = Field(default=None, ge=0, le=100)
    # OpenAI's quality, background and style: accepted for compatibility where they ask for the default.
    quality: Literal["auto", "standard"] | None = None
    background: Literal["auto"] | None = None
    style: Name | None = None
    moderation: Literal["auto"] | None = None

    @model_validator(mode="after")
    def _seeds_fit(self) -> ImageGenerate:
        """The n images take seeds seed, seed + 1, ..., seed + n - 1: each must be a seed too."""
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise invalid("seed", f"{self.seed} with n={self.n} is not allowed; use 0 to {MAX_SEED - self.n + 1}")
        return self


class ImageEdit(ImageGenerate):
    """POST /v1/images/edits: the fields of a generation; the images to edit come as multipart files."""


def parse_size(size: str | None) -> tuple[int, int] | None:
    """(width, height) of "WxH"; None for None or "auto"."""
    if size is None or size == "auto":
        return None
    match = _SIZE.fullmatch(size)
    if match is None:
        raise invalid("size", f"{size[:32]!r} is not a size; use WIDTHxHEIGHT, e.g. 832x480, or auto")
    return int(match.group(1)), int(match.group(2))


def _loras(value: LoraValue | None) -> list[stages_pb2.LoraAdapter]:
    items: list[str | LoraField] = [] if value is None else value if isinstance(value, list) else [value]
    adapters = []
    for item in items:
        if isinstance(item, LoraField):
            name, scale = item.name, item.scale
        else:
            name, scale = _lora_spec(item)
        adapter = stages_pb2.LoraAdapter(name=name)
        if scale is not None:
            adapter.scale = scale
        adapters.append(adapter)
    return adapters


def _lora_spec(spec: str) -> tuple[str, float | None]:
    """(name, scale) of "NAME" or "NAME:SCALE"."""
    name, colon, text = spec.partition(":")
    if not colon:
        return name, None
    try:
        scale = float(text)
    except ValueError:
        raise invalid("lora", f"{spec[:80]!r}: expected NAME or NAME:SCALE") from None
    if not (math.isfinite(scale) and abs(scale) <= MAX_LORA_SCALE):
        raise invalid("lora", f"{spec[:80]!r}: the scale must be -{MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g}")
    return name, scale


def generate_request(body: Diffusion, request_id: str) -> generation_pb2.GenerateRequest:
    """The GenerateRequest of the fields every route shares; the orchestrator fills in the defaults."""
    request = generation_pb2.GenerateRequest(
        model=body.model, prompt=body.prompt, negative_prompt=body.negative_prompt, request_id=request_id
    )
    size = parse_size(body.size)
    width, height = size if size is not None else (None, None)
    for name, explicit, from_size in (("width", body.width, width), ("height", body.height, height)):
        if explicit is not None and from_size is not None and explicit != from_size:
            raise invalid(name, f"{explicit} disagrees with size {body.size}; give one of them")
        value = explicit if explicit is not None else from_size
        if value is not None:
            setattr(request, name, value)
    for name in ("num_inference_steps", "guidance_scale", "embedded_guidance_scale", "seed"):
        value = getattr(body, name)
        if value is not None:
            setattr(request, name, value)
    if body.cache is not None:
        request.cache.method = body.cache
    if body.cache_threshold is not None:
        request.cache.threshold = body.cache_threshold
    request.loras.extend(_loras(body.lora))
    return request


def duration_text(frames: int, fps: float) -> str:
    """A clip's seconds as the video object gives them: "1.12" for 9 frames at 8 fps, "4" for 64 at 16."""
    return f"{frames / fps:.2f}".rstrip("0").rstrip(".") if fps else "0"


def frames_for_seconds(
    seconds: float, fps: float, temporal_factor: int, max_frames: int
) -> tuple[int, stages_pb2.Notice | None]:
    """The frame count of a clip of `seconds` at `fps` that the model makes (temporal_factor * k + 1 frames, at
    most `max_frames`), and the notice of the change when the clip is not `seconds` long."""
    factor = max(1, temporal_factor)
    wanted = round(seconds * fps / factor)
    longest = (max_frames - 1) // factor if max_frames else max(1, wanted)
    steps = min(max(1, wanted), longest)
    frames = factor * steps + 1
    if math.isclose(frames, seconds * fps):
        return frames, None
    given, used = f"{seconds:g}", duration_text(frames, fps)
    if wanted > steps:
        why = f"the model makes at most {max_frames} frames ({frames} at {fps:g} fps)"
    elif wanted < steps:
        why = f"the model makes at least {frames} frames ({fps:g} fps)"
    else:
        why = f"the model makes {factor}*k+1 frames, and {frames} at {fps:g} fps are the nearest"
    return frames, stages_pb2.Notice(
        field="seconds",
        given=f"{given} s",
        used=f"{used} s",
        message=f"the video is {used} s long, not {given} s: {why}",
        source="http",
    )


def quality_for_compression(compression: int) -> tuple[int, stages_pb2.Notice | None]:
    """The encoder's quality (1-100) for OpenAI's `output_compression` (0-100), and the notice of the change
    when there is no quality 100 - compression (compression 100)."""
    quality = 100 - compression
    if quality >= 1:
        return quality, None
    return 1, stages_pb2.Notice(
        field="output_compression",
        given=str(compression),
        used="99",
        message=f"output_compression {compression} is taken as 99: the encoder's quality is 100 - "
        "output_compression, from 1 to 100",
        source="http",
    )


def notice_objects(notices: Iterable[stages_pb2.Notice]) -> list[dict[str, str]]:
    """A job's notices as the HTTP answers list them."""
    return [
        {"field": n.field, "given": n.given, "used": n.used, "message": n.message, "source": n.source} for n in notices
    ]


_STATUS = {
    generation_pb2.JOB_STATE_QUEUED: "queued",
    generation_pb2.JOB_STATE_RUNNING: "in_progress",
    generation_pb2.JOB_STATE_SUCCEEDED: "completed",
    generation_pb2.JOB_STATE_FAILED: "failed",
    generation_pb2.JOB_STATE_CANCELLED: "failed",
}


def video_object(job: generation_pb2.Job) -> dict:
    """A job as OpenAI's Video object, with StageDiff's own fields after OpenAI's."""
    request = job.request
    frames = job.num_frames_out or request.num_frames
    fps = job.fps_out or request.fps
    video = {
        "id": job.job_id,
        "object": "video",
        "model": request.model,
        "status": _STATUS.get(job.state, "queued"),
        "progress": int(job.progress_percent),
        "created_at": job.created_at.seconds,
        "completed_at": job.finished_at.seconds if job.HasField("finished_at") else None,
        "expires_at": None,
        "prompt": request.prompt,
        "seconds": duration_text(frames, fps),
        "size": f"{request.width}x{request.height}",
        "error": None,
        "remixed_from_video_id": None,
        # StageDiff's fields: what the job ran with and where it is.
        "num_frames": frames,
        "fps": fps,
        "seed": request.seed,
        "num_inference_steps": request.num_inference_steps,
        "guidance_scale": request.guidance_scale,
        "output_format": request.output_format,
        "queue_position": job.queue_position if job.state == generation_pb2.JOB_STATE_QUEUED else None,
        "current_stage": job.current_stage or None,
        # What was changed in the request without the caller asking (a truncated prompt, seconds clamped).
        "notices": notice_objects(job.notices),
    }
    if job.state == generation_pb2.JOB_STATE_CANCELLED:
        video["error"] = {"code": "cancelled", "message": job.error.message or "the job was cancelled"}
    elif job.HasField("error") and job.error.code:
        video["error"] = {"code": _code_name(job.error.code), "message": job.error.message}
    return video


def _code_name(value: int) -> str:
    return next((code.name.lower() for code in grpc.StatusCode if code.value[0] == value), "unknown")


def _cache(cache: stages_pb2.StepCache) -> dict:
    return {"method": cache.method or "none", "threshold": cache.threshold if cache.HasField("threshold") else None}


def model_object(model: generation_pb2.ModelDescription) -> dict:
    """A model as OpenAI's Model object, with what a request to it may ask (its defaults and limits) after
    OpenAI's fields: enough for a client (the playground) to offer only the controls the model takes."""
    limits = model.limits
    return {
        "id": model.id,
        "object": "model",
        "created": 0,
        "owned_by": "stagediff",
        "family": model.family,
        # What a request makes: a model that makes one frame makes images (POST /v1/images/...).
        "output": "image" if limits.max_frames == 1 else "video",
        "loras": [lora.name for lora in limits.loras],
        "image_roles": list(limits.image_roles),
        "default_size": f"{limits.default_width}x{limits.default_height}",
        "default_num_frames": limits.default_num_frames,
        "default_fps": limits.default_fps,
        # Replicas serving the model at each stage of its chain now (0: it waits for one).
        "serving_replicas": dict(model.serving_replicas),
        # "serving", or why not: scaled to zero (requests wait for a replica to start), unavailable.
        "status": model.status,
        # The bounds the orchestrator checks a request against, and the defaults of the fields left unset.
        "limits": {
            "width_multiple": limits.width_multiple,
            "height_multiple": limits.height_multiple,
            "max_width": limits.max_width,
            "max_height": limits.max_height,
            "min_height": limits.min_height or limits.height_multiple,
            "temporal_factor": limits.temporal_factor,
            "max_frames": limits.max_frames,
            "max_inference_steps": limits.max_inference_steps,
            "default_num_inference_steps": limits.default_inference_steps,
            "default_guidance_scale": limits.default_guidance_scale,
            # Set for a guidance-distilled model only (FLUX.1-dev): the guidance its transformer embeds.
            "default_embedded_guidance_scale": (
                limits.default_embedded_guidance_scale if limits.HasField("default_embedded_guidance_scale") else None
            ),
            "max_prompt_chars": limits.max_prompt_chars,
            "required_image_roles": list(limits.required_image_roles),
            "max_images": limits.max_images,
            "max_image_bytes": limits.max_image_bytes,
            # Step caches besides "none" (always allowed), each with the threshold it gets unless one is sent.
            "cache_methods": [_cache(cache) for cache in limits.cache_methods],
            "default_cache": _cache(limits.default_cache),
            "max_loras": limits.max_loras,
        },
    }
