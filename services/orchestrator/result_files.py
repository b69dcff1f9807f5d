"""Result files: their names, their formats, and the readers that read them back in ranges.

A job's final frames are one .npy file (a .npy header, C-ordered uint8 [F, H, W, 3], and the frames' bytes);
its sound (a model that makes video with sound) a float32 [channels, samples] .npy file; its encoded file (an
MP4, a PNG...) the encoder's bytes. `ResultReader` reads frames back as wire chunks with plain reads at
offsets, one chunk in memory at a time, while the file is still being written or after it was committed;
`EncodedReader` reads any range of an encoded file written so far, `AudioReader` the sound. Each reads one
source (result_sources.py: a descriptor of the file, or its blob) and holds one read at a time.

The writers of a running job's files are in result_writers.py; a committed result as the store describes it,
`StoredResult`, in stored_result.py. The store (store/) decides when a file is created, committed or deleted;
these modules only read and write it.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from typing import BinaryIO, Self

import numpy as np

from services.orchestrator.result_sources import ByteSource, FdSource
from services.orchestrator.store_errors import StoreError
from stagediff.tensor_codec import DEFAULT_CHUNK_BYTES
from stagediff.v1 import generation_pb2, tensor_pb2

RESULT_FILE = "result-frames.npy"
ENCODED_FILE = "result"  # + the format's extension: result.mp4, result.png
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
