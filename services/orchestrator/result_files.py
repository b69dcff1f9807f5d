"""Result files: a job's final frames as one .npy file, written piece by piece and read back in chunks;
its sound (a model that makes video with sound) as a float32 .npy file, written whole; and its encoded file
(an MP4, a PNG...), appended to as the encoder produces it.

A result file is a .npy header (C-ordered uint8 [F, H, W, 3]) and the frames'
bytes. The frame count and size are known when a job starts, so `ResultWriter`
preallocates the file under a temporary name and writes each piece of frames
at its frame offset as it arrives; `ResultReader` reads frames back as wire
chunks with plain reads at offsets, one chunk in memory at a time, while the
file is still being written or after it was committed. An encoded file's size
is known only at its end, so `EncodedWriter` appends, and `EncodedReader`
reads any range written so far. `StoredResult` is a committed result as the
store describes it. The store (store/) decides when a file is created,
committed or deleted; this module only reads and writes it.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Self

import numpy as np

from services.orchestrator.blobs.protocol import BlobStore, BlobWriter
from services.orchestrator.result_sources import BlobSource, ByteSource, FdSource
from services.orchestrator.store_errors import ResultGone, StoreError, blob_error, fsync_dir, io_error
from stagediff.tensor_codec import DEFAULT_CHUNK_BYTES
from stagediff.v1 import generation_pb2, stages_pb2, tensor_pb2

RESULT_FILE = "result-frames.npy"
ENCODED_FILE = "result"  # + the format's extension: result.mp4, result.png
UPLOAD_PIECE_BYTES = 8 << 20  # read from the spool at a time when a result is sent to the blob store whole
RESULT_TENSOR = "frames"  # the name result tensors travel under, as the VAE and the interpolator send them
AUDIO_FILE = "result-audio.npy"  # a result's sound, float32 [channels, samples]
AUDIO_TENSOR = "audio"  # the name the sound travels under, as the VAE sends it


def npy_header(shape: tuple[int, ...], dtype: type = np.uint8) -> bytes:
    """The .npy header of a C-ordered array of `shape` (uint8 unless `dtype`), as `np.save` writes it."""
    buffer = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def read_npy_header(file: BinaryIO) -> tuple[tuple[int, ...], int]:
    """(shape, offset of the data) of a C-ordered uint8 .npy file; raises ValueError otherwise."""
    version = np.lib.format.read_magic(file)
    if version == (1, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(file)
    elif version == (2, 0):
        shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(file)
    else:
        raise ValueError(f"unsupported .npy version {version}")
    if dtype != np.uint8 or fortran_order:
        raise ValueError(f"expected C-ordered uint8 frames, found {dtype}{' (Fortran order)' if fortran_order else ''}")
    return tuple(int(n) for n in shape), file.tell()


def check_shape(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    shape = tuple(int(n) for n in shape)
    if len(shape) != 4 or shape[3] != 3 or min(shape) < 1:
        raise ValueError(f"frames: shape [F, H, W, 3] with every size at least 1 expected, got {list(shape)}")
    return shape


class _RangeReader:
    """Reads of one source (result_sources.py), one at a time: `close` waits for a read in progress."""

    def __init__(self, source: int | ByteSource) -> None:
        self._source: ByteSource | None = FdSource(source) if isinstance(source, int) else source
        self._lock = threading.Lock()

    def _read(self, at: int, size: int) -> bytes:
        with self._lock:
            if self._source is None:
                raise StoreError("the result reader is closed")
            return self._source.read(at, size)

    def close(self) -> None:
        with self._lock:
            if self._source is not None:
                self._source.close()
                self._source = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ResultReader(_RangeReader):
    """Reads frames of a result file back as wire chunks, one chunk in memory at a time.

    Blocking: iterate `chunks` through `asyncio.to_thread`.
    """

    def __init__(self, source: int | ByteSource, shape: tuple[int, int, int, int], data_offset: int) -> None:
        super().__init__(source)
        self.shape = shape
        self.frame_bytes = shape[1] * shape[2] * shape[3]
        self._data_offset = data_offset

    def chunks(
        self, first: int, count: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[tensor_pb2.TensorChunk]:
        """The chunks of frames [first, first + count) as `encode_tensor(RESULT_TENSOR, ..., index=first)` makes."""
        if first < 0 or count < 1 or first + count > self.shape[0]:
            raise ValueError(f"frames [{first}, {first + count}) are not in a result of {self.shape[0]} frames")
        header = tensor_pb2.TensorHeader(
            name=RESULT_TENSOR, datatype="UINT8", shape=[count, *self.shape[1:]], index=first
        )
        total = count * self.frame_bytes
        base = self._data_offset + first * self.frame_bytes
        offset = 0
        while offset < total:
            end = min(offset + chunk_bytes, total)
            chunk = tensor_pb2.TensorChunk(
                offset=offset, data=self._read(base + offset, end - offset), last=end >= total
            )
            if offset == 0:
                chunk.header.CopyFrom(header)
            yield chunk
            offset = end

    def frames(self, first: int, count: int) -> np.ndarray:
        """Frames [first, first + count) as a uint8 array [count, H, W, 3] (what the encoder is fed)."""
        if first < 0 or count < 1 or first + count > self.shape[0]:
            raise ValueError(f"frames [{first}, {first + count}) are not in a result of {self.shape[0]} frames")
        data = self._read(self._data_offset + first * self.frame_bytes, count * self.frame_bytes)
        return np.frombuffer(data, np.uint8).reshape(count, *self.shape[1:])


class EncodedReader(_RangeReader):
    """Reads ranges of an encoded file back as wire chunks (blocking: iterate through `asyncio.to_thread`)."""

    def __init__(self, source: int | ByteSource, media_type: str) -> None:
        super().__init__(source)
        self.media_type = media_type

    def chunks(
        self, offset: int, size: int, *, last: bool, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[generation_pb2.EncodedChunk]:
        """Bytes [offset, offset + size) in chunks of at most `chunk_bytes`; `last` marks the file's end."""
        end = offset + size
        while True:
            stop = min(offset + chunk_bytes, end)
            yield generation_pb2.EncodedChunk(
                media_type=self.media_type,
                offset=offset,
                data=self._read(offset, stop - offset),
                last=last and stop >= end,
            )
            offset = stop
            if offset >= end:
                return


class AudioReader(_RangeReader):
    """Reads a result's sound back as wire chunks (blocking: iterate through `asyncio.to_thread`)."""

    def __init__(self, source: int | ByteSource, shape: tuple[int, int], data_offset: int) -> None:
        super().__init__(source)
        self.shape = shape
        self._data_offset = data_offset

    def chunks(self, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tensor_pb2.TensorChunk]:
        """The chunks of the whole waveform as `encode_tensor(AUDIO_TENSOR, waveform)` makes."""
        header = tensor_pb2.TensorHeader(name=AUDIO_TENSOR, datatype="FP32", shape=list(self.shape), index=0)
        total = self.shape[0] * self.shape[1] * 4
        offset = 0
        while offset < total:
            end = min(offset + chunk_bytes, total)
            chunk = tensor_pb2.TensorChunk(
                offset=offset, data=self._read(self._data_offset + offset, end - offset), last=end >= total
            )
            if offset == 0:
                chunk.header.CopyFrom(header)
            yield chunk
            offset = end

    def waveform(self) -> np.ndarray:
        """The whole sound, float32 [channels, samples]."""
        data = self._read(self._data_offset, self.shape[0] * self.shape[1] * 4)
        return np.frombuffer(data, "<f4").reshape(self.shape)


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


@dataclass
class StoredResult:
    """A finished job's result: its raw frames' file (unless an encoded result did not keep them), its
    encoded file (when the request asked for a format), the frames' shape, and how they were first published.

    The files are local paths, or, with a blob store, the keys `raw_key` and `encoded_key` in `blobs`.
    """

    path: Path | None  # the raw frames (.npy); None when only the encoded file was kept (or with a blob store)
    shape: tuple[int, int, int, int]
    data_offset: int
    fps: float
    pieces: list[tuple[int, int]]  # (first frame, count) of each published tensor, in order
    timings: dict[str, float]
    transformer_passes: tuple[int, int] = (0, 0)  # (run, skipped) by the DiT
    notices: list[stages_pb2.Notice] = field(default_factory=list)  # the job's (services/orchestrator/notices.py)
    media_type: str = ""  # of the encoded file; "" for a raw result
    encoded_path: Path | None = None
    encoded_bytes: int = 0
    blobs: BlobStore | None = None
    raw_key: str | None = None
    encoded_key: str | None = None
    # The sound of a result with sound, kept with its raw frames: a local file or a blob, its shape
    # [channels, samples] and samples per second.
    audio_path: Path | None = None
    audio_key: str | None = None
    audio_shape: tuple[int, int] = (0, 0)
    audio_rate: int = 0
    audio_offset: int = 0

    @property
    def num_frames(self) -> int:
        return int(self.shape[0])

    @property
    def has_raw(self) -> bool:
        return self.path is not None or self.raw_key is not None

    @property
    def has_encoded(self) -> bool:
        return self.encoded_path is not None or self.encoded_key is not None

    @property
    def frames(self) -> np.ndarray:
        """Every frame (memory-mapped read-only when local): for tools and tests; serving reads with `open`."""
        if self.path is not None:
            return np.load(self.path, mmap_mode="r", allow_pickle=False)
        with self.open() as reader:
            return reader.frames(0, self.num_frames)

    def open(self) -> ResultReader:
        """A reader of this result's raw frames; raises ResultGone if they were deleted since (or not kept)."""
        if self.path is not None:
            return ResultReader(_open_read(self.path), self.shape, self.data_offset)
        if self.blobs is not None and self.raw_key is not None:
            return ResultReader(BlobSource(self.blobs, self.raw_key), self.shape, self.data_offset)
        raise ResultGone("the result kept only its encoded file")

    @property
    def has_audio(self) -> bool:
        return self.audio_path is not None or self.audio_key is not None

    @property
    def audio_bytes(self) -> int:
        return self.audio_offset + self.audio_shape[0] * self.audio_shape[1] * 4 if self.has_audio else 0

    def open_audio(self) -> AudioReader:
        """A reader of this result's sound; raises ResultGone if it has none or it was deleted since."""
        if self.audio_path is not None:
            return AudioReader(_open_read(self.audio_path), self.audio_shape, self.audio_offset)
        if self.blobs is not None and self.audio_key is not None:
            return AudioReader(BlobSource(self.blobs, self.audio_key), self.audio_shape, self.audio_offset)
        raise ResultGone("the result has no sound")

    @property
    def audio(self) -> np.ndarray | None:
        """The sound, float32 [channels, samples], None for a silent result: for tools and tests."""
        if not self.has_audio:
            return None
        with self.open_audio() as reader:
            return reader.waveform()

    def open_encoded(self) -> EncodedReader:
        """A reader of this result's encoded file; raises ResultGone if it was deleted since."""
        if self.encoded_path is not None:
            return EncodedReader(_open_read(self.encoded_path), self.media_type)
        if self.blobs is not None and self.encoded_key is not None:
            return EncodedReader(BlobSource(self.blobs, self.encoded_key), self.media_type)
        raise ResultGone("the result has no encoded file")

    def completed_event(self, job_id: str = "", seed: int = 0) -> generation_pb2.GenerateEvent:
        return generation_pb2.GenerateEvent(
            job_id=job_id,
            completed=generation_pb2.JobCompleted(
                timings=self.timings,
                num_frames=self.num_frames,
                fps=self.fps,
                transformer_passes=stages_pb2.TransformerPasses(
                    run=self.transformer_passes[0], skipped=self.transformer_passes[1]
                ),
                media_type=self.media_type,
                encoded_bytes=self.encoded_bytes,
                seed=seed,
                notices=self.notices,
            ),
        )

    def events(
        self, job_id: str = "", *, seed: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Generator[generation_pb2.GenerateEvent]:
        """The result chunks and the completion event, as a watcher of the live job received them: the raw
        frames (when kept) and their sound (when there is one), then the encoded file (when there is one).

        Read from the files one chunk at a time (blocking; a file is opened at the first `next` that needs it).
        """
        if self.has_raw:
            with self.open() as reader:
                for first, count in self.pieces:
                    for chunk in reader.chunks(first, count, chunk_bytes=chunk_bytes):
                        yield generation_pb2.GenerateEvent(
                            job_id=job_id, result=generation_pb2.ResultChunk(tensor=chunk, fps=self.fps)
                        )
        if self.has_audio:
            with self.open_audio() as audio:
                for chunk in audio.chunks(chunk_bytes=chunk_bytes):
                    yield generation_pb2.GenerateEvent(
                        job_id=job_id,
                        result=generation_pb2.ResultChunk(
                            tensor=chunk, fps=self.fps, audio_sample_rate=self.audio_rate
                        ),
                    )
        if self.has_encoded:
            with self.open_encoded() as reader:
                for piece in reader.chunks(0, self.encoded_bytes, last=True, chunk_bytes=chunk_bytes):
                    yield generation_pb2.GenerateEvent(
                        job_id=job_id, result=generation_pb2.ResultChunk(encoded=piece, fps=self.fps)
                    )
        yield self.completed_event(job_id, seed)


def _open_read(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ResultGone(f"{path}: the result was deleted") from None
    except OSError as error:
        raise io_error(error, "opening a result file") from None
