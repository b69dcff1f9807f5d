"""What every family's real-size preset shares (`*-config`: a published checkpoint's configs with random bf16
weights, so that memory, load times and startup are measured at real size without downloading anything).

Each component is built on the meta device, materialised in bf16 and filled tensor by tensor from one seeded
generator (`random_bf16`), saved, then dropped before the next is built: no float32 copy of anything is ever held,
and the largest component is the peak. The family's writer (families/<family>/real_size.py) holds the configs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from families.init_model import save_component

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
            scale = name.endswith(".gamma") or (tensor.dim() == 1 and "norm" in name and name.endswith("weight"))
            # A batch norm's running variance is a scale too: 1, so that dividing by its square root is defined.
            if scale or name.endswith(".running_var"):
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, REAL_SIZE_WEIGHT_STD, generator=generator)
    return model
