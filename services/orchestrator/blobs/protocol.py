"""Where a job's files live: the BlobStore protocol that the local directory and S3 both implement.

A blob is named by a key: `/`-separated segments of letters, digits, `.`, `_` and `-` (no empty, `.` or `..`
segment), at most MAX_KEY_BYTES. Rules every implementation keeps (tests/integration/test_blob_stores.py runs
them against each):
- a blob becomes visible only whole: `put` and a writer's `commit` publish it at once, and a writer that is
  aborted (or never committed) leaves nothing a reader or `list` can see;
- `get_range` reads [start, end) and refuses a range outside the blob;
- `delete` of a missing key is not an error; `delete_prefix` removes every key under a prefix;
- every call may run in any thread; callers on an event loop run them with `asyncio.to_thread`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

MAX_KEY_BYTES = 1024
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")


class BlobError(RuntimeError):
    """The store failed or refused an operation; the message names the key."""


class BlobNotFound(BlobError, KeyError):
    """No blob has this key."""


def check_key(key: str) -> str:
    """`key` if it is a valid blob key; ValueError naming the rule otherwise."""
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(f"blob key {key[:64]!r}: use 1 to {MAX_KEY_BYTES} bytes")
    for segment in key.split("/"):
        if segment in ("", ".", "..") or not _SEGMENT.fullmatch(segment):
            raise ValueError(f"blob key {key[:64]!r}: segments are letters, digits, '.', '_' and '-'")
    return key


def check_prefix(prefix: str) -> str:
    """A prefix is a key followed by `/`: it names whole segments, never part of one; "" names every blob."""
    if prefix == "":
        return prefix
    if not prefix.endswith("/"):
        raise ValueError(f"blob prefix {prefix[:64]!r}: end it with '/'")
    check_key(prefix[:-1])
    return prefix


def check_range(key: str, start: int, end: int, size: int | None) -> None:
    """Refuses a read of [start, end) from a blob of `size` bytes (None: there is none)."""
    if size is None:
        raise BlobNotFound(key)
    if not 0 <= start <= end <= size:
        raise BlobError(f"blob {key}: range [{start}, {end}) is outside its {size} bytes")


@runtime_checkable
class BlobWriter(Protocol):
    """A blob written in pieces, published by `commit` and dropped by `abort`."""

    key: str

    def write(self, data: bytes) -> None: ...

    def commit(self) -> int:
        """Publishes the blob; returns its size in bytes."""
        ...

    def abort(self) -> None:
        """Drops what was written; nothing becomes visible. Safe to call twice or after a failed commit."""
        ...


@runtime_checkable
class PresignsDownloads(Protocol):
    """A blob store whose blobs a client may fetch itself, by a signed URL that expires (S3)."""

    def presigned_get(self, key: str, expires_s: int, *, media_type: str, filename: str) -> str:
        """A URL that GETs `key` until `expires_s` from now, answered with `media_type` as an attachment
        named `filename`."""
        ...


@runtime_checkable
class BlobStore(Protocol):
    """Blobs by key; see the module docstring for the rules."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, start: int, end: int) -> bytes: ...

    def size(self, key: str) -> int | None:
        """The blob's size, None when there is none."""
        ...

    def writer(self, key: str) -> BlobWriter: ...

    def keys(self, prefix: str) -> Iterator[str]:
        """The keys under `prefix`, in no promised order."""
        ...

    def listing(self, prefix: str) -> Iterator[tuple[str, float]]:
        """(key, unix time it was last written) of each blob under `prefix`, in no promised order."""
        ...

    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> int:
        """Deletes every blob under `prefix`; returns how many."""
        ...
