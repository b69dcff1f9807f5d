"""The HTTP bodies of the OpenAI-style routes, and how each becomes a GenerateRequest or comes from a Job.

Field names are OpenAI's where OpenAI has the field (`prompt`, `size`, `seconds`, `n`, `response_format`,
`output_format`, `output_compression`, `input_reference`) and the diffusion serving convention's elsewhere
(`negative_prompt`, `width`, `height`, `num_frames`, `fps`, `num_inference_steps`, `guidance_scale`, `seed`,
`lora`), so that a body written for vLLM-Omni's or SGLang-Diffusion's /v1/videos works here. Unknown fields
are refused (400 naming the field): a misspelled `num_inference_step` must not silently take the default.
Every string and list is bounded here; the orchestrator checks the values against the model's limits.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.gateway.errors import invalid
from stagediff.v1 import generation_pb2

MAX_TEXT = 16_384  # characters of a prompt (the model's own max_prompt_chars is checked by the orchestrator)
MAX_IMAGES_PER_REQUEST = 10  # OpenAI's `n` bound
MAX_LORAS = 16
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT)]
Name = Annotated[str, StringConstraints(max_length=256)]


class LoraField(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name
    scale: float | None = None


# `lora`: "name", "name:scale", {"name": ..., "scale": ...}, or a list of those.
LoraValue = Name | LoraField | Annotated[list[Name | LoraField], Field(max_length=MAX_LORAS)]


class Diffusion(BaseModel):
    """The fields every generation route shares."""

    model_config = ConfigDict(extra="forbid")

    model: Name = ""
    prompt: Text
    negative_prompt: Text = ""
    size: Name | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    lora: LoraValue | None = None
    # The DiT's step cache: "none" or a method the model lists (GET /v1/models), and its threshold.
    cache: Name | None = None
    cache_threshold: float | None = None
    # OpenAI's end-user id: accepted for compatibility, not used.
    user: Name | None = None


class VideoCreate(Diffusion):
    seconds: float | None = Field(default=None, gt=0, le=3600)
    num_frames: int | None = None
    fps: float | None = None
    # Frame interpolation (RIFE, when the cluster runs the interpolator): 2**exp x the frames and frame rate.
    enable_frame_interpolation: bool = False
    frame_interpolation_exp: int = 1
    frame_interpolation_scale: float = 0.0
    output_format: Literal["mp4", "webm", "gif"] = "mp4"
    # 1 (smallest) to 100 (best); unset, the format's default.
    output_quality: int | None = None
    # An image as a data URL ("data:image/png;base64,...") or {"image_url": "data:..."}; as a file in a
    # multipart body. The first frame of image-to-video.
    input_reference: str | dict[str, str] | None = None


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


class ImageEdit(ImageGenerate):
    """POST /v1/images/edits: the fields of a generation; the images to edit come as multipart files."""


def parse_size(size: str | None) -> tuple[int, int] | None:
    """(width, height) of "WxH"; None for None or "auto"."""
    if size is None or size == "auto":
        return None
    match = _SIZE.match(size)
    if match is None:
        raise invalid("size", f"{size[:32]!r} is not a size; use WIDTHxHEIGHT, e.g. 832x480, or auto")
    return int(match.group(1)), int(match.group(2))


def _loras(value: LoraValue | None) -> list[generation_pb2.LoraAdapter]:
    items = [] if value is None else value if isinstance(value, list) else [value]
    adapters = []
    for item in items:
        if isinstance(item, LoraField):
            name, scale = item.name, item.scale
        else:
            name, colon, text = item.partition(":")
            try:
                scale = float(text) if colon else None
            except ValueError:
                raise invalid("lora", f"{item[:80]!r}: expected NAME or NAME:SCALE") from None
        adapter = generation_pb2.LoraAdapter(name=name)
        if scale is not None:
            adapter.scale = scale
        adapters.append(adapter)
    return adapters


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
    for name in ("num_inference_steps", "guidance_scale", "seed"):
        value = getattr(body, name)
        if value is not None:
            setattr(request, name, value)
    if body.cache is not None:
        request.cache.method = body.cache
    if body.cache_threshold is not None:
        request.cache.threshold = body.cache_threshold
    request.loras.extend(_loras(body.lora))
    return request


def frames_for_seconds(seconds: float, fps: float, temporal_factor: int, max_frames: int) -> int:
    """The frame count of a clip of `seconds` at `fps` that the model makes: temporal_factor * k + 1 frames."""
    factor = max(1, temporal_factor)
    steps = max(1, round(seconds * fps / factor))
    if max_frames:
        steps = min(steps, (max_frames - 1) // factor)
    return factor * steps + 1


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
        "seconds": f"{frames / fps:.2f}".rstrip("0").rstrip(".") if fps else "0",
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
    }
    if job.state == generation_pb2.JOB_STATE_CANCELLED:
        video["error"] = {"code": "cancelled", "message": job.error.message or "the job was cancelled"}
    elif job.HasField("error") and job.error.code:
        video["error"] = {"code": _code_name(job.error.code), "message": job.error.message}
    return video


def _code_name(value: int) -> str:
    return next((code.name.lower() for code in grpc.StatusCode if code.value[0] == value), "unknown")
