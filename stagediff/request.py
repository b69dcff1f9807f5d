"""What a generate call asks for: `RequestOptions`, the keywords of every generate, stream and submit call, and
`build_request`, which turns them into the GenerateRequest the orchestrator takes.

    request = build_request("a red fox in the snow", height=64, width=64, num_frames=9, seed=7)

The keywords are declared once, here, as a TypedDict: `Client.generate(prompt, **options)` is typed by it
(`Unpack[RequestOptions]`), so an editor completes and a type checker checks every keyword, and an unknown one
is refused (TypeError naming it) before anything is sent.
"""

from __future__ import annotations

import difflib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, Unpack

from stagediff.media import ImageLike, encode_image
from stagediff.v1 import generation_pb2, image_pb2


class RequestOptions(TypedDict, total=False):
    """The keywords of a generate call; each one left out takes the model's default on the server."""

    # A model id from ListModels; "" for the cluster's only model.
    model: str
    # What to steer away from (used with guidance_scale above 1).
    negative_prompt: str
    # The output's size in pixels (Wan: multiples of 16).
    height: int
    width: int
    # Frames to make (Wan: 4k+1; 1 for an image model).
    num_frames: int
    num_inference_steps: int
    # The CFG scale with the negative prompt (qwen-image's and flux's true_cfg_scale).
    guidance_scale: float
    # The guidance a guidance-distilled model embeds (FLUX.1-dev's, FluxPipeline's guidance_scale); refused by
    # every other model.
    embedded_guidance_scale: float
    # The initial noise's seed; unset, the server picks one (GenerationResult.seed reports it).
    seed: int
    # The output's frame rate.
    fps: float
    # Frame interpolation: 2**interp_exp times the frames, 0 for none; the interpolator's flow scale
    # (0.25 .. 4; 0 means 1); weights the cluster serves ("" for whatever it serves).
    interp_exp: int
    interp_scale: float
    interp_model_path: str
    # The id that makes a retried call attach to the same job; unset or "", one is generated.
    request_id: str
    # The first frame of image-to-video (for an editing model, the image to edit: the model's first role);
    # the last frame where the model takes one; the images of a model that takes references. Each is a
    # path, bytes, a PIL image or a uint8 array.
    image: ImageLike
    last_image: ImageLike
    reference_images: Sequence[ImageLike]
    # The DiT's step cache: "none", or a method the model lists in ModelLimits.cache_methods ("first_block",
    # "mag", "teacache"); and its threshold (higher skips more).
    cache: str
    cache_threshold: float
    # LoRA adapters for this request only: {name: scale}, or names (scale 1) and (name, scale) pairs, from
    # those ListModels shows the tenant (ModelLimits.loras).
    loras: Mapping[str, float] | Sequence[str | tuple[str, float]]
    # How the result comes back: "raw" (the default) for uint8 frames; "mp4", "webm" or "gif" for a video,
    # "png", "jpeg" or "webp" for a one-frame result, encoded on the server (GenerationResult.data).
    output_format: str
    # 1 (smallest) to 100 (best) for mp4, webm, jpeg and webp; unset, the format's default.
    output_quality: int
    # With an encoded output_format, also send (and keep on the server) the raw frames.
    keep_raw_frames: bool
    # For a model that makes video with sound (LTX-2): "" or unset for the output format's own (aac in mp4,
    # opus in webm, the float32 waveform in GenerationResult.audio with raw), "none" for a silent result, or
    # "aac" (mp4), "opus" (webm), "raw" (raw) by name.
    audio_codec: str
    # Seconds from submission by which the job should be done: jobs of a priority class are ordered by their
    # slack, and a job that cannot be done in time is refused at once (RESOURCE_EXHAUSTED, with the estimate).
    deadline_s: float


OPTION_NAMES = frozenset(RequestOptions.__annotations__)


def _unknown_keywords(unknown: list[str]) -> str:
    """Why `unknown` keywords are refused: each with the close match it may be a typo of, then every keyword."""
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name, OPTION_NAMES, n=1)
        named.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return (
        f"unknown keyword{'s' if len(unknown) > 1 else ''} {', '.join(named)}; the request keywords are "
        f"{', '.join(sorted(OPTION_NAMES))}"
    )


def build_request(prompt: str, **options: Unpack[RequestOptions]) -> generation_pb2.GenerateRequest:
    """The GenerateRequest for `prompt` and `options` (RequestOptions); options left out (or None) take the
    model's defaults on the server. An unknown keyword raises TypeError naming it."""
    unknown = sorted(set(options) - OPTION_NAMES)
    if unknown:
        raise TypeError(_unknown_keywords(unknown))
    # The options set (None: left out); RequestOptions has typed them for the caller.
    given: dict[str, Any] = {name: value for name, value in options.items() if value is not None}
    request = generation_pb2.GenerateRequest(
        model=given.get("model", ""),
        prompt=prompt,
        negative_prompt=given.get("negative_prompt", ""),
        request_id=given.get("request_id") or uuid.uuid4().hex,
        output_format=given.get("output_format", ""),
        keep_raw_frames=given.get("keep_raw_frames", False),
        audio_codec=given.get("audio_codec", ""),
    )
    for value, role in (
        (given.get("image"), image_pb2.IMAGE_ROLE_UNSPECIFIED),
        (given.get("last_image"), image_pb2.IMAGE_ROLE_LAST_FRAME),
        *((reference, image_pb2.IMAGE_ROLE_REFERENCE) for reference in given.get("reference_images", ())),
    ):
        if value is not None:
            request.images.add(data=encode_image(value), role=role)
    for name in (
        "height",
        "width",
        "num_frames",
        "num_inference_steps",
        "guidance_scale",
        "embedded_guidance_scale",
        "seed",
        "fps",
        "output_quality",
        "deadline_s",
    ):
        if name in given:
            setattr(request, name, given[name])
    if "cache" in given:
        request.cache.method = given["cache"]
    if "cache_threshold" in given:
        request.cache.threshold = given["cache_threshold"]
    loras = given.get("loras", ())
    for lora in loras.items() if isinstance(loras, Mapping) else loras:
        name, scale = (lora, None) if isinstance(lora, str) else lora
        adapter = request.loras.add(name=name)
        if scale is not None:
            adapter.scale = scale
    if given.get("interp_exp"):
        request.interpolation.enable = True
        request.interpolation.exp = given["interp_exp"]
        request.interpolation.scale = given.get("interp_scale", 0.0)
        request.interpolation.model_path = given.get("interp_model_path", "")
    return request
