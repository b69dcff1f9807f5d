"""The HTTP gateway's routes: OpenAI-compatible videos, images and models, in front of the orchestrator.

    POST   /v1/videos                   submit a video job (JSON or multipart, `input_reference` as a file)
    GET    /v1/videos                   the caller's jobs, newest first
    GET    /v1/videos/{id}              a job as OpenAI's Video object (status, progress 0-100, error)
    GET    /v1/videos/{id}/content      the encoded video, streamed as the orchestrator sends it
    GET    /v1/videos/{id}/events       the job's progress as server-sent events, until it ends
    DELETE /v1/videos/{id}              cancel the job and delete it with its result
    POST   /v1/images/generations       `n` images, answered once made (b64_json)
    POST   /v1/images/edits             the same from input images (multipart `image`), for editing models
    GET    /v1/models                   the models the caller may use
    GET    /healthz, /readyz            the process is up; the orchestrator answers

A video job is the orchestrator's job: its id works with the gRPC API too (WatchJob, GetJob, CancelJob), and
the orchestrator's tenants, keys, quotas and durability apply unchanged. The gateway keeps no state of its own,
so any number of gateways may serve one orchestrator. Before a route runs, the key is checked (key_check.py)
and the body bounded (bodies.py); connections have deadlines (connections.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.encoding import OUTPUT_FORMATS, RAW
from services.gateway.bodies import BodyLimit, read_body
from services.gateway.downloads import (
    DownloadSlots,
    SlotResponse,
    encoded_bytes,
    prepend,
    raw_result,
)
from services.gateway.errors import ApiError, from_http_exception, from_stagediff_error, invalid, validation_error
from services.gateway.events import server_sent_events
from services.gateway.headers import AuthorizationCheck
from services.gateway.key_check import KeyCheck, KeyFirst
from services.gateway.options import DEFAULT_MAX_DOWNLOADS_PER_KEY
from services.gateway.orchestrator import Orchestrator
from services.gateway.schemas import (
    ImageEdit,
    ImageGenerate,
    VideoCreate,
    frames_for_seconds,
    generate_request,
    video_object,
)
from services.launch_id import launch_id
from stagediff.errors import StageDiffError
from stagediff.v1 import generation_pb2, image_pb2

MAX_IDEMPOTENCY_KEY_CHARS = 100
MAX_LIST_LIMIT = 100


def create_app(
    orchestrator: Orchestrator,
    *,
    max_body_bytes: int,
    image_wait_s: float,
    max_downloads_per_key: int = DEFAULT_MAX_DOWNLOADS_PER_KEY,
    openapi: bool = False,
) -> FastAPI:
    """The gateway's app. `openapi` serves /openapi.json (behind the key, as every route but /healthz and
    /readyz); there is no /docs page, whose script would come from a CDN."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await orchestrator.close()

    app = FastAPI(
        title="StageDiff HTTP gateway",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if openapi else None,
        lifespan=lifespan,
    )
    app.state.orchestrator = orchestrator
    downloads = DownloadSlots(max_downloads_per_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StageDiffError)
    async def orchestrator_error(request: Request, error: StageDiffError) -> JSONResponse:
        return from_stagediff_error(error).response()

    @app.exception_handler(RequestValidationError)
    async def query_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return from_http_exception(error).response()

    # The last added runs first: a declared Content-Length over the limit is 413 before the key is checked, and
    # the key is checked before the route reads a byte of the body.
    app.add_middleware(KeyFirst, check=KeyCheck(orchestrator))
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(AuthorizationCheck)  # the outermost: before any body is read

    # ---------------------------------------------------------------- videos --

    @app.post("/v1/videos")
    async def create_video(request: Request) -> JSONResponse:
        async with read_body(request, VideoCreate) as (body, files):
            image = await _input_reference(body.input_reference, files.get("input_reference", []))
        authorization = request.headers.get("authorization")
        grpc_request = generate_request(body, _request_id(request))
        if body.fps is not None:
            grpc_request.fps = body.fps
        if body.num_frames is not None and body.seconds is not None:
            raise invalid("seconds", "give seconds or num_frames, not both")
        if body.num_frames is not None:
            grpc_request.num_frames = body.num_frames
        elif body.seconds is not None:
            limits = await _limits(orchestrator, body.model, authorization)
            fps = body.fps or limits.default_fps
            grpc_request.num_frames = frames_for_seconds(body.seconds, fps, limits.temporal_factor, limits.max_frames)
        if body.enable_frame_interpolation:
            grpc_request.interpolation.enable = True
            grpc_request.interpolation.exp = body.frame_interpolation_exp
            grpc_request.interpolation.scale = body.frame_interpolation_scale
        grpc_request.output_format = body.output_format
        if body.output_quality is not None:
            grpc_request.output_quality = body.output_quality
        if image is not None:
            grpc_request.images.add(data=image, role=image_pb2.IMAGE_ROLE_UNSPECIFIED)
        job = await orchestrator.submit(grpc_request, authorization)
        return JSONResponse(video_object(job))

    @app.get("/v1/videos")
    async def list_videos(request: Request, limit: int = 20, after: str | None = None, order: str = "desc"):
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise invalid("limit", f"{limit} is not allowed; use 1 to {MAX_LIST_LIMIT}")
        if order not in ("asc", "desc"):
            raise invalid("order", f"{order[:16]!r} is not allowed; use asc or desc")
        # The newest page needs limit + 1 jobs (the one more says has_more); a cursor or the oldest first needs
        # the whole window the orchestrator lists.
        window = limit + 1 if order == "desc" and after is None else MAX_LIST_LIMIT
        jobs = await orchestrator.list_jobs(window, request.headers.get("authorization"))
        if order == "asc":
            jobs.reverse()
        if after is not None:
            ids = [job.job_id for job in jobs]
            jobs = jobs[ids.index(after) + 1 :] if after in ids else []
        page = [video_object(job) for job in jobs[:limit]]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(jobs) > limit,
        }

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str, request: Request) -> dict:
        return video_object(await orchestrator.get_job(video_id, request.headers.get("authorization")))

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str, request: Request) -> dict:
        answer = await orchestrator.delete_job(video_id, request.headers.get("authorization"))
        return {"id": answer.job_id, "object": "video.deleted", "deleted": answer.deleted}

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, request: Request, variant: str = "video") -> StreamingResponse:
        if variant != "video":
            raise invalid("variant", f"{variant[:32]!r} is not served; use video")
        authorization = request.headers.get("authorization")
        job = await orchestrator.get_job(video_id, authorization)
        if job.state != generation_pb2.JOB_STATE_SUCCEEDED:
            status = video_object(job)["status"]
            raise ApiError(409, f"video {video_id} is {status}; its content is ready once completed", code="not_ready")
        output = OUTPUT_FORMATS[job.request.output_format or RAW]
        if output.name == RAW:  # submitted over gRPC for raw frames
            raise raw_result(video_id)
        slot = downloads.take(authorization)
        data = encoded_bytes(orchestrator.watch(video_id, authorization))
        try:
            # The first chunk is read before answering, so that a result deleted meanwhile is a 404, not a cut file.
            first = await anext(data, b"")
        except BaseException:
            downloads.give_back(slot)
            await data.aclose()
            raise
        headers = {"Content-Disposition": f'attachment; filename="{video_id}{output.extension}"'}
        content = prepend(first, data)
        return SlotResponse(downloads, slot, content, media_type=output.media_type, headers=headers)

    @app.get("/v1/videos/{video_id}/events")
    async def video_events(video_id: str, request: Request) -> StreamingResponse:
        authorization = request.headers.get("authorization")
        await orchestrator.get_job(video_id, authorization)  # a 404 before the stream starts
        return StreamingResponse(
            server_sent_events(orchestrator, video_id, authorization),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # ---------------------------------------------------------------- images --

    @app.post("/v1/images/generations")
    async def generate_images(request: Request) -> dict:
        async with read_body(request, ImageGenerate) as (body, _):
            pass
        return await _images(orchestrator, request, body, [], image_wait_s)

    @app.post("/v1/images/edits")
    async def edit_images(request: Request) -> dict:
        async with read_body(request, ImageEdit, ignore=("image", "image[]", "mask")) as (body, files):
            if files.get("mask"):
                raise invalid("mask", "masks are not supported; the edit model takes the whole image and the prompt")
            images = [await upload.read() for upload in files.get("image", []) + files.get("image[]", [])]
        if not images:
            raise invalid("image", "an image to edit is required (a file in a multipart body)")
        return await _images(orchestrator, request, body, images, image_wait_s)

    # ---------------------------------------------------------------- models --

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        models = await orchestrator.list_models(request.headers.get("authorization"))
        return {
            "object": "list",
            "data": [
                {
                    "id": model.id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "stagediff",
                    "family": model.family,
                    "loras": [lora.name for lora in model.limits.loras],
                    "image_roles": list(model.limits.image_roles),
                    "default_size": f"{model.limits.default_width}x{model.limits.default_height}",
                    "default_num_frames": model.limits.default_num_frames,
                    "default_fps": model.limits.default_fps,
                }
                for model in models
            ],
        }

    # ---------------------------------------------------------------- health --

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if await orchestrator.serving():
            # The id of this process where whoever started it gave one (services/launch_id.py).
            return JSONResponse({"status": "ready", **({"launch_id": launch_id()} if launch_id() else {})})
        message = f"the orchestrator at {orchestrator.endpoint} is not serving"
        return ApiError(503, message, type="service_unavailable_error", code="not_ready").response()

    return app


def _request_id(request: Request) -> str:
    """The client's Idempotency-Key (a retried POST attaches to the same job), or a fresh id."""
    key = request.headers.get("idempotency-key")
    if key is None:
        return uuid.uuid4().hex
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise invalid("Idempotency-Key", f"use 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters")
    return key


async def _input_reference(value: str | dict | None, uploads: list[UploadFile]) -> bytes | None:
    """The image of `input_reference`: an uploaded file, or a data URL (also as {"image_url": ...})."""
    if uploads:
        if len(uploads) > 1:
            raise invalid("input_reference", "one image is taken")
        return await uploads[0].read()
    if value is None:
        return None
    url = value.get("image_url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise invalid("input_reference", "an image file, or {'image_url': 'data:image/...;base64,...'} is expected")
    if not url.startswith("data:"):
        raise invalid("input_reference", "only data URLs are taken (the gateway fetches nothing); upload the file")
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise invalid("input_reference", "a base64 data URL is expected")
    try:
        return await asyncio.to_thread(base64.b64decode, payload, validate=True)
    except binascii.Error:
        raise invalid("input_reference", "the data URL's base64 is malformed") from None


async def _limits(orchestrator: Orchestrator, model: str, authorization: str | None):
    """The ModelLimits of `model` (or of the only model), for turning seconds into frames."""
    models = await orchestrator.list_models(authorization)
    for description in models:
        if description.id == model or (not model and len(models) == 1):
            return description.limits
    raise ApiError(404, f"model: {model!r} is not served here", param="model", type="not_found_error")


async def _images(
    orchestrator: Orchestrator, request: Request, body: ImageGenerate, images: list[bytes], wait_s: float
) -> dict:
    """Submits `n` one-frame jobs (seeds seed, seed + 1, ...) and answers with their encoded images."""
    if body.response_format != "b64_json":
        raise invalid("response_format", "url is not served (the gateway keeps no files); use b64_json")
    authorization = request.headers.get("authorization")
    request_id = _request_id(request)
    jobs: list[str] = []
    try:
        for index in range(body.n):
            grpc_request = generate_request(body, f"{request_id}-{index}" if body.n > 1 else request_id)
            grpc_request.num_frames = 1
            grpc_request.output_format = body.output_format
            if body.output_compression is not None and body.output_format != "png":
                grpc_request.output_quality = max(1, 100 - body.output_compression)
            if body.seed is not None:
                grpc_request.seed = body.seed + index
            for position, data in enumerate(images):
                role = image_pb2.IMAGE_ROLE_UNSPECIFIED if position == 0 else image_pb2.IMAGE_ROLE_REFERENCE
                grpc_request.images.add(data=data, role=role)
            jobs.append((await orchestrator.submit(grpc_request, authorization)).job_id)
        async with asyncio.timeout(wait_s):
            results = await asyncio.gather(*(_image(orchestrator, job_id, authorization) for job_id in jobs))
    except TimeoutError:
        raise ApiError(
            504,
            f"the images were not ready within {wait_s:g} s; their jobs go on: {', '.join(jobs)}",
            type="timeout_error",
            code="timeout",
        ) from None
    except (asyncio.CancelledError, StageDiffError):
        # The client went away, or one job failed: the others are not wanted any more.
        await asyncio.gather(*(_abandon(orchestrator, job_id, authorization) for job_id in jobs))
        raise
    first = await orchestrator.get_job(jobs[0], authorization)
    return {
        "created": int(time.time()),
        "data": [
            {"b64_json": base64.b64encode(data).decode(), "revised_prompt": None, "seed": seed}
            for data, seed in results
        ],
        "output_format": body.output_format,
        "size": f"{first.request.width}x{first.request.height}",
        "job_ids": jobs,
    }


async def _image(orchestrator: Orchestrator, job_id: str, authorization: str | None) -> tuple[bytes, int]:
    """An image job's encoded file and seed, once it has finished."""
    parts, seed = [], 0
    async for event in orchestrator.watch(job_id, authorization):
        kind = event.WhichOneof("event")
        if kind == "result" and event.result.HasField("encoded"):
            parts.append(event.result.encoded.data)
        elif kind == "completed":
            seed = event.completed.seed
    return b"".join(parts), seed


async def _abandon(orchestrator: Orchestrator, job_id: str, authorization: str | None) -> None:
    """Cancels and deletes a job whose answer nobody waits for; best effort (it may have gone meanwhile)."""
    with contextlib.suppress(StageDiffError):
        await orchestrator.delete_job(job_id, authorization)
