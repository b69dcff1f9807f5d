"""Where a result reader's bytes come from: a file descriptor (the local spool or a committed local file) or a
blob (a result committed to the blob store, read with ranged GETs).

A source reads exactly [at, at + size) or raises: ResultGone once the bytes were deleted, StoreError for any
other failure, with one-line messages naming no server path or object URL. Sources are blocking; readers
call them through `asyncio.to_thread`, one read at a time.
"""

from __future__ import annotations

import os
from typing import Protocol

from services.orchestrator.blobs.protocol import BlobNotFound, BlobStore
from services.orchestrator.store_errors import ResultGone, StoreError, blob_error, io_error


class ByteSource(Protocol):
    def read(self, at: int, size: int) -> bytes: ...

    def close(self) -> None: ...


class FdSource:
    """Plain reads at offsets of one open file (not a memory map), so that the pages read count as page cache,
    not as the orchestrator's resident memory. Owns the descriptor."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def read(self, at: int, size: int) -> bytes:
        if self._fd is None:
            raise StoreError("the result reader is closed")
        try:
            data = os.pread(self._fd, size, at)
            while len(data) < size:
                more = os.pread(self._fd, size - len(data), at + len(data))
                if not more:
                    raise StoreError("the result file is shorter than its record says")
                data += more
        except OSError as error:
            raise io_error(error, "reading a result file") from None
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class BlobSource:
    """Ranged reads of one committed blob."""

    def __init__(self, blobs: BlobStore, key: str) -> None:
        self._blobs = blobs
        self.key = key

    def read(self, at: int, size: int) -> bytes:
        try:
            data = self._blobs.get_range(self.key, at, at + size)
        except BlobNotFound:
            raise ResultGone("the result was deleted") from None
        except Exception as error:  # BlobError, or the client's own (a connection refused, a timeout)
            raise blob_error(error, "reading a result") from None
        if len(data) != size:
            raise StoreError("the result in the blob store is shorter than its record says")
        return data

    def close(self) -> None:
        pass
