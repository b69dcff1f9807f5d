"""Video downloads: a job's encoded file streamed as the orchestrator sends it, a bounded number at once per key.

Each download holds a WatchJob stream on the orchestrator and reads the whole file, so one key may have at most
`per_key` of them open at once (`--max-downloads-per-key`); beyond, 429 with Retry-After. Keys are counted by
their SHA-256 (key_check.key_digest), and a slot is given back when its response ends, however it ends.
A result of raw frames (a job submitted over gRPC without an output format) is not encoded here: the gateway
would spend a second of CPU or more on every download of it, counted by no quota; its download is a 409 that
says how to get a file instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.errors import ApiError
from services.gateway.key_check import key_digest
from services.gateway.options import DEFAULT_MAX_DOWNLOADS_PER_KEY
from stagediff.v1 import generation_pb2

RETRY_AFTER_S = 1


def raw_result(video_id: str) -> ApiError:
    return ApiError(
        409,
        f"video {video_id} was made as raw frames (output_format raw), which are not encoded here; read them over "
        "gRPC (WatchJob), or submit the request again with output_format mp4 (the HTTP API's default)",
        type="invalid_request_error",
        code="raw_result",
    )


class DownloadSlots:
    """How many downloads each key has open, at most `per_key`."""

    def __init__(self, per_key: int = DEFAULT_MAX_DOWNLOADS_PER_KEY) -> None:
        self.per_key = per_key
        self._open: dict[bytes, int] = {}

    def take(self, authorization: str | None) -> bytes:
        """A slot for the key's download (its digest, for `give_back`), or 429."""
        digest = key_digest(authorization)
        taken = self._open.get(digest, 0)
        if taken >= self.per_key:
            raise ApiError(
                429,
                f"this key has {taken} downloads open, the most it may (--max-downloads-per-key); retry when one ends",
                type="rate_limit_error",
                code="too_many_downloads",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._open[digest] = taken + 1
        return digest

    def give_back(self, digest: bytes) -> None:
        left = self._open.pop(digest, 1) - 1
        if left > 0:
            self._open[digest] = left


class SlotResponse(StreamingResponse):
    """A streamed download that gives its slot back, and closes its source, when it ends however it ends."""

    def __init__(
        self, slots: DownloadSlots, digest: bytes, content: AsyncGenerator[bytes, None], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._slots = slots
        self._digest = digest
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slots.give_back(self._digest)
            with contextlib.suppress(RuntimeError):  # a source still running: its cancellation closes it
                await self._content.aclose()


async def encoded_bytes(events: AsyncIterator[generation_pb2.GenerateEvent]) -> AsyncGenerator[bytes, None]:
    """The encoded file's bytes from a job's events, in order (raw frames, if kept, are passed over)."""
    offset = 0
    async for event in events:
        if event.WhichOneof("event") == "result" and event.result.HasField("encoded"):
            chunk = event.result.encoded
            if chunk.offset != offset:
                raise ApiError(502, f"the orchestrator sent bytes at {chunk.offset}, {offset} expected")
            offset += len(chunk.data)
            if chunk.data:
                yield chunk.data


async def prepend(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    try:
        if first:
            yield first
        async for data in rest:
            yield data
    finally:
        await rest.aclose()
