"""The image routes: `n` images generated, or edited from input images (multipart `image`), answered with their
encoded files (b64_json) once made. Each image is a one-frame job of its own (seeds seed, seed + 1, ...)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time

from fastapi import APIRouter, Request

from services.gateway.bodies import read_body
from services.gateway.errors import ApiError, invalid
from services.gateway.orchestrator import Orchestrator
from services.gateway.request_ids import request_id
from services.gateway.schemas import (
    ImageEdit,
    ImageGenerate,
    generate_request,
    notice_objects,
    quality_for_compression,
)
from stagediff.errors import StageDiffError
from stagediff.v1 import image_pb2


def image_routes(orchestrator: Orchestrator, image_wait_s: float) -> APIRouter:
    """The /v1/images routes, served from `orchestrator`; an answer waits at most `image_wait_s` for its images."""
    router = APIRouter()

    @router.post("/v1/images/generations")
    async def generate_images(request: Request) -> dict:
        async with read_body(request, ImageGenerate) as (body, _):
            pass
        return await _images(orchestrator, request, body, [], image_wait_s)

    @router.post("/v1/images/edits")
    async def edit_images(request: Request) -> dict:
        async with read_body(request, ImageEdit, ignore=("image", "image[]", "mask")) as (body, files):
            if files.get("mask"):
                raise invalid("mask", "masks are not supported; the edit model takes the whole image and the prompt")
            images = [await upload.read() for upload in files.get("image", []) + files.get("image[]", [])]
        if not images:
            raise invalid("image", "an image to edit is required (a file in a multipart body)")
        return await _images(orchestrator, request, body, images, image_wait_s)

    return router


async def _images(
    orchestrator: Orchestrator, request: Request, body: ImageGenerate, images: list[bytes], wait_s: float
) -> dict:
    """Submits `n` one-frame jobs (seeds seed, seed + 1, ...) and answers with their encoded images."""
    if body.response_format != "b64_json":
        raise invalid("response_format", "url is not served (the gateway keeps no files); use b64_json")
    authorization = request.headers.get("authorization")
    base_id = request_id(request)
    jobs: list[str] = []
    try:
        for index in range(body.n):
            grpc_request = generate_request(body, f"{base_id}-{index}" if body.n > 1 else base_id)
            grpc_request.num_frames = 1
            grpc_request.output_format = body.output_format
            if body.output_compression is not None and body.output_format != "png":
                grpc_request.output_quality, notice = quality_for_compression(body.output_compression)
                if notice is not None:
                    grpc_request.notices.append(notice)
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
        # What was changed in the request without the caller asking (the same for each image's job).
        "notices": notice_objects(first.notices),
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
