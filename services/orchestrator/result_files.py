"""Result files: a job's final frames as one .npy file, written piece by piece and read back in chunks.

A result file is a .npy header (C-ordered uint8 [F, H, W, 3]) and the frames'
bytes. The frame count and size are known when a job starts, so `ResultWriter`
preallocates the file under a temporary name and writes each piece of frames
at its frame offset as it arrives; `ResultReader` reads frames back as wire
chunks with plain reads at offsets, one chunk in memory at a time, while the
file is still being written or after it was committed. `StoredResult` is a
committed file as the store describes it. The store (store.py) decides when a
file is created, committed or deleted; this module only reads and writes it.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from services.orchestrator.store_errors import ResultGone, StoreError, fsync_dir, io_error
from stagediff.tensor_codec import DEFAULT_CHUNK_BYTES
from stagediff.v1 import generation_pb2, stages_pb2, tensor_pb2

RESULT_FILE = "result-frames.npy"
RESULT_TENSOR = "frames"  # the name result tensors travel under, as the VAE and the interpolator send them


def npy_header(shape: tuple[int, ...]) -> bytes:
    """The .npy header of a C-ordered uint8 array of `shape`, as `np.save` writes it."""
    buffer = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False, "shape": shape}
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
    return shape  # type: ignore[return-value]


class ResultReader:
    """Reads frames of a result file back as wire chunks, one chunk in memory at a time.

    Plain reads at offsets (not a memory map), so that the pages read count as
    page cache, not as the orchestrator's resident memory. Blocking: iterate
    `chunks` through `asyncio.to_thread`. `close` waits for a read in progress.
    """

    def __init__(self, fd: int, shape: tuple[int, int, int, int], data_offset: int) -> None:
        self.shape = shape
        self.frame_bytes = shape[1] * shape[2] * shape[3]
        self._data_offset = data_offset
        self._fd: int | None = fd
        self._lock = threading.Lock()

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

    def _read(self, at: int, size: int) -> bytes:
        with self._lock:
            if self._fd is None:
                raise StoreError("the result reader is closed")
            try:
                data = os.pread(self._fd, size, at)
                while len(data) < size:
                    more = os.pread(self._fd, size - len(data), at + len(data))
                    if not more:
                        raise StoreError("the result file is shorter than its header says")
                    data += more
            except OSError as error:
                raise io_error(error, "reading a result file") from None
        return data

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> ResultReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class ResultWriter:
    """A running job's result file: preallocated, written piece by piece at frame offsets, read by followers.

    Made by `JobStore.create_result`, completed by `JobStore.commit_result`, or
    thrown away by `discard` (a failed or cancelled job). `pieces` lists the
    (first frame, count) of each piece in the order it was published.
    Blocking methods: call them through `asyncio.to_thread`.
    """

    def __init__(
        self, job_id: str, directory: Path, shape: tuple[int, int, int, int], fd: int, partial: Path, data_offset: int
    ) -> None:
        self.job_id = job_id
        self.shape = shape
        self.frame_bytes = shape[1] * shape[2] * shape[3]
        self.nbytes = data_offset + shape[0] * self.frame_bytes  # the file's size
        self.data_offset = data_offset
        self.pieces: list[tuple[int, int]] = []
        self.path = directory / RESULT_FILE  # where the file is once committed
        self._partial = partial
        self._fd: int | None = fd
        self._committed = False
        # Writes, commit and discard close or replace the descriptor that followers duplicate.
        self._lock = threading.Lock()

    def write(self, first: int, offset: int, data: bytes | memoryview) -> None:
        """Writes `data` at byte `offset` of the frames that start at frame `first`."""
        start = first * self.frame_bytes + offset
        if first < 0 or offset < 0 or start + len(data) > self.shape[0] * self.frame_bytes:
            raise ValueError(
                f"{len(data)} bytes at frame {first} + {offset} do not fit a result of {self.shape[0]} frames"
            )
        view = memoryview(data).cast("B")
        at = self.data_offset + start
        with self._lock:
            if self._fd is None:
                raise StoreError(f"job {self.job_id}: its result file is closed")
            try:
                while view:
                    written = os.pwrite(self._fd, view, at)
                    view, at = view[written:], at + written
            except OSError as error:
                raise io_error(error, f"job {self.job_id}: writing its result") from None

    def add_piece(self, first: int, count: int) -> None:
        """Records that frames [first, first + count) are written and published."""
        self.pieces.append((int(first), int(count)))

    def open_reader(self) -> ResultReader:
        """A reader of the frames written so far (and of the whole result once committed); raises ResultGone."""
        with self._lock:
            try:
                if self._fd is not None:
                    fd = os.dup(self._fd)
                elif self._committed:
                    fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                else:
                    raise ResultGone(f"job {self.job_id}: its result was discarded")
            except FileNotFoundError:
                raise ResultGone(f"job {self.job_id}: its result was deleted") from None
            except OSError as error:
                raise io_error(error, f"job {self.job_id}: opening its result") from None
        return ResultReader(fd, self.shape, self.data_offset)

    def discard(self) -> None:
        """Closes and deletes an uncommitted result (a committed one is the store's to delete)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if not self._committed:
                self._partial.unlink(missing_ok=True)

    def _finish_file(self) -> None:
        """fsync, rename into place, fsync the folder; the descriptor is closed after."""
        with self._lock:
            if self._fd is None:
                raise StoreError(f"job {self.job_id}: its result file is closed")
            try:
                os.fsync(self._fd)
                os.replace(self._partial, self.path)
            except FileNotFoundError:
                raise
            except OSError as error:
                raise io_error(error, f"job {self.job_id}: completing its result") from None
            os.close(self._fd)
            self._fd = None
            self._committed = True
        fsync_dir(self.path.parent)

    def _uncommit(self) -> None:
        """Takes back a renamed file whose row could not be committed."""
        with self._lock:
            self._committed = False
        self.path.unlink(missing_ok=True)


@dataclass
class StoredResult:
    """A finished job's result file, its frames' shape, and how they were first published."""

    path: Path
    shape: tuple[int, int, int, int]
    data_offset: int
    fps: float
    pieces: list[tuple[int, int]]  # (first frame, count) of each published tensor, in order
    timings: dict[str, float]
    transformer_passes: tuple[int, int] = (0, 0)  # (run, skipped) by the DiT

    @property
    def num_frames(self) -> int:
        return int(self.shape[0])

    @property
    def frames(self) -> np.ndarray:
        """Every frame, memory-mapped read-only: for tools and tests; serving reads with `open`/`events`."""
        return np.load(self.path, mmap_mode="r", allow_pickle=False)

    def open(self) -> ResultReader:
        """A reader of this result's file; raises ResultGone if it was deleted since."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ResultGone(f"{self.path}: the result was deleted") from None
        except OSError as error:
            raise io_error(error, "opening a result file") from None
        return ResultReader(fd, self.shape, self.data_offset)

    def completed_event(self, job_id: str = "") -> generation_pb2.GenerateEvent:
        return generation_pb2.GenerateEvent(
            job_id=job_id,
            completed=generation_pb2.JobCompleted(
                timings=self.timings,
                num_frames=self.num_frames,
                fps=self.fps,
                transformer_passes=stages_pb2.TransformerPasses(
                    run=self.transformer_passes[0], skipped=self.transformer_passes[1]
                ),
            ),
        )

    def events(
        self, job_id: str = "", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[generation_pb2.GenerateEvent]:
        """The result chunks and the completion event, as a watcher of the live job received them.

        Read from the file one chunk at a time (blocking; the file is opened at the first `next`).
        """
        with self.open() as reader:
            for first, count in self.pieces:
                for chunk in reader.chunks(first, count, chunk_bytes=chunk_bytes):
                    yield generation_pb2.GenerateEvent(
                        job_id=job_id, result=generation_pb2.ResultChunk(tensor=chunk, fps=self.fps)
                    )
        yield self.completed_event(job_id)
