"""Input image files too large for a request message, sent ahead through Generation.UploadImage.

The orchestrator takes request messages of at most 4 MiB; an image file over INLINE_IMAGE_BYTES travels on its
own, in chunks of UPLOAD_CHUNK_BYTES, and the request names it by the upload id the orchestrator returns.
`with_uploads` does that for a request, given the call that sends one file's chunks: the SDK's clients and
the HTTP gateway (a client of the orchestrator) share it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from stagediff.v1 import generation_pb2, image_pb2

INLINE_IMAGE_BYTES = 1 << 20
UPLOAD_CHUNK_BYTES = 1 << 20

Upload = Callable[[list[image_pb2.ImageUploadChunk]], Awaitable[image_pb2.UploadedImage]]


def upload_chunks(data: bytes) -> list[image_pb2.ImageUploadChunk]:
    return [
        image_pb2.ImageUploadChunk(data=data[start : start + UPLOAD_CHUNK_BYTES])
        for start in range(0, len(data), UPLOAD_CHUNK_BYTES)
    ]


async def with_uploads(request: generation_pb2.GenerateRequest, upload: Upload) -> generation_pb2.GenerateRequest:
    """`request` with each image over INLINE_IMAGE_BYTES uploaded by `upload` and named by its upload id."""
    large = [index for index, image in enumerate(request.images) if len(image.data) > INLINE_IMAGE_BYTES]
    if not large:
        return request
    prepared = generation_pb2.GenerateRequest()
    prepared.CopyFrom(request)
    for index in large:
        uploaded = await upload(upload_chunks(prepared.images[index].data))
        prepared.images[index].ClearField("data")
        prepared.images[index].upload_id = uploaded.upload_id
    return prepared
