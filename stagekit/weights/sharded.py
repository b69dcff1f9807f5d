"""Loading only this rank's shards: the model is built empty, sharded, allocated, then each DTensor is read as
this rank's slice only, straight from the file into the local shard.

A shard is one slice of the full tensor per placement, as `torch.chunk` cuts it, except where the parameter's
module lists the parameter in its `PACKED_SHARDS` attribute: {name: (dim, widths)} says the full tensor is
blocks of those widths along `dim` side by side, and the local shard holds each block's chunk for this rank, in
order (tensor parallelism's PackedRowwiseParallel and PackedColwiseParallel, stagekit/parallel/
tensor_parallel.py). Each such chunk is read into its part of the local tensor.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from stagekit.weights.empty import build_empty, fp32_matcher, target_dtype, tied_keys
from stagekit.weights.finish import set_tensor
from stagekit.weights.keys import TensorEntry, check_keys, listed_keys, renamed
from stagekit.weights.reader import Reader
from stagekit.weights.stats import LoadStats

logger = logging.getLogger(__name__)

# The module attribute that lists packed shards (see the module docstring).
PACKED_SHARDS = "packed_shards"
# Where a destination's part is, and the region of the full tensor read into it.
Region = tuple[slice, ...]


def _local_region(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full tensor this rank holds: everything for a plain tensor, its shard for a DTensor.

    Shards follow `torch.chunk` along each `Shard(dim)` placement, mesh dimension by mesh dimension (the
    layout of ColwiseParallel, RowwiseParallel and fully_shard); the result is checked against the local
    tensor's shape, so a layout this does not know (strided shards) fails loudly instead of loading the
    wrong rows.
    """
    if not isinstance(tensor, DTensor):
        return tuple(slice(None) for _ in tensor.shape)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the parameter's device mesh")
    begins = [0] * tensor.ndim
    sizes = list(tensor.shape)
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if type(placement) is not Shard:
            raise NotImplementedError(f"cannot load a parameter placed as {placement} shard by shard")
        dim, parts, index = placement.dim, mesh.size(mesh_dim), coordinate[mesh_dim]
        chunk = -(-sizes[dim] // parts)
        offset = min(index * chunk, sizes[dim])
        begins[dim] += offset
        sizes[dim] = max(0, min(chunk, sizes[dim] - offset))
    local_shape = tuple(tensor.to_local().shape)
    if tuple(sizes) != local_shape:
        raise NotImplementedError(
            f"shard layout {tensor.placements} gives {tuple(sizes)}, the local tensor is {local_shape}"
        )
    return tuple(slice(begin, begin + size) for begin, size in zip(begins, sizes, strict=True))


def _packed_regions(tensor: torch.Tensor, dim: int, widths: tuple[int, ...]) -> list[tuple[Region, Region]]:
    """(part of the local tensor, region of the full tensor) for each block of a packed shard."""
    if not isinstance(tensor, DTensor) or tensor.device_mesh.ndim != 1 or tensor.placements != (Shard(dim),):
        raise NotImplementedError(f"a packed shard is a DTensor placed Shard({dim}) on a 1-D mesh")
    parts, index = tensor.device_mesh.size(), tensor.device_mesh.get_local_rank()
    whole = [slice(None)] * tensor.ndim
    pairs, offset, local_offset = [], 0, 0
    for width in widths:
        chunk = width // parts
        local, full = list(whole), list(whole)
        local[dim] = slice(local_offset, local_offset + chunk)
        full[dim] = slice(offset + index * chunk, offset + (index + 1) * chunk)
        pairs.append((tuple(local), tuple(full)))
        offset, local_offset = offset + width, local_offset + chunk
    if offset != tensor.shape[dim] or local_offset != tensor.to_local().shape[dim]:
        raise NotImplementedError(f"packed widths {widths} do not make the tensor's {tensor.shape[dim]} along {dim}")
    return pairs


def _destinations(model: nn.Module, wanted: set[str]) -> dict[str, list[tuple[torch.Tensor, Region]]]:
    """For each wanted key, the parts of this rank's local tensor and the regions of the full tensor they hold."""
    packed: dict[str, tuple[int, tuple[int, ...]]] = {}
    for path, module in model.named_modules():
        for name, layout in getattr(module, PACKED_SHARDS, {}).items():
            packed[f"{path}.{name}" if path else name] = layout
    destinations = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key not in wanted:
            continue
        local = (value.to_local() if isinstance(value, DTensor) else value).data
        if key in packed:
            pairs = _packed_regions(value, *packed[key])
            destinations[key] = [(local[part], region) for part, region in pairs]
        else:
            destinations[key] = [(local, _local_region(value))]
    return destinations


def load_sharded(
    model_class: type[nn.Module],
    directory: Path,
    library: str,
    entries: list[TensorEntry],
    device: torch.device,
    dtype: torch.dtype,
    keep_in_fp32: Sequence[str] | None,
    shard_model: Callable[[nn.Module], None],
    stats: LoadStats,
) -> nn.Module:
    """`load_pretrained` with `shard_model`: build empty, shard, allocate the shards, read only them."""
    model = build_empty(model_class, directory, library, dtype)
    entries = renamed(entries, model, library)
    meta_state = model.state_dict(keep_vars=True)
    tied = tied_keys(model)
    if tied:
        raise NotImplementedError(f"{model_class.__name__} ties weights ({listed_keys(tied)}); load it whole")
    check_keys(model_class, directory, meta_state, entries, set(meta_state), tied, False)
    keep_fp32 = fp32_matcher(model if library == "transformers" else model_class, library, dtype, keep_in_fp32)
    dtype_of = functools.partial(target_dtype, dtype, keep_fp32, meta_state if library == "transformers" else None)
    by_key = {entry.key: entry for entry in entries}

    # Parameters take their final dtype while still on the meta device, so that the sharding plan sees
    # what it will hold (FSDP2 groups parameters by dtype) and allocation makes them right at once.
    with torch.no_grad():
        for key, value in meta_state.items():
            if value.is_meta:
                set_tensor(model, key, torch.empty_like(value, dtype=dtype_of(by_key[key])))
    real_buffers = {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}

    shard_model(model)
    # Allocates every (local shard of a) parameter on the device, uninitialised; `to_empty` would also
    # replace the buffers `__init__` computed (RoPE tables), so those are put back.
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in real_buffers.items():
            path, _, attribute = name.rpartition(".")
            model.get_submodule(path)._buffers[attribute] = buffer.to(device)

    destinations = _destinations(model, set(by_key))
    to_read = [by_key[key] for key in destinations]
    with Reader(to_read, num_threads=stats.threads, stats=stats) as reader:
        reader.fill(to_read, dtype_of, destinations)

    stats.tensors = len(to_read)
    if library == "diffusers":
        model.register_to_config(_name_or_path=str(directory))
    full_bytes = sum(entry.nbytes for entry in entries)
    logger.info(
        "%s from %s: this rank read %.3f of %.3f GB (its shards)",
        model_class.__name__,
        directory,
        stats.total_bytes / 1e9,
        full_bytes / 1e9,
    )
    return model.eval()
