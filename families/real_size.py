"""What every family's real-size preset shares (`*-config`: a published checkpoint's configs with random bf16
weights, so that memory, load times and startup are measured at real size without downloading anything).

Each component is built on the meta device, materialised in bf16 and filled tensor by tensor from one seeded
generator (`random_bf16`), saved, then dropped before the next is built: no float32 copy of anything is ever held,
and the largest component is the peak. A component larger than a machine's memory (LTX-2's 19B transformer and
Gemma-3-12B, 38 and 24 GB in bf16) is written streamed instead (`save_streamed_components`): its tensors drawn in
the same order with the same values, one shard at a time, so that the peak is one shard (REAL_SIZE_SHARD_BYTES,
twice that while safetensors serialises it). The family's writer (families/<family>/real_size.py) holds the configs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from families.init_model import save_component

logger = logging.getLogger(__name__)

REAL_SIZE_DTYPE = torch.bfloat16
# Random weights are normal(0, REAL_SIZE_WEIGHT_STD); norm scales are 1.
REAL_SIZE_WEIGHT_STD = 0.02
# The published checkpoints' shards are at most 5 GB in their own dtype (float32 for some): half that in bf16
# splits the same tensors into about the same shards.
REAL_SIZE_SHARD_BYTES = 2_500_000_000
# A real-size preset's weighted components: name -> a function building it (on the meta device, by the caller).
Builders = dict[str, Callable[[], torch.nn.Module]]


def save_real_size_components(out: Path, builders: Builders, seed: int, save_kwargs: dict[str, Any]) -> None:
    """Builds each component on the meta device (`builders`: name -> a function constructing it), fills it with
    `random_bf16` and saves it to `out/name`, one at a time."""
    save_kwargs = {"max_shard_size": REAL_SIZE_SHARD_BYTES, **save_kwargs}
    for name, build in builders.items():
        with torch.device("meta"):
            module = build()
        save_component(random_bf16(module, seed).eval(), out, name, save_kwargs)
        del module


def random_bf16(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`model` (built on the meta device) materialised in bf16 on the CPU with seeded random weights.

    Every saved tensor is filled in place, in state-dict order, from one generator seeded with `seed`:
    normal(0, REAL_SIZE_WEIGHT_STD), except the scales of norms (the VAE's RMS-norm `gamma`s, and the
    one-dimensional weights of modules named "norm", and batch norms' running variances), which are 1; batch
    norms' counters are 0. A tensor shared under two names (UMT5's embedding) is filled once. Buffers that are
    not saved (Wan's RoPE tables) are left unset: loaders compute them.
    """
    model = model.to(REAL_SIZE_DTYPE).to_empty(device="cpu")
    if hasattr(model, "tie_weights"):
        # to_empty gives each module a parameter of its own: tie UMT5's embedding to the encoder's again, so
        # that it is filled and saved once, as in the published checkpoint.
        model.tie_weights()
    generator = torch.Generator().manual_seed(seed)
    filled: set[int] = set()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(".num_batches_tracked"):  # a batch norm's counter (FLUX.2's VAE)
                tensor.zero_()
                continue
            if not tensor.is_floating_point():
                raise ValueError(f"{name}: a saved {tensor.dtype} tensor; only floating-point weights are filled")
            if tensor.data_ptr() in filled:
                continue
            filled.add(tensor.data_ptr())
            _fill(name, tensor, generator)
    return model


def _is_scale(name: str, tensor: torch.Tensor) -> bool:
    """Whether the tensor `name` is a scale, filled with 1: a norm's (the VAE's RMS-norm `gamma`s, one-dimensional
    weights of modules named "norm") or a batch norm's running variance (so that dividing by its square root is
    defined)."""
    norm = name.endswith(".gamma") or (tensor.dim() == 1 and "norm" in name and name.endswith("weight"))
    return norm or name.endswith(".running_var")


def _fill(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Fills one saved floating-point tensor in place: 1 for a scale, else normal(0, REAL_SIZE_WEIGHT_STD)."""
    if _is_scale(name, tensor):
        tensor.fill_(1.0)
    else:
        tensor.normal_(0.0, REAL_SIZE_WEIGHT_STD, generator=generator)


def save_streamed_components(out: Path, builders: Builders, seed: int, save_kwargs: dict[str, Any]) -> None:
    """As `save_real_size_components`, but no component is ever held whole: each is built on the meta device and
    written shard by shard (`write_streamed`), with the values `random_bf16` would give it."""
    max_shard = int(save_kwargs.get("max_shard_size", REAL_SIZE_SHARD_BYTES))
    for name, build in builders.items():
        with torch.device("meta"):
            module = build()
        write_streamed(module, out / name, seed, max_shard)
        logger.info("%s: %.2fM parameters, streamed", name, sum(p.numel() for p in module.parameters()) / 1e6)
        del module


def saved_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` writes for `module` (on any device), in state-dict order: non-persistent
    buffers left out, a tensor tied under two names (an embedding and its head) kept under its first name."""
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    objects = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    seen: set[int] = set()
    kept: dict[str, torch.Tensor] = {}
    for name in module.state_dict():
        tensor = objects[name]
        if id(tensor) not in seen:
            seen.add(id(tensor))
            kept[name] = tensor
    return kept


def shard_names(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """The names in order, cut into shards of at most `max_shard_bytes` in bf16 (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * REAL_SIZE_DTYPE.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_streamed(module: torch.nn.Module, directory: Path, seed: int, max_shard_bytes: int) -> None:
    """Writes `module` (built on the meta device) to `directory` as its library's save_pretrained lays it out in
    bf16 (config.json, the safetensors files and, sharded, their index), drawing each shard's tensors only when it
    is written; the values are `random_bf16(module, seed)`'s."""
    from diffusers import ModelMixin
    from safetensors.torch import save_file

    diffusers_model = isinstance(module, ModelMixin)
    stem = "diffusion_pytorch_model" if diffusers_model else "model"
    tensors = saved_tensors(module)
    for name, tensor in tensors.items():
        if not tensor.is_floating_point() and not name.endswith(".num_batches_tracked"):
            raise ValueError(f"{name}: a saved {tensor.dtype} tensor; only floating-point weights are filled")
    shards = shard_names(tensors, max_shard_bytes)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for number, names in enumerate(shards, start=1):
        filename = f"{stem}.safetensors"
        if len(shards) > 1:
            filename = f"{stem}-{number:05d}-of-{len(shards):05d}.safetensors"
        data: dict[str, torch.Tensor] = {}
        for name in names:
            meta = tensors[name]
            weight_map[name] = filename
            if name.endswith(".num_batches_tracked"):
                data[name] = torch.zeros(meta.shape, dtype=meta.dtype)
                continue
            tensor = torch.empty(meta.shape, dtype=REAL_SIZE_DTYPE)
            _fill(name, tensor, generator)
            data[name] = tensor
            total += tensor.nbytes
        save_file(data, directory / filename, metadata={"format": "pt"})
        del data
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if diffusers_model:
        module.save_config(directory)
    else:
        module.config.architectures = [type(module).__name__]
        module.config.dtype = REAL_SIZE_DTYPE
        module.config.save_pretrained(directory)
        if module.can_generate():
            module.generation_config.save_pretrained(directory)
