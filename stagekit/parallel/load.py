"""Loading a family's transformer onto the ranks of a parallel layout: `load_parallel_transformer`.

Every image family's denoiser builds its transformer the same way, and in this order:
1. the layout is checked against the family's features before any weight is read (`refuse_unsupported_methods`);
2. where the layout shards the weights (TP, HSDP), the family's `parallelize` is applied to the empty model and
   each rank reads only its shards (stagekit/weights/sharded.py); otherwise the whole model is read;
3. the stage's options (quantization, offload) are applied (`TransformerOptions.apply`);
4. where the layout did not shard the weights, `parallelize` is applied now (sequence parallelism needs no
   weights split, so it runs on the loaded model);
5. the CFG-parallel group, when the layout has one, is what the loop hands `guidance_predictions`.
A layout of one rank is no layout: the model is loaded and the options applied, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from stagekit.model_options import TransformerOptions
from stagekit.parallel.mesh import (
    ParallelConfig,
    SupportsFeatures,
    build_mesh,
    device_type_for,
    refuse_unsupported_methods,
)
from stagekit.weights import load_pretrained


class Parallelize(Protocol):
    """A family's `parallelize` (families/<family>/parallel.py): applies the layout to the model in place."""

    def __call__(
        self, transformer: nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device
    ) -> None: ...


@dataclass(frozen=True)
class ParallelTransformer:
    """A transformer loaded for one rank: the layout it runs (None on one rank) and its CFG-parallel group."""

    transformer: nn.Module
    parallel: ParallelConfig | None
    cfg_group: ProcessGroup | None


def load_parallel_transformer(
    model_class: type[nn.Module],
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    family: SupportsFeatures,
    parallelize: Parallelize,
    parallel: ParallelConfig | None,
    options: TransformerOptions | None,
    load_threads: int,
) -> ParallelTransformer:
    """`model_class` from `folder` on this rank, laid out by `parallel` with the family's `parallelize`, in eval
    mode; raises ParallelConfigError (before reading a weight) for a method the family does not run."""
    layout = parallel if parallel is not None and parallel.total_ranks > 1 else None
    mesh = None
    load = partial(load_pretrained, device=device, dtype=dtype, num_threads=load_threads)
    if layout is not None:
        refuse_unsupported_methods(layout, family)
        mesh = build_mesh(layout, device_type_for(device))
        if layout.shards_weights:
            load = partial(load, shard_model=partial(parallelize, config=layout, mesh=mesh, device=device))
    transformer = load(model_class, folder).eval()
    if options is not None:
        options.apply([transformer], device, load_threads)
    cfg_group = None
    if layout is not None:
        assert mesh is not None  # built whenever there is a layout
        if not layout.shards_weights:
            parallelize(transformer, layout, mesh, device)
        if layout.cfg_degree > 1:
            cfg_group = mesh["cfg"].get_group()
    return ParallelTransformer(transformer, layout, cfg_group)
