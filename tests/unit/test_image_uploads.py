"""Image files sent ahead of their request: counted chunk by chunk, held as files per tenant, taken once."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import grpc
import pytest

from services.orchestrator.image_uploads import ImageUploads, UploadRefused
from stagekit.errors import RequestError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def chunks(*pieces: bytes, pause_s: float = 0.0):
    for piece in pieces:
        if pause_s:
            await asyncio.sleep(pause_s)
        yield piece


def run(coroutine):
    return asyncio.run(coroutine)


def test_an_upload_is_written_to_a_file_read_once_and_deleted(tmp_path: Path) -> None:
    uploads = ImageUploads(tmp_path / "uploads", max_bytes=100)
    uploaded = run(uploads.receive("acme", chunks(b"abc", b"def")))
    assert uploaded.size_bytes == 6 and uploaded.sha256 == hashlib.sha256(b"abcdef").hexdigest()
    assert [path.read_bytes() for path in (tmp_path / "uploads").iterdir()] == [b"abcdef"]
    assert run(uploads.read("acme", [("images[0].upload_id", uploaded.upload_id)])) == [b"abcdef"]
    uploads.discard("acme", [uploaded.upload_id])
    assert list((tmp_path / "uploads").iterdir()) == [] and uploads.pending("acme") == 0
    with pytest.raises(RequestError, match=r"^images\[0\]\.upload_id: no upload with this id"):
        run(uploads.read("acme", [("images[0].upload_id", uploaded.upload_id)]))


def test_an_upload_over_the_limit_is_refused_at_the_chunk_that_passes_it(tmp_path: Path) -> None:
    uploads = ImageUploads(tmp_path, max_bytes=10)
    received: list[bytes] = []

    async def counted():
        for piece in (b"12345", b"67890", b"x", b"never read"):
            received.append(piece)
            yield piece

    with pytest.raises(UploadRefused) as refused:
        run(uploads.receive("acme", counted()))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than 10 bytes" in refused.value.message
    assert received == [b"12345", b"67890", b"x"]  # the stream is not read past the refusal
    assert list(tmp_path.iterdir()) == [] and uploads.pending("acme") == 0


def test_an_empty_upload_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UploadRefused, match="no bytes"):
        run(ImageUploads(tmp_path).receive("acme", chunks()))


def test_a_tenant_has_a_bounded_number_of_pending_uploads_and_another_tenant_is_not_affected(tmp_path: Path) -> None:
    clock = Clock()
    uploads = ImageUploads(tmp_path, max_pending=2, ttl_s=60, clock=clock)
    first = run(uploads.receive("acme", chunks(b"a")))
    run(uploads.receive("acme", chunks(b"b")))
    with pytest.raises(UploadRefused) as refused:
        run(uploads.receive("acme", chunks(b"c")))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.value.retry_after_s == 60
    run(uploads.receive("globex", chunks(b"d")))
    # Another tenant's id is unknown to it.
    with pytest.raises(RequestError, match="no upload with this id"):
        run(uploads.read("globex", [("images[0].upload_id", first.upload_id)]))
    # Uploads nobody named expire, and free their slots and files.
    clock.now += 61
    run(uploads.receive("acme", chunks(b"e")))
    assert uploads.pending("acme") == 1 and len(list(tmp_path.iterdir())) == 1


def test_an_upload_that_does_not_arrive_in_time_is_refused_and_dropped(tmp_path: Path) -> None:
    uploads = ImageUploads(tmp_path, receive_s=0.2)
    with pytest.raises(UploadRefused) as refused:
        run(uploads.receive("acme", chunks(b"a", b"b", b"c", pause_s=0.15)))
    assert refused.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert list(tmp_path.iterdir()) == [] and uploads.pending("acme") == 0


def test_a_cancelled_upload_leaves_nothing(tmp_path: Path) -> None:
    uploads = ImageUploads(tmp_path)

    async def main() -> None:
        task = asyncio.create_task(uploads.receive("acme", chunks(b"a", b"b", pause_s=5)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert list(tmp_path.iterdir()) == [] and uploads.pending("acme") == 0


def test_uploads_do_not_outlive_the_process(tmp_path: Path) -> None:
    run(ImageUploads(tmp_path).receive("acme", chunks(b"a")))
    ImageUploads(tmp_path)
    assert list(tmp_path.iterdir()) == []
