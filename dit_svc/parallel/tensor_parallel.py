"""Tensor parallelism for diffusers' WanTransformer3DModel (Megatron-style, attention heads and FFN split).

Within each transformer block, the projections into the attention heads (to_q,
to_k, to_v, and the image-context add_k_proj / add_v_proj of I2V models) are
split column-wise, so every tp rank computes a contiguous group of heads; the
output projection to_out[0] is split row-wise and all-reduces its partial sums.
The feed-forward's first projection is split column-wise and its last one
row-wise. Everything else (patch embedding, condition embedder, modulation
tables, the LayerNorms, proj_out) stays replicated: it is small, or cheap next
to the all-reduce it would need.

Wan normalises queries and keys with one RMSNorm over all heads' features
("rms_norm_across_heads"), so a rank that holds some heads cannot normalise
them alone. `HeadShardedRMSNorm` keeps the rank's slice of the norm's weight
and all-reduces the sum of squares over the tp group, which gives the same
result as the full norm.

The plan is a plain function over `torch.distributed.tensor.parallel`, after
torchtitan's `apply_tp`; outputs are local tensors (use_local_output), so the
rest of the model, the attention processor included, sees plain tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dit_svc.parallel.mesh import ParallelConfigError, _divisors

# Norms of the attention that act on the projections' (now head-sharded) output features.
_HEAD_NORMS = ("norm_q", "norm_k", "norm_added_k")


class HeadShardedRMSNorm(nn.Module):
    """RMSNorm over a feature dimension whose columns are split across a process group.

    Computes what torch.nn.RMSNorm(full_dim) computes on the concatenated input
    (fp32 computation for low-precision inputs, weight applied before the cast
    back), from this rank's columns: the mean of squares is the all-reduced sum
    of the local squares divided by the full dimension.
    """

    def __init__(self, weight: torch.Tensor | None, full_dim: int, eps: float | None, group: dist.ProcessGroup):
        super().__init__()
        self.full_dim = full_dim
        self.eps = eps
        self.group = group
        self.weight = None if weight is None else nn.Parameter(weight, requires_grad=weight.requires_grad)

    @classmethod
    def from_rms_norm(cls, norm: nn.RMSNorm, tp_mesh: DeviceMesh) -> HeadShardedRMSNorm:
        """Shards `norm`'s weight as Shard(0): each rank keeps the columns ColwiseParallel's Shard(0) gives it.

        The weight stays a DTensor (its local part is used in forward), so that a checkpoint loader sees
        which slice of the full weight this rank holds; `norm` may be on the meta device.
        """
        (full_dim,) = norm.normalized_shape
        weight = None
        if norm.weight is not None:
            weight = distribute_tensor(norm.weight.detach(), tp_mesh, [Shard(0)])
            weight.requires_grad_(norm.weight.requires_grad)
        return cls(weight, full_dim, norm.eps, tp_mesh.get_group())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        compute_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        upcast = hidden_states.to(compute_dtype)
        sum_of_squares = upcast.pow(2).sum(dim=-1, keepdim=True)
        sum_of_squares = funcol.all_reduce(sum_of_squares, "sum", group=self.group)
        # The same eps default as torch.rms_norm: the machine epsilon of the computation dtype.
        eps = torch.finfo(compute_dtype).eps if self.eps is None else self.eps
        result = upcast * torch.rsqrt(sum_of_squares / self.full_dim + eps)
        if self.weight is not None:
            result = result * self.weight.to_local()
        return result.type_as(hidden_states)

    def extra_repr(self) -> str:
        local_dim = self.full_dim if self.weight is None else self.weight.to_local().shape[0]
        return f"local_dim={local_dim}, full_dim={self.full_dim}, eps={self.eps}"


def _check_divisible(transformer: nn.Module, tp_size: int) -> None:
    """Refuses models that the tp size cannot split evenly, before anything is changed."""
    for index, block in enumerate(transformer.blocks):
        for name in ("attn1", "attn2"):
            attn = getattr(block, name)
            if getattr(attn, "fused_projections", False):
                raise ParallelConfigError(
                    f"blocks.{index}.{name} has fused QKV projections, which tensor parallelism cannot split by "
                    "heads; call unfuse_qkv_projections() on the transformer first"
                )
            if attn.heads % tp_size != 0:
                raise ParallelConfigError(
                    f"--tensor-parallel-size {tp_size} does not divide the model's {attn.heads} attention heads "
                    f"(blocks.{index}.{name}); tensor-parallel sizes that do: {_divisors(attn.heads)}"
                )
            for norm_name in _HEAD_NORMS:
                norm = getattr(attn, norm_name, None)
                if norm is not None and not isinstance(norm, nn.RMSNorm):
                    raise ParallelConfigError(
                        f"blocks.{index}.{name}.{norm_name} is {type(norm).__name__}; tensor parallelism supports "
                        "Wan's RMSNorm across heads only"
                    )
        first, last = block.ffn.net[0].proj, block.ffn.net[2]
        if not (isinstance(first, nn.Linear) and isinstance(last, nn.Linear)):
            raise ParallelConfigError(f"blocks.{index}.ffn is not the expected Linear-GELU-Linear feed-forward")
        if first.out_features % tp_size != 0:
            raise ParallelConfigError(
                f"--tensor-parallel-size {tp_size} does not divide the feed-forward dimension {first.out_features} "
                f"(blocks.{index}.ffn); tensor-parallel sizes that do: {_divisors(first.out_features)}"
            )


def _block_plan(block: nn.Module) -> dict[str, ColwiseParallel | RowwiseParallel]:
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {}
    for name in ("attn1", "attn2"):
        attn = getattr(block, name)
        for projection in ("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj"):
            if getattr(attn, projection, None) is not None:
                plan[f"{name}.{projection}"] = ColwiseParallel()
        plan[f"{name}.to_out.0"] = RowwiseParallel()
    plan["ffn.net.0.proj"] = ColwiseParallel()
    plan["ffn.net.2"] = RowwiseParallel()
    return plan


def apply_tensor_parallel(transformer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Splits every block's attention heads and feed-forward over `tp_mesh` (1-D), in place.

    Every rank of the tp group must hold the same full weights beforehand and
    feed the same inputs; the transformer's output is then the same on all of
    them and equals the unsplit model's.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D mesh, got {tp_mesh.ndim} dimensions")
    tp_size = tp_mesh.size()
    if tp_size == 1:
        return
    _check_divisible(transformer, tp_size)

    for block in transformer.blocks:
        parallelize_module(block, tp_mesh, _block_plan(block))
        for attn in (block.attn1, block.attn2):
            # WanAttnProcessor unflattens the projections' (now local) features into attn.heads heads.
            attn.heads //= tp_size
            for norm_name in _HEAD_NORMS:
                norm = getattr(attn, norm_name, None)
                if norm is not None:
                    setattr(attn, norm_name, HeadShardedRMSNorm.from_rms_norm(norm, tp_mesh))
