"""`load_pretrained`: a model built empty, its weights read by several threads straight into their final dtype
and device, then assigned; and `planned_bytes`, what such a load will hold, read from the headers alone.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from stagekit.weights.empty import build_empty, fp32_matcher, library_of, target_dtype, tied_keys
from stagekit.weights.finish import finish
from stagekit.weights.keys import check_keys, read_headers, renamed, weight_files
from stagekit.weights.reader import Reader
from stagekit.weights.stats import LoadStats, finish_stats


def load_pretrained(
    model_class: type[nn.Module],
    directory: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    num_threads: int = 4,
    keep_in_fp32: Sequence[str] | None = None,
    tensor_filter: Callable[[str], bool] | None = None,
    shard_model: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Build `model_class` from the config in `directory` and load its safetensors weights into it.

    `model_class` is a diffusers `ModelMixin` or a transformers `PreTrainedModel` class; `directory`
    is a component folder (e.g. `<checkpoint>/transformer`). Floating-point weights are cast to
    `dtype`, except those the class keeps in fp32 (diffusers: `_keep_in_fp32_modules`, always;
    transformers: `_keep_in_fp32_modules` for fp16 and `_keep_in_fp32_modules_strict` for fp16 and
    bf16), exactly as `from_pretrained(torch_dtype=dtype)` does. `keep_in_fp32` overrides the class's
    list: module names matched against the components of each dotted key (`[]` keeps nothing in fp32).
    `num_threads` reads run at once (1: one after another, in file order).

    `tensor_filter(key) -> bool` selects the model keys to read; the rest are never read from disk and
    stay on the meta device, for the caller to fill (or to drop, e.g. by replacing the layers another
    rank holds). A rank of a pipeline split that owns blocks 0-19 would pass
    `lambda key: not key.startswith("blocks.") or int(key.split(".")[1]) < 20`. The key checks then
    apply only to the selected keys. Without a filter every key must be loaded.

    The returned model is in eval mode; `load_stats(model)` gives what was read and how fast.
    """
    start = time.perf_counter()
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    if shard_model is not None and tensor_filter is not None:
        raise ValueError("shard_model and tensor_filter cannot be combined")
    directory = Path(directory)
    device = torch.device(device)
    library = library_of(model_class)
    entries = read_headers(weight_files(directory))
    stats = LoadStats(threads=num_threads)
    if shard_model is not None:
        from stagekit.weights.sharded import load_sharded  # torch.distributed.tensor: for sharded loads only

        model = load_sharded(model_class, directory, library, entries, device, dtype, keep_in_fp32, shard_model, stats)
        return finish_stats(model, model_class, directory, stats, start)

    with Reader(entries, num_threads, stats) as reader:
        reading = None
        if library == "diffusers":
            # File names are the model's keys and the class alone decides each dtype (as in diffusers'
            # from_pretrained), so the tensors are read and cast while the model is being built.
            keep_fp32 = fp32_matcher(model_class, library, dtype, keep_in_fp32)
            early = [entry for entry in entries if tensor_filter is None or tensor_filter(entry.key)]
            reading = reader.start(early, functools.partial(target_dtype, dtype, keep_fp32, None), device)
        elif tensor_filter is None:
            reader.prefetch()  # transformers may rename keys: only fault the files in while building

        model = build_empty(model_class, directory, library, dtype)
        entries = renamed(entries, model, library)
        meta_state = model.state_dict(keep_vars=True)
        tied = tied_keys(model)
        wanted = {key for key in meta_state if tensor_filter is None or tensor_filter(key)}
        check_keys(model_class, directory, meta_state, entries, wanted, tied, tensor_filter is not None)
        to_read = [entry for entry in entries if entry.key in wanted]
        if reading is None:
            keep_fp32 = fp32_matcher(model, library, dtype, keep_in_fp32)
            reading = reader.start(to_read, functools.partial(target_dtype, dtype, keep_fp32, meta_state), device)
        state = reader.collect(reading, to_read)

    with torch.no_grad():
        model.load_state_dict(state, strict=False, assign=True)
    del state
    finish(model, library, device, directory, tied, wanted)
    stats.tensors = len(to_read)
    return finish_stats(model, model_class, directory, stats, start)


def planned_bytes(
    model_class: type[nn.Module],
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    keep_in_fp32: Sequence[str] | None = None,
) -> int:
    """The bytes of the weights `load_pretrained(model_class, directory, dtype=dtype)` will hold, read no tensor.

    The safetensors headers give each tensor's shape; its final dtype follows the same rule as the load
    (floating-point tensors cast to `dtype` unless the class keeps them in fp32, others as stored). The model
    is built empty (parameters on the meta device), as the load builds it, to rename keys and read the dtype
    plan. A tensor the model does not take is not counted (the load refuses it). services/memory_budget.py
    checks the result against the memory available before a stage loads.
    """
    directory = Path(directory)
    library = library_of(model_class)
    entries = read_headers(weight_files(directory))
    model = build_empty(model_class, directory, library, dtype)
    entries = renamed(entries, model, library)
    if library == "diffusers":
        keep_fp32 = fp32_matcher(model_class, library, dtype, keep_in_fp32)
        meta_state = None
    else:
        keep_fp32 = fp32_matcher(model, library, dtype, keep_in_fp32)
        meta_state = model.state_dict(keep_vars=True)
    expected = set(model.state_dict().keys())
    total = 0
    for entry in entries:
        if entry.key in expected:
            total += math.prod(entry.shape) * target_dtype(dtype, keep_fp32, meta_state, entry).itemsize
    return total
