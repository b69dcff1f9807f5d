"""HSDP (FSDP2's fully_shard on a (replicate, shard) mesh) for serving diffusers' DiTs.

For inference HSDP is purely a memory trade: each rank keeps 1/shard of every parameter and all-gathers one
transformer block's full weights just before the block runs, freeing them right after (reshard_after_forward),
so the peak is the shards plus a block or two of full weights. Ranks of the replicate dimension hold the same
shards and exchange nothing in forward; the replicate dimension keeps each all-gather inside a node when the
group spans several. The outputs are exactly the unsharded model's: the gathered weights are the originals. The
blocks are the modules of the classes the model lists in diffusers' `_repeated_blocks`, so any diffusers DiT that
declares them works.

Parameters are frozen: FSDP2 requires one original dtype per parameter group only among parameters that require
grad, and diffusers keeps some modules in fp32 (`_keep_in_fp32_modules`) beside bf16 ones in each Wan block, so
frozen groups all-gather in their own dtypes; parameters stay in the model's dtype (no MixedPrecisionPolicy).

The mesh's device type chooses the device and the group's backend: the same code runs on CPU with gloo and on
CUDA with NCCL.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def local_parameter_bytes(module: nn.Module) -> int:
    """Bytes of parameters this rank holds: local shards of DTensors (FSDP, TP), whole tensors otherwise."""
    total = 0
    for parameter in module.parameters():
        local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
        total += local.numel() * local.element_size()
    return total


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in order: instances of the classes its `_repeated_blocks` names."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    blocks = [module for module in transformer.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(transformer).__name__} declares no repeated blocks (_repeated_blocks) to shard one by one"
        )
    return blocks


def apply_hsdp(transformer: nn.Module, hsdp_mesh: DeviceMesh) -> None:
    """Shards the transformer's parameters over `hsdp_mesh`, one group per block and one for the rest, in place.

    `hsdp_mesh` is 2-D (replicate, shard) for HSDP or 1-D (shard) for plain
    FSDP; the model is left as it is when the shard dimension has one rank,
    since there is nothing to save. Parameters end on the mesh's device.
    """
    if hsdp_mesh.ndim not in (1, 2):
        raise ValueError(f"HSDP needs a 1-D (shard) or 2-D (replicate, shard) mesh, got {hsdp_mesh.ndim} dimensions")
    if hsdp_mesh.size(hsdp_mesh.ndim - 1) == 1:
        return
    blocks = transformer_blocks(transformer)
    transformer.requires_grad_(False)
    for block in blocks:
        fully_shard(block, mesh=hsdp_mesh, reshard_after_forward=True)
    # The root group (patch and condition embeddings, proj_out, the output modulation) is gathered once per forward
    # and freed after it too: between denoising steps a rank holds shards only.
    fully_shard(transformer, mesh=hsdp_mesh, reshard_after_forward=True)
