"""Input image files sent ahead of their request (Generation.UploadImage), held as files until one names them.

The public port takes small messages only (services/orchestrator/service.py MAX_REQUEST_BYTES), so grpc
refuses an oversized request before it holds it whole; an image file larger than that arrives here instead,
in chunks of at most 1 MiB. Each chunk is counted as it arrives, against the largest file a request may
carry and against the tenant's pending uploads (count and bytes), and written to the upload's file off the
event loop; the upload is refused the moment it goes over. A request names the file by its `upload_id`
(InputImage.upload_id); `ImageUploads.resolve` puts the bytes into the request at admission, and `discard`
deletes the files once the job that took them exists (or admission refused what the request asks), so an
upload serves one request. Uploads nobody named expire after `ttl_s`; none outlives the orchestrator
process (the directory is emptied at start).

Rules: an upload belongs to the tenant that sent it (another tenant's id is unknown to it, as an absent
one); ids are random, never derived from the bytes; nothing here holds a file's bytes in memory beyond one
chunk, but for the request being admitted.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.images import MAX_IMAGE_BYTES
from stagediff.v1 import generation_pb2
from stagekit.errors import RequestError

UPLOADS_DIR = "uploads"  # under the orchestrator's --state-dir
MAX_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_PENDING = 4  # uploads per tenant that no request has named yet
DEFAULT_TTL_S = 600.0
DEFAULT_RECEIVE_S = 120.0  # the longest one upload may take to arrive (16 MiB at 140 KB/s)
_ID_PATTERN_CHARS = 32  # hex digits of an upload id


class UploadRefused(Exception):
    """An upload the tenant may not send now: the status code, the message and when to retry (or None)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


@dataclass
class _Upload:
    upload_id: str
    path: Path
    size: int = 0
    sha256: str = ""
    expires_at: float = 0.0
    complete: bool = False
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)


@dataclass(frozen=True)
class Uploaded:
    upload_id: str
    size_bytes: int
    sha256: str
    expires_in_s: float


class ImageUploads:
    """The tenants' pending uploads under `directory`, each at most `max_bytes`, `max_pending` per tenant."""

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int = MAX_IMAGE_BYTES,
        max_pending: int = DEFAULT_MAX_PENDING,
        ttl_s: float = DEFAULT_TTL_S,
        receive_s: float = DEFAULT_RECEIVE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory, self.max_bytes, self.max_pending, self.ttl_s = directory, max_bytes, max_pending, ttl_s
        self.receive_s = receive_s
        self._clock = clock
        self._pending: dict[str, dict[str, _Upload]] = {}  # tenant -> upload id -> upload
        shutil.rmtree(directory, ignore_errors=True)  # uploads do not outlive the process that took them
        directory.mkdir(parents=True, exist_ok=True)

    async def receive(self, tenant: str, chunks: AsyncIterator[bytes]) -> Uploaded:
        """Writes the chunks to a new upload of `tenant`; UploadRefused as soon as a limit is passed."""
        self._expire()
        pending = self._pending.setdefault(tenant, {})
        if len(pending) >= self.max_pending:
            soonest = min(upload.expires_at for upload in pending.values()) - self._clock()
            raise UploadRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"upload: tenant '{tenant}' has {len(pending)} uploads no request has named yet, the most allowed; "
                "name them in a request (images[].upload_id) or wait for them to expire",
                max(1.0, soonest),
            )
        upload = _Upload(secrets.token_hex(_ID_PATTERN_CHARS // 2), self.directory / secrets.token_hex(16))
        upload.expires_at = self._clock() + self.ttl_s
        pending[upload.upload_id] = upload
        try:
            async with asyncio.timeout(self.receive_s):
                await self._write(upload, chunks)
            if upload.size == 0:
                raise UploadRefused(grpc.StatusCode.INVALID_ARGUMENT, "upload: no bytes; send the image file")
        except TimeoutError:
            self._drop(tenant, upload.upload_id)
            raise UploadRefused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"upload: not complete after {self.receive_s:g} s; send the file again, faster",
            ) from None
        except BaseException:
            self._drop(tenant, upload.upload_id)
            raise
        upload.complete, upload.sha256 = True, upload.digest.hexdigest()
        return Uploaded(upload.upload_id, upload.size, upload.sha256, upload.expires_at - self._clock())

    async def _write(self, upload: _Upload, chunks: AsyncIterator[bytes]) -> None:
        with await asyncio.to_thread(open, upload.path, "wb") as file:
            async for chunk in chunks:
                upload.size += len(chunk)
                if upload.size > self.max_bytes:
                    raise UploadRefused(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"upload: more than {self.max_bytes} bytes; an input image file may have at most "
                        f"{self.max_bytes}",
                    )
                upload.digest.update(chunk)
                await asyncio.to_thread(file.write, chunk)

    async def read(self, tenant: str, upload_ids: Sequence[tuple[str, str]]) -> list[bytes]:
        """The bytes of each (field, upload id) of `tenant`; RequestError naming the field of an unknown one."""
        self._expire()
        pending = self._pending.get(tenant, {})
        paths = []
        for name, upload_id in upload_ids:
            upload = pending.get(upload_id)
            if upload is None or not upload.complete:
                raise RequestError(
                    f"{name}: no upload with this id (uploads serve one request and expire after "
                    f"{self.ttl_s:g} s); send the file again with UploadImage"
                )
            paths.append(upload.path)
        return [await asyncio.to_thread(path.read_bytes) for path in paths]

    async def resolve(self, tenant: str, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
        """`request` with the bytes of the uploads its images name in their `data` (upload_id cleared); itself
        when it names none. RequestError for an image with both, or an unknown upload."""
        named = [(index, image.upload_id) for index, image in enumerate(request.images) if image.upload_id]
        if not named:
            return request
        for index, _ in named:
            if request.images[index].data:
                raise RequestError(f"images[{index}]: both data and upload_id are set; send one of them")
        contents = await self.read(tenant, [(f"images[{index}].upload_id", upload_id) for index, upload_id in named])
        resolved = generation_pb2.GenerateRequest()
        resolved.CopyFrom(request)
        for (index, _), data in zip(named, contents, strict=True):
            resolved.images[index].data = data
            resolved.images[index].ClearField("upload_id")
        return resolved

    def discard(self, tenant: str, upload_ids: Sequence[str]) -> None:
        """Deletes the uploads a job has taken."""
        for upload_id in upload_ids:
            self._drop(tenant, upload_id)

    def pending(self, tenant: str) -> int:
        return len(self._pending.get(tenant, {}))

    def _drop(self, tenant: str, upload_id: str) -> None:
        upload = self._pending.get(tenant, {}).pop(upload_id, None)
        if upload is not None:
            upload.path.unlink(missing_ok=True)
        if not self._pending.get(tenant, True):
            del self._pending[tenant]

    def _expire(self) -> None:
        now = self._clock()
        for tenant, pending in list(self._pending.items()):
            for upload_id, upload in list(pending.items()):
                if upload.complete and upload.expires_at <= now:
                    self._drop(tenant, upload_id)
