"""Tensors on the wire: raw row-major little-endian bytes, a datatype and a shape.

Follows the KServe v2 convention. A tensor larger than `chunk_bytes` travels as
several `TensorChunk` messages, so that no single gRPC message grows with the
video. The receiver writes each chunk straight into one preallocated buffer and
builds the array over it, so bytes are copied once. The buffer is reserved, not
zeroed: memory is used as data arrives, so a header that announces a large
tensor costs nothing until its bytes come.

Everything a peer can get wrong (unknown datatype, a shape that does not match
the bytes, chunks out of order, a stream that stops half-way) raises
`WireError`, which servers turn into INVALID_ARGUMENT.

This module needs numpy alone: the client decodes with it. Servers hand torch
tensors to `services.torch_wire`, which converts them to and from the arrays
this module sends and receives.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from stagediff.v1 import tensor_pb2

DEFAULT_CHUNK_BYTES = 1 << 20
# A generous bound on one tensor, so that a forged header cannot make a server
# allocate without limit. An 81-frame 1080p clip in uint8 is about 0.5 GB.
MAX_TENSOR_BYTES = 8 << 30
# Dimensions one tensor may have (numpy arrays take at most 64; ours have at most 5).
MAX_TENSOR_DIMS = 32

# KServe v2 datatype name -> numpy dtype. BF16 has no numpy dtype: its bits travel as uint16.
_NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
DATATYPES = tuple(_NUMPY_DTYPES)


class WireError(ValueError):
    """A peer sent something that is not a valid tensor stream."""


@dataclass
class WireTensor:
    """A tensor received from the wire."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    index: int
    array: np.ndarray  # BF16 arrives as its uint16 bits; services.torch_wire.to_torch() reads them as bfloat16


def _wire_array(value: np.ndarray, datatype: str | None) -> tuple[str, np.ndarray]:
    """Returns the datatype name and `value` as a little-endian, C-contiguous array."""
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"encode_tensor takes a numpy array, not {type(value).__module__}.{type(value).__name__}; "
            "torch tensors go through services.torch_wire.encode_tensor"
        )
    array = value
    if datatype is None:
        for name, dtype in _NUMPY_DTYPES.items():
            if name != "BF16" and array.dtype.kind == dtype.kind and array.dtype.itemsize == dtype.itemsize:
                return name, np.ascontiguousarray(array, dtype=dtype)
        raise TypeError(f"numpy dtype {array.dtype} cannot travel on the wire")
    wire_dtype = _NUMPY_DTYPES.get(datatype)
    if wire_dtype is None:
        raise ValueError(f"datatype '{datatype}' is not one of {', '.join(DATATYPES)}")
    if array.dtype.kind != wire_dtype.kind or array.dtype.itemsize != wire_dtype.itemsize:
        raise TypeError(f"datatype {datatype} travels as numpy {wire_dtype}; got an array of {array.dtype}")
    return datatype, np.ascontiguousarray(array, dtype=wire_dtype)


def encode_tensor(
    name: str,
    value: np.ndarray,
    *,
    index: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    datatype: str | None = None,
) -> Iterator[tensor_pb2.TensorChunk]:
    """The chunks of one array; the first carries the header. A value that cannot travel raises here, at once.

    The datatype follows from the array's dtype unless `datatype` names it: BF16, which numpy lacks, travels as
    the uint16 bits of its values.
    """
    datatype, array = _wire_array(value, datatype)
    header = tensor_pb2.TensorHeader(name=name, datatype=datatype, shape=list(array.shape), index=index)
    return _chunks(header, array, chunk_bytes)


def _chunks(header: tensor_pb2.TensorHeader, array: np.ndarray, chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    data = array.reshape(-1).data.cast("B")
    total = len(data)
    offset = 0
    while True:
        end = min(offset + chunk_bytes, total)
        chunk = tensor_pb2.TensorChunk(offset=offset, data=bytes(data[offset:end]), last=end >= total)
        if offset == 0:
            chunk.header.CopyFrom(header)
        yield chunk
        offset = end
        if offset >= total:
            return


class TensorAssembler:
    """Rebuilds tensors from a stream of chunks, validating as it goes.

    Feed every TensorChunk in arrival order; `feed` returns a WireTensor when a
    chunk completes one, else None. Call `finish()` when the stream ends to
    catch a tensor left half-way.
    """

    def __init__(self, max_tensor_bytes: int = MAX_TENSOR_BYTES) -> None:
        self.max_tensor_bytes = max_tensor_bytes
        self._header: tensor_pb2.TensorHeader | None = None
        self._buffer: np.ndarray | None = None
        self._received = 0

    @property
    def in_progress(self) -> bool:
        return self._header is not None

    def feed(self, chunk: tensor_pb2.TensorChunk) -> WireTensor | None:
        if chunk.HasField("header"):
            if self._header is not None:
                expected = 0 if self._buffer is None else len(self._buffer)
                raise WireError(
                    f"tensor '{self._header.name}': a new header arrived after {self._received} of "
                    f"{expected} bytes; finish a tensor before starting the next"
                )
            self._start(chunk.header)
        elif self._header is None:
            raise WireError("tensor chunk: the first chunk of every tensor must carry a header (datatype and shape)")
        assert self._header is not None and self._buffer is not None
        name = self._header.name
        if chunk.offset != self._received:
            raise WireError(
                f"tensor '{name}': chunk offset {chunk.offset} does not follow the previous chunk, "
                f"which ended at byte {self._received}"
            )
        end = self._received + len(chunk.data)
        if end > len(self._buffer):
            raise WireError(f"tensor '{name}': chunks carry more than the {len(self._buffer)} bytes its shape implies")
        self._buffer[self._received : end] = np.frombuffer(chunk.data, dtype=np.uint8)
        self._received = end
        if not chunk.last:
            return None
        if self._received != len(self._buffer):
            raise WireError(
                f"tensor '{name}': marked last after {self._received} bytes, but its shape "
                f"{list(self._header.shape)} and datatype {self._header.datatype} need {len(self._buffer)}"
            )
        return self._complete()

    def finish(self) -> None:
        """Raises if the stream ended in the middle of a tensor."""
        if self._header is not None:
            raise WireError(
                f"tensor '{self._header.name}': the stream ended after {self._received} of "
                f"{0 if self._buffer is None else len(self._buffer)} bytes"
            )

    def _start(self, header: tensor_pb2.TensorHeader) -> None:
        name = header.name or "<unnamed>"
        if header.datatype not in _NUMPY_DTYPES:
            raise WireError(f"tensor '{name}': datatype '{header.datatype}' is not one of {', '.join(DATATYPES)}")
        if len(header.shape) > MAX_TENSOR_DIMS:
            raise WireError(
                f"tensor '{name}': shape has {len(header.shape)} dimensions; at most {MAX_TENSOR_DIMS} are allowed"
            )
        if any(dim < 0 for dim in header.shape):
            raise WireError(f"tensor '{name}': shape {list(header.shape)} has a negative dimension")
        itemsize = _NUMPY_DTYPES[header.datatype].itemsize
        # A dimension of 0 makes the tensor empty, but the others must still be sizes an array can have.
        extent = math.prod(dim for dim in header.shape if dim) * itemsize
        if extent > self.max_tensor_bytes:
            raise WireError(
                f"tensor '{name}': shape {list(header.shape)} needs {extent} bytes, "
                f"more than the limit of {self.max_tensor_bytes}"
            )
        num_bytes = math.prod(header.shape) * itemsize
        try:
            # Reserved, not zeroed: pages are used as chunks fill them.
            buffer: np.ndarray = np.empty(num_bytes, dtype=np.uint8)
        except MemoryError:
            raise WireError(
                f"tensor '{name}': shape {list(header.shape)} needs {num_bytes} bytes, more than this server can hold"
            ) from None
        self._header = header
        self._buffer = buffer
        self._received = 0

    def _complete(self) -> WireTensor:
        header, buffer = self._header, self._buffer
        assert header is not None and buffer is not None
        self._header, self._buffer, self._received = None, None, 0
        array = buffer.view(_NUMPY_DTYPES[header.datatype]).reshape(tuple(header.shape))
        return WireTensor(header.name, header.datatype, tuple(header.shape), header.index, array)


def decode_single(chunks: list[tensor_pb2.TensorChunk]) -> WireTensor:
    """Assembles exactly one tensor from a complete list of chunks."""
    assembler = TensorAssembler()
    result = None
    for chunk in chunks:
        if result is not None:
            raise WireError(f"tensor '{result.name}': chunks follow its last chunk")
        result = assembler.feed(chunk)
    assembler.finish()
    if result is None:
        raise WireError("no tensor was sent")
    return result


def expect_tensor(tensor: WireTensor, *, name: str, datatypes: tuple[str, ...], ndim: int) -> None:
    """Checks a received tensor's name, datatype and rank, naming what is allowed."""
    if tensor.name != name:
        raise WireError(f"tensor '{tensor.name}': expected a tensor named '{name}'")
    if tensor.datatype not in datatypes:
        raise WireError(f"tensor '{name}': datatype {tensor.datatype} is not allowed; allowed: {', '.join(datatypes)}")
    if len(tensor.shape) != ndim:
        raise WireError(f"tensor '{name}': shape {list(tensor.shape)} must have {ndim} dimensions")
