"""torch tensors on the wire: the server side of `stagediff.tensor_codec`.

The codec itself speaks numpy, so that the client never needs torch. Stages
hold torch tensors: `encode_tensor` takes them (on any device, bfloat16
included) as well as numpy arrays, and `to_torch` turns a received
`WireTensor` back into a tensor, reading BF16's uint16 bits as bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from stagediff import tensor_codec
from stagediff.tensor_codec import DEFAULT_CHUNK_BYTES, WireTensor
from stagediff.v1 import tensor_pb2

# torch dtype -> KServe v2 datatype name.
_DATATYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "UINT8",
    torch.int8: "INT8",
    torch.int16: "INT16",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.float16: "FP16",
    torch.bfloat16: "BF16",
    torch.float32: "FP32",
    torch.float64: "FP64",
}


def encode_tensor(
    name: str,
    value: torch.Tensor | np.ndarray,
    *,
    index: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[tensor_pb2.TensorChunk]:
    """The chunks of one tensor or numpy array, as `stagediff.tensor_codec.encode_tensor` makes them."""
    if not isinstance(value, torch.Tensor):
        return tensor_codec.encode_tensor(name, value, index=index, chunk_bytes=chunk_bytes)
    datatype = _DATATYPES.get(value.dtype)
    if datatype is None:
        allowed = ", ".join(str(dtype) for dtype in _DATATYPES)
        raise TypeError(f"tensor '{name}': dtype {value.dtype} cannot travel on the wire; allowed: {allowed}")
    tensor = value.detach().cpu().contiguous()
    # numpy has no bfloat16: its bits travel as uint16.
    array = tensor.view(torch.int16).numpy().view(np.uint16) if datatype == "BF16" else tensor.numpy()
    return tensor_codec.encode_tensor(name, array, index=index, chunk_bytes=chunk_bytes, datatype=datatype)


def to_torch(tensor: WireTensor) -> torch.Tensor:
    """The received tensor as a torch tensor over the same memory; BF16 comes back as bfloat16."""
    result = torch.from_numpy(tensor.array)
    if tensor.datatype == "BF16":
        result = result.view(torch.bfloat16)
    return result
