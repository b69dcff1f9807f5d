"""BlobStore on a local directory: the embedded default, a key being a path under `root`.

A writer writes `<key>.partial-<random>` beside its blob and renames it into place on commit (atomic on one
filesystem), so a reader sees the old blob or the new one, never a part; partial files are not keys and
`sweep_partials` removes those a crash left.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from services.orchestrator.blobs.protocol import BlobError, BlobNotFound, check_key, check_prefix, check_range

PARTIAL = ".partial-"


class LocalBlobWriter:
    """Writes a temporary file beside the blob; `commit` renames it into place."""

    def __init__(self, path: Path, key: str) -> None:
        self.key = key
        self._path = path
        self._partial = path.with_name(f"{path.name}{PARTIAL}{secrets.token_hex(4)}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] | None = open(self._partial, "wb")  # noqa: SIM115 - closed by commit or abort
        self._size = 0

    def write(self, data: bytes) -> None:
        if self._file is None:
            raise BlobError(f"blob {self.key}: written after commit or abort")
        self._file.write(data)
        self._size += len(data)

    def commit(self) -> int:
        if self._file is None:
            raise BlobError(f"blob {self.key}: committed after commit or abort")
        file, self._file = self._file, None
        try:
            file.flush()
            os.fsync(file.fileno())
            file.close()
            os.replace(self._partial, self._path)
        except OSError as error:
            self._partial.unlink(missing_ok=True)
            raise BlobError(f"blob {self.key}: {error.strerror or error}") from None
        return self._size

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._partial.unlink(missing_ok=True)


class LocalBlobs:
    """Blobs as files under `root`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes) -> None:
        writer = self.writer(key)
        try:
            writer.write(data)
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise BlobNotFound(key) from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_range(key, start, end, self.size(key))
        with open(self._path(key), "rb") as file:
            file.seek(start)
            return file.read(end - start)

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def writer(self, key: str) -> LocalBlobWriter:
        return LocalBlobWriter(self._path(key), key)

    def keys(self, prefix: str) -> Iterator[str]:
        for key, _ in self.listing(prefix):
            yield key

    def listing(self, prefix: str) -> Iterator[tuple[str, float]]:
        directory = self.root / check_prefix(prefix)
        for path in directory.rglob("*"):
            if PARTIAL in path.name:
                continue
            try:
                if path.is_file():
                    yield path.relative_to(self.root).as_posix(), path.stat().st_mtime
            except FileNotFoundError:  # deleted while listed
                continue

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        keys = list(self.keys(prefix))
        for key in keys:
            self.delete(key)
        return len(keys)

    def sweep_partials(self) -> int:
        """Removes the partial files of writers a crash left; returns how many."""
        partials = [path for path in self.root.rglob(f"*{PARTIAL}*") if path.is_file()]
        for path in partials:
            path.unlink(missing_ok=True)
        return len(partials)
