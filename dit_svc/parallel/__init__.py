"""Splitting one request's denoising across a process group.

`ParallelConfig` holds the degrees from the command line, `build_mesh` lays
them out as one DeviceMesh, and `parallelize_transformer` applies the plan to a
diffusers transformer in place. CFG-parallel needs no change to the model: the
denoising loop runs one branch per CFG rank group (see dit_svc/denoise.py).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from dit_svc.parallel.mesh import ParallelConfig, ParallelConfigError, build_hsdp_mesh, build_mesh, device_type_for

__all__ = ["ParallelConfig", "ParallelConfigError", "build_mesh", "parallelize_transformer"]


def parallelize_transformer(
    transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device
) -> None:
    """Applies the layout to a WanTransformer3DModel (or, Ulysses only, a QwenImageTransformer2DModel)
    in place, innermost first.

    Tensor parallelism goes first, since it changes each attention's local head
    count and norms, which the sequence-parallel attention then builds on; HSDP
    wraps the result, sharding whatever parameters each rank still holds whole.
    """
    if config.tp_degree > 1:
        from dit_svc.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(transformer, mesh["tp"])
    if config.sequence_parallel:
        from diffusers import QwenImageTransformer2DModel

        if isinstance(transformer, QwenImageTransformer2DModel):
            from dit_svc.parallel.qwen_sequence_parallel import apply_qwen_ulysses

            apply_qwen_ulysses(transformer, mesh)
        else:
            from dit_svc.parallel.sequence_parallel import apply_sequence_parallel

            apply_sequence_parallel(transformer, mesh)
    if config.use_hsdp and config.hsdp_shard_size * config.hsdp_replicate_size > 1:
        from dit_svc.parallel.hsdp import apply_hsdp

        apply_hsdp(transformer, build_hsdp_mesh(config, device_type_for(device)))
