"""The files of a running job's result, written while it runs: the frames piece by piece, the encoded file
as the encoder produces it, the sound whole.

The frame count and size are known when a job starts, so `ResultWriter` preallocates the file under a
temporary name and writes each piece of frames at its frame offset as it arrives. An encoded file's size is
known only at its end, so `EncodedWriter` appends. `AudioWriter` writes the sound once the VAE sent it.
Followers read each through its `open_reader` (the readers and the file formats are in result_files.py)
meanwhile, and after it was committed. The store (store/) decides when a file is created, committed or
deleted; this module only writes it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from services.orchestrator.blobs.protocol import BlobStore, BlobWriter
from services.orchestrator.result_files import (
    AUDIO_FILE,
    ENCODED_FILE,
    RESULT_FILE,
    AudioReader,
    EncodedReader,
    ResultReader,
)
from services.orchestrator.result_sources import BlobSource, ByteSource, FdSource
from services.orchestrator.store_errors import ResultGone, StoreError, blob_error, fsync_dir, io_error

UPLOAD_PIECE_BYTES = 8 << 20  # read from the spool at a time when a result is sent to the blob store whole


class _PartialFile:
    """A file written under a temporary name while its job runs: readers duplicate its descriptor meanwhile;
    `_finish_file` renames it into place (the store commits its row after), `discard` throws it away.

    With a blob store beside the spool (`attach_upload`), every byte written in order is also streamed to an
    upload of the blob, part by part as it fills; `_finish_upload` completes it (re-sending the file whole
    if the writes were not in order or the stream failed) and deletes the spool, and readers then read the
    blob. `kind` names the file in errors ("result", "encoded result"). Writes, commit and discard close or
    replace the descriptor that readers duplicate, so each holds the lock.
    """

    kind = "result"

    def __init__(self, job_id: str, path: Path, fd: int, partial: Path) -> None:
        self.job_id = job_id
        self.path = path  # where the file is once committed
        self._partial = partial
        self._fd: int | None = fd
        self._committed = False
        self._lock = threading.Lock()
        self._blobs: BlobStore | None = None
        self.blob_key: str | None = None  # the blob it is committed to, with a blob store
        self._upload: BlobWriter | None = None
        self._uploaded = 0  # bytes streamed to the upload, in order from the first

    def attach_upload(self, blobs: BlobStore, key: str, written: bytes = b"") -> None:
        """Streams this file to blob `key` as it is written; `written` is what the file already holds."""
        with self._lock:
            self._blobs, self.blob_key = blobs, key
            self._upload = blobs.writer(key)
            self._stream(written, 0)

    def _stream(self, data: bytes | memoryview, at: int) -> None:
        """Sends bytes just written at `at` to the upload if they follow what it has; the caller holds the lock.
        A gap, or a failed part, leaves the rest to `_finish_upload`."""
        if self._upload is None or at != self._uploaded or not len(data):
            return
        try:
            self._upload.write(bytes(data))
            self._uploaded += len(data)
        except Exception:  # the store is down or refused a part: the file is sent whole at the end instead
            self._abort_upload()

    def _abort_upload(self) -> None:
        upload, self._upload, self._uploaded = self._upload, None, 0
        if upload is not None:
            with contextlib.suppress(Exception):  # a failed abort leaves an upload the bucket's lifecycle reaps
                upload.abort()

    def _pwrite(self, data: bytes | memoryview, at: int) -> None:
        """Writes all of `data` at byte `at`; the caller holds the lock."""
        if self._fd is None:
            raise StoreError(f"job {self.job_id}: its {self.kind} file is closed")
        view = memoryview(data).cast("B")
        start = at
        try:
            while view:
                written = os.pwrite(self._fd, view, at)
                view, at = view[written:], at + written
        except OSError as error:
            raise io_error(error, f"job {self.job_id}: writing its {self.kind}") from None
        self._stream(data, start)

    def _reader_source(self) -> int | ByteSource:
        """A source of the file for one reader: a duplicate descriptor while it is written, the committed file
        or blob after; raises ResultGone once it was discarded or deleted."""
        with self._lock:
            try:
                if self._fd is not None:
                    return os.dup(self._fd)
                if self._committed and self._blobs is not None and self.blob_key is not None:
                    return BlobSource(self._blobs, self.blob_key)
                if self._committed:
                    return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                raise ResultGone(f"job {self.job_id}: its {self.kind} was discarded")
            except FileNotFoundError:
                raise ResultGone(f"job {self.job_id}: its {self.kind} was deleted") from None
            except OSError as error:
                raise io_error(error, f"job {self.job_id}: opening its {self.kind}") from None

    def discard(self) -> None:
        """Closes and deletes an uncommitted file and aborts its upload (a committed one is the store's to delete)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if not self._committed:
                self._partial.unlink(missing_ok=True)
                self._abort_upload()

    def _finish_file(self) -> None:
        """fsync, rename into place, fsync the folder; the descriptor is closed after."""
        with self._lock:
            if self._fd is None:
                raise StoreError(f"job {self.job_id}: its {self.kind} file is closed")
            try:
                os.fsync(self._fd)
                os.replace(self._partial, self.path)
            except FileNotFoundError:
                raise
            except OSError as error:
                raise io_error(error, f"job {self.job_id}: completing its {self.kind}") from None
            os.close(self._fd)
            self._fd = None
            self._committed = True
        fsync_dir(self.path.parent)

    def _finish_upload(self, size: int) -> None:
        """Completes the blob (all `size` bytes) and deletes the spool; the blob is visible from here on."""
        with self._lock:
            if self._fd is None or self._blobs is None or self.blob_key is None:
                raise StoreError(f"job {self.job_id}: its {self.kind} file is closed")
            try:
                if self._upload is None or self._uploaded != size:
                    self._abort_upload()
                    self._upload = self._blobs.writer(self.blob_key)
                    spool = FdSource(os.dup(self._fd))
                    try:
                        for at in range(0, size, UPLOAD_PIECE_BYTES):
                            self._upload.write(spool.read(at, min(UPLOAD_PIECE_BYTES, size - at)))
                    finally:
                        spool.close()
                self._upload.commit()
            except Exception as error:
                self._abort_upload()
                raise blob_error(error, f"job {self.job_id}: uploading its {self.kind}") from None
            self._upload = None
            os.close(self._fd)
            self._fd = None
            self._partial.unlink(missing_ok=True)
            self._committed = True

    def _uncommit(self) -> None:
        """Takes back a committed file or blob whose row could not be committed."""
        with self._lock:
            self._committed = False
        if self._blobs is not None and self.blob_key is not None:
            with contextlib.suppress(Exception):  # left to the janitor, which deletes blobs no row names
                self._blobs.delete(self.blob_key)
        else:
            self.path.unlink(missing_ok=True)


class EncodedWriter(_PartialFile):
    """A running job's encoded file: appended to as the encoder produces it, read by followers meanwhile.

    Made by `JobStore.create_encoded`, completed with the raw frames by
    `JobStore.commit_result`, or thrown away by `discard`. `size` is the bytes
    appended so far. Blocking methods: call them through `asyncio.to_thread`.
    """

    kind = "encoded result"

    def __init__(self, job_id: str, directory: Path, extension: str, media_type: str, fd: int, partial: Path) -> None:
        super().__init__(job_id, directory / f"{ENCODED_FILE}{extension}", fd, partial)
        self.media_type = media_type
        self.size = 0

    def append(self, data: bytes) -> int:
        """Appends `data`; returns the offset it was written at."""
        with self._lock:
            offset = self.size
            self._pwrite(data, offset)
            self.size += len(data)
        return offset

    def open_reader(self) -> EncodedReader:
        """A reader of what was appended so far (the whole file once committed); raises ResultGone."""
        return EncodedReader(self._reader_source(), self.media_type)


class ResultWriter(_PartialFile):
    """A running job's result file: preallocated, written piece by piece at frame offsets, read by followers.

    Made by `JobStore.create_result`, completed by `JobStore.commit_result`, or
    thrown away by `discard` (a failed or cancelled job). `pieces` lists the
    (first frame, count) of each piece in the order it was published.
    Blocking methods: call them through `asyncio.to_thread`.
    """

    def __init__(
        self, job_id: str, directory: Path, shape: tuple[int, int, int, int], fd: int, partial: Path, data_offset: int
    ) -> None:
        super().__init__(job_id, directory / RESULT_FILE, fd, partial)
        self.shape = shape
        self.frame_bytes = shape[1] * shape[2] * shape[3]
        self.nbytes = data_offset + shape[0] * self.frame_bytes  # the file's size
        self.data_offset = data_offset
        self.pieces: list[tuple[int, int]] = []

    def write(self, first: int, offset: int, data: bytes | memoryview) -> None:
        """Writes `data` at byte `offset` of the frames that start at frame `first`."""
        start = first * self.frame_bytes + offset
        if first < 0 or offset < 0 or start + len(data) > self.shape[0] * self.frame_bytes:
            raise ValueError(
                f"{len(data)} bytes at frame {first} + {offset} do not fit a result of {self.shape[0]} frames"
            )
        with self._lock:
            self._pwrite(data, self.data_offset + start)

    def add_piece(self, first: int, count: int) -> None:
        """Records that frames [first, first + count) are written and published."""
        self.pieces.append((int(first), int(count)))

    def open_reader(self) -> ResultReader:
        """A reader of the frames written so far (and of the whole result once committed); raises ResultGone."""
        return ResultReader(self._reader_source(), self.shape, self.data_offset)


class AudioWriter(_PartialFile):
    """A running job's sound: written whole once the VAE sent it (float32 [channels, samples] .npy), read by
    followers after; committed with the result by `JobStore.commit_result`, or thrown away by `discard`."""

    kind = "sound"

    def __init__(
        self,
        job_id: str,
        directory: Path,
        shape: tuple[int, int],
        sample_rate: int,
        fd: int,
        partial: Path,
        data_offset: int,
    ) -> None:
        super().__init__(job_id, directory / AUDIO_FILE, fd, partial)
        self.shape = shape
        self.sample_rate = sample_rate
        self.data_offset = data_offset
        self.nbytes = data_offset + shape[0] * shape[1] * 4

    def write_all(self, header: bytes, data: bytes) -> None:
        """Writes the file's header and the waveform's bytes (done once, before any reader opens it)."""
        with self._lock:
            self._pwrite(header + data, 0)

    def open_reader(self) -> AudioReader:
        """A reader of the sound; raises ResultGone once it was discarded or deleted."""
        return AudioReader(self._reader_source(), self.shape, self.data_offset)
