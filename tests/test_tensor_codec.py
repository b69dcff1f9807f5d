"""The wire codec: round trips, chunking, and a clear error for every malformed stream."""

import numpy as np
import pytest
import torch

from services.tensor_codec import TensorAssembler, WireError, decode_single, encode_tensor
from stagediff.v1 import tensor_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64])
def test_round_trip_torch(dtype: torch.dtype) -> None:
    value = (torch.randn(2, 3, 5) * 10).to(dtype)
    received = decode_single(list(encode_tensor("x", value, index=7)))
    assert received.name == "x" and received.index == 7 and received.shape == (2, 3, 5)
    assert torch.equal(received.to_torch(), value)


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
