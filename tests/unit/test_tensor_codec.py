"""The wire codec: round trips, chunking, and a clear error for every malformed stream.

`stagediff.tensor_codec` (numpy, the client's) and `services.torch_wire` (torch tensors, the servers') make the
same chunks.
"""

import numpy as np
import pytest
import torch

from services import torch_wire
from stagediff.tensor_codec import DATATYPES, TensorAssembler, WireError, decode_single, encode_tensor
from stagediff.v1 import tensor_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64, torch.bool])
def test_round_trip_torch(dtype: torch.dtype) -> None:
    value = (torch.randn(2, 3, 5) * 10).to(dtype)
    received = decode_single(list(torch_wire.encode_tensor("x", value, index=7)))
    assert received.name == "x" and received.index == 7 and received.shape == (2, 3, 5)
    assert torch.equal(torch_wire.to_torch(received), value)


def test_a_non_contiguous_tensor_travels_in_row_major_order() -> None:
    value = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    received = decode_single(list(torch_wire.encode_tensor("x", value)))
    assert np.array_equal(received.array, value.numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, np.int8, np.int16, np.int32, np.int64, np.bool_])
def test_round_trip_numpy_matches_the_torch_encoding(dtype) -> None:
    value = (np.arange(30).reshape(2, 3, 5) * 7).astype(dtype)
    chunks = list(encode_tensor("x", value, index=2))
    assert chunks == list(torch_wire.encode_tensor("x", torch.from_numpy(value), index=2))
    received = decode_single(chunks)
    assert received.array.dtype == value.dtype and np.array_equal(received.array, value)


def test_bf16_travels_as_its_bits_with_the_datatype_named() -> None:
    value = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    bits = value.view(torch.int16).numpy().view(np.uint16)
    chunks = list(encode_tensor("b", bits, datatype="BF16"))
    assert chunks == list(torch_wire.encode_tensor("b", value))
    received = decode_single(chunks)
    assert received.datatype == "BF16" and np.array_equal(received.array, bits)


def test_big_endian_arrays_travel_little_endian() -> None:
    value = np.arange(6, dtype=">i4")
    chunks = list(encode_tensor("x", value))
    assert chunks[0].header.datatype == "INT32" and chunks[0].data == np.arange(6, dtype="<i4").tobytes()


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: encode_tensor("x", torch.zeros(2)), TypeError, ["numpy array", "torch.Tensor", "torch_wire"]),
        (lambda: encode_tensor("x", [1, 2]), TypeError, ["numpy array", "list"]),
        (lambda: encode_tensor("x", np.zeros(2, np.complex64)), TypeError, ["complex64"]),
        (lambda: encode_tensor("x", np.zeros(2, np.float32), datatype="FP8"), ValueError, ["FP8", *DATATYPES]),
        (lambda: encode_tensor("x", np.zeros(2, np.float32), datatype="BF16"), TypeError, ["BF16", "uint16"]),
        (lambda: torch_wire.encode_tensor("x", torch.zeros(2, dtype=torch.complex64)), TypeError, ["complex64"]),
    ],
)
def test_a_value_that_cannot_travel_is_refused_when_encoding_starts(call, error, words) -> None:
    with pytest.raises(error) as raised:
        call()  # the error comes from the call itself, before any chunk is taken
    for word in words:
        assert word in str(raised.value)


def test_large_tensor_is_chunked_at_the_limit() -> None:
    value = np.arange(3 * 1024 * 1024, dtype=np.uint8)
    chunks = list(encode_tensor("frames", value, chunk_bytes=1 << 20))
    assert len(chunks) == 3
    assert all(len(chunk.data) <= 1 << 20 for chunk in chunks)
    assert chunks[0].HasField("header") and not chunks[1].HasField("header")
    assert [chunk.last for chunk in chunks] == [False, False, True]
    assert np.array_equal(decode_single(chunks).array, value)


def test_empty_tensor() -> None:
    received = decode_single(list(encode_tensor("e", np.zeros((0, 4), np.float32))))
    assert received.shape == (0, 4)


def test_several_tensors_in_one_stream() -> None:
    assembler = TensorAssembler()
    out = []
    for i in range(3):
        for chunk in encode_tensor("t", np.full((1000,), i, np.int32), index=i, chunk_bytes=1000):
            tensor = assembler.feed(chunk)
            if tensor is not None:
                out.append(tensor)
    assembler.finish()
    assert [t.index for t in out] == [0, 1, 2]
    assert all(np.all(t.array == t.index) for t in out)


def _header(datatype="FP32", shape=(4,)) -> tensor_pb2.TensorHeader:
    return tensor_pb2.TensorHeader(name="x", datatype=datatype, shape=list(shape))


@pytest.mark.parametrize(
    ("chunks", "words"),
    [
        ([tensor_pb2.TensorChunk(data=b"abcd", last=True)], ["header"]),
        ([tensor_pb2.TensorChunk(header=_header("FP8"), data=b"", last=True)], ["FP8", "FP32"]),
        ([tensor_pb2.TensorChunk(header=_header(shape=(-1,)), last=True)], ["negative"]),
        ([tensor_pb2.TensorChunk(header=_header(), data=b"\0" * 20, last=True)], ["more than the 16 bytes"]),
        ([tensor_pb2.TensorChunk(header=_header(), data=b"\0" * 8, last=True)], ["after 8 bytes", "need 16"]),
        (
            [
                tensor_pb2.TensorChunk(header=_header(), data=b"\0" * 8),
                tensor_pb2.TensorChunk(offset=4, data=b"\0" * 8, last=True),
            ],
            ["offset 4", "ended at byte 8"],
        ),
        ([tensor_pb2.TensorChunk(header=_header(), data=b"\0" * 8)], ["stream ended after 8 of 16"]),
        ([tensor_pb2.TensorChunk(header=_header(shape=(1 << 40,)), last=True)], ["more than the limit"]),
    ],
)
def test_malformed_streams_name_the_problem(chunks, words) -> None:
    with pytest.raises(WireError) as raised:
        decode_single(chunks)
    for word in words:
        assert word in str(raised.value)
