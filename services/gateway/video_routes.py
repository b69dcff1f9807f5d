"""The video routes: submit a job (JSON or multipart, `input_reference` as a file), list, get, delete, and the
job's content (the encoded video, streamed as the orchestrator sends it, or a 307 to a presigned URL of the
object store where the orchestrator presigns downloads) and events (server-sent events)."""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile

from services.encoding import OUTPUT_FORMATS, RAW
from services.gateway.bodies import read_body
from services.gateway.downloads import DownloadSlots, SlotResponse, encoded_bytes, prepend, raw_result
from services.gateway.errors import ApiError, invalid
from services.gateway.events import server_sent_events
from services.gateway.orchestrator import Orchestrator
from services.gateway.request_ids import request_id
from services.gateway.schemas import VideoCreate, frames_for_seconds, generate_request, video_object
from stagediff.v1 import generation_pb2, image_pb2, stages_pb2

MAX_LIST_LIMIT = 100


def video_routes(orchestrator: Orchestrator, downloads: DownloadSlots) -> APIRouter:
    """The /v1/videos routes, served from `orchestrator`; `downloads` bounds the content downloads per key."""
    router = APIRouter()

    @router.post("/v1/videos")
    async def create_video(request: Request) -> JSONResponse:
        async with read_body(request, VideoCreate) as (body, files):
            image = await _input_reference(body.input_reference, files.get("input_reference", []))
        authorization = request.headers.get("authorization")
        grpc_request = generate_request(body, request_id(request))
        if body.fps is not None:
            grpc_request.fps = body.fps
        if body.num_frames is not None and body.seconds is not None:
            raise invalid("seconds", "give seconds or num_frames, not both")
        if body.num_frames is not None:
            grpc_request.num_frames = body.num_frames
        elif body.seconds is not None:
            limits = await _limits(orchestrator, body.model, authorization)
            fps = body.fps or limits.default_fps
            frames, notice = frames_for_seconds(body.seconds, fps, limits.temporal_factor, limits.max_frames)
            grpc_request.num_frames = frames
            if notice is not None:
                grpc_request.notices.append(notice)
        if body.enable_frame_interpolation:
            grpc_request.interpolation.enable = True
            grpc_request.interpolation.exp = body.frame_interpolation_exp
            grpc_request.interpolation.scale = body.frame_interpolation_scale
        grpc_request.output_format = body.output_format
        grpc_request.audio_codec = body.audio_codec
        if body.output_quality is not None:
            grpc_request.output_quality = body.output_quality
        if image is not None:
            grpc_request.images.add(data=image, role=image_pb2.IMAGE_ROLE_UNSPECIFIED)
        job = await orchestrator.submit(grpc_request, authorization)
        return JSONResponse(video_object(job))

    # response_model=None: the page is returned as built, not validated against the annotation.
    @router.get("/v1/videos", response_model=None)
    async def list_videos(
        request: Request, limit: int = 20, after: str | None = None, order: str = "desc"
    ) -> dict[str, Any]:
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

    @router.get("/v1/videos/{video_id}")
    async def get_video(video_id: str, request: Request) -> dict:
        return video_object(await orchestrator.get_job(video_id, request.headers.get("authorization")))

    @router.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str, request: Request) -> dict:
        answer = await orchestrator.delete_job(video_id, request.headers.get("authorization"))
        return {"id": answer.job_id, "object": "video.deleted", "deleted": answer.deleted}

    @router.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, request: Request, variant: str = "video") -> Response:
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
        if job.download_url:  # the orchestrator presigns downloads: the file comes from the object store itself
            return RedirectResponse(job.download_url, status_code=307)
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

    @router.get("/v1/videos/{video_id}/events")
    async def video_events(video_id: str, request: Request) -> StreamingResponse:
        authorization = request.headers.get("authorization")
        await orchestrator.get_job(video_id, authorization)  # a 404 before the stream starts
        return StreamingResponse(
            server_sent_events(orchestrator, video_id, authorization),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return router


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


async def _limits(orchestrator: Orchestrator, model: str, authorization: str | None) -> stages_pb2.ModelLimits:
    """The ModelLimits of `model` (or of the only model), for turning seconds into frames."""
    models = await orchestrator.list_models(authorization)
    for description in models:
        if description.id == model or (not model and len(models) == 1):
            return description.limits
    if not model:
        names = ", ".join(description.id for description in models)
        raise ApiError(400, f"model: this cluster serves several models; name one of {names}", param="model")
    raise ApiError(404, f"model: {model!r} is not served here", param="model", type="not_found_error")
