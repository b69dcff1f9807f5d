"""A job's progress as server-sent events (queued, progress, completed; error if it fails), without its result.

The events come from the job's WatchJob stream until its result begins (the result is the stream's last part,
beside the final stage's progress), and from then on from GetJob every POLL_S, until the job ends: the result's
bytes, up to the whole video, are never read for a stream that would drop them. A comment line every KEEPALIVE_S
while nothing happens (a long queue) keeps proxies from closing the stream. WatchJob is read by a task of its
own, so that waiting for its next event can time out without cancelling the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from services.gateway.errors import from_stagediff_error
from services.gateway.orchestrator import Orchestrator
from services.gateway.schemas import video_object
from stagediff.errors import StageDiffError
from stagediff.v1 import generation_pb2

# Seconds between the comment lines that keep a quiet progress stream open through proxies.
KEEPALIVE_S = 15.0
# Seconds between GetJob calls once the result is being made.
POLL_S = 1.0
_RESULT_BEGINS = object()
_ENDED = (generation_pb2.JOB_STATE_SUCCEEDED, generation_pb2.JOB_STATE_FAILED, generation_pb2.JOB_STATE_CANCELLED)


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _progress(job_id: str, progress: generation_pb2.StageProgress) -> bytes:
    return _sse("progress", {"id": job_id, "stage": progress.stage, "step": progress.step, "total": progress.total})


async def server_sent_events(
    orchestrator: Orchestrator, job_id: str, authorization: str | None
) -> AsyncIterator[bytes]:
    # Events, then the marker of the result, None at the end, or the error that ended the watch.
    events: asyncio.Queue[Any] = asyncio.Queue(maxsize=64)

    async def read() -> None:
        try:
            async with contextlib.aclosing(orchestrator.watch(job_id, authorization)) as watched:
                async for event in watched:
                    if event.WhichOneof("event") == "result":
                        await events.put(_RESULT_BEGINS)
                        return
                    await events.put(event)
            await events.put(None)
        except StageDiffError as error:
            await events.put(error)

    reader = asyncio.create_task(read())
    try:
        while True:
            try:
                item = await asyncio.wait_for(events.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keepalive\n\n"
                continue
            if item is None:
                return
            if item is _RESULT_BEGINS:
                async for line in _polled(orchestrator, job_id, authorization):
                    yield line
                return
            if isinstance(item, StageDiffError):
                yield _sse("error", {"error": from_stagediff_error(item).message, "code": item.code.name.lower()})
                return
            kind = item.WhichOneof("event")
            if kind == "queued":
                yield _sse("queued", {"id": job_id, "queue_position": item.queued.position})
            elif kind == "progress":
                yield _progress(job_id, item.progress)
            elif kind == "completed":
                yield _sse("completed", video_object(await orchestrator.get_job(job_id, authorization)))
    finally:
        reader.cancel()


async def _polled(orchestrator: Orchestrator, job_id: str, authorization: str | None) -> AsyncIterator[bytes]:
    """The job's progress from GetJob until it ends, then completed or error."""
    last, said_at = None, time.monotonic()
    while True:
        try:
            job = await orchestrator.get_job(job_id, authorization)
        except StageDiffError as error:
            yield _sse("error", {"error": from_stagediff_error(error).message, "code": error.code.name.lower()})
            return
        if job.state == generation_pb2.JOB_STATE_SUCCEEDED:
            yield _sse("completed", video_object(job))
            return
        if job.state in _ENDED:
            failure = video_object(job)["error"] or {"code": "unknown", "message": "the job did not succeed"}
            yield _sse("error", {"error": failure["message"], "code": failure["code"]})
            return
        if job.HasField("progress") and job.progress != last:
            last, said_at = job.progress, time.monotonic()
            yield _progress(job_id, job.progress)
        elif time.monotonic() - said_at >= KEEPALIVE_S:
            said_at = time.monotonic()
            yield b": keepalive\n\n"
        await asyncio.sleep(POLL_S)
