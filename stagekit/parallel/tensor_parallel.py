"""Tensor parallelism for diffusers' DiTs (Megatron-style, attention heads and FFN split), one plan per class.

Within each transformer block, the projections into the attention heads (to_q, to_k, to_v and the added
projections: Wan I2V's add_k_proj / add_v_proj, Qwen-Image's add_q_proj / add_k_proj / add_v_proj) are split
column-wise, so every tp rank computes a contiguous group of heads; the output projections (to_out[0], and
Qwen-Image's to_add_out) are split row-wise and all-reduce their partial sums. Each feed-forward's first
projection is split column-wise and its last one row-wise (Wan's ffn, Qwen-Image's img_mlp and txt_mlp; of
Z-Image's SwiGLU, both the gate and the up projection column-wise, so that their product is each rank's own).
Everything else stays replicated: it is small, or cheap next to the all-reduce it would need. `BlockPlan` names
these modules for one list of blocks; `PLANS` holds, per supported class, one plan for each of its block lists.

A block may also end in a Linear whose input is several column-split streams side by side: FLUX's single-stream
blocks run the attention and an MLP in parallel and project cat([attention output, MLP output]) with one
`proj_out`. Its contiguous column shards would not line up with what each rank computed, so `PackedRowwise`
splits each stream's columns on their own: a rank holds, of each stream's columns, the slice its column split
gave it, side by side, and all-reduces the partial sums as a row-wise split does. The converse, a Linear that
makes several streams side by side (FLUX.2's to_qkv_mlp_proj: Q, K, V and an MLP's gate and up; a SwiGLU's
packed gate and up), gets `PackedColwiseParallel`: a rank holds each stream's chunk of the rows, in order. The
loader reads those slices from the checkpoint (stagekit/weights/sharded.py, `PACKED_SHARDS`).

Query and key norms come in two kinds, told apart by their width. Qwen-Image normalises each head alone, so a
rank applies the norm as it is. Wan normalises all heads' features with one RMSNorm ("rms_norm_across_heads"),
so `HeadShardedRMSNorm` keeps the rank's slice of the weight and all-reduces the sum of squares over the tp
group, which gives the same result as the full norm.

The plan is a plain function over `torch.distributed.tensor.parallel`, after torchtitan's `apply_tp`; outputs are
local tensors (use_local_output), so the rest of the model sees plain tensors. Each attention's `heads` and
`inner_dim` are narrowed to the rank's heads, which the processors read (Qwen-Image's derives head_dim from them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from stagekit.parallel.mesh import ParallelConfigError, _divisors
from stagekit.weights.sharded import PACKED_SHARDS

# The attributes diffusers sets on a fused Linear to say which streams it packs (their widths, in order).
PACKED_COLUMNS = "_tp_packed_col_blocks"
PACKED_ROWS = "_tp_packed_row_blocks"


@dataclass(frozen=True)
class PackedRowwise:
    """A Linear of the block whose input is the outputs of column-split Linears side by side, in that order:
    `streams` names those Linears, or is empty where the Linear lists the widths itself (diffusers'
    `_tp_packed_row_blocks`, as FLUX.2's single-stream `to_out`)."""

    linear: str
    streams: tuple[str, ...] = ()


@dataclass(frozen=True)
class PackedColumnwise:
    """A Linear of the block whose output is several streams side by side, each split over the ranks on its own
    (a rank holds its slice of each, in order): `parts` equal streams (a SwiGLU's gate and up projection), or,
    with `parts` 0, the widths the Linear lists itself (diffusers' `_tp_packed_col_blocks`, as FLUX.2's
    single-stream `to_qkv_mlp_proj`: Q, K, V, gate, up)."""

    linear: str
    parts: int = 0


@dataclass(frozen=True)
class BlockPlan:
    """Where one model class keeps what tensor parallelism splits; a name a block lacks is skipped."""

    # The transformer's ModuleList of blocks.
    blocks: str
    # The attention modules of a block.
    attentions: tuple[str, ...]
    # In each attention: the projections into the heads (column-wise), out of them (row-wise), the q/k norms.
    columnwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    norms: tuple[str, ...]
    # The Linear-GELU-Linear FeedForward modules of a block.
    feed_forwards: tuple[str, ...]
    # Linears of the block itself split column-wise (FLUX's single-stream MLP input, proj_mlp; Z-Image's SwiGLU
    # gate and up projections) and row-wise (Z-Image's SwiGLU down projection), for feed-forwards that are not
    # diffusers' Linear-GELU-Linear FeedForward.
    block_columnwise: tuple[str, ...] = ()
    block_rowwise: tuple[str, ...] = ()
    # Linears that take several column-split streams side by side (FLUX's single-stream proj_out).
    packed_rowwise: tuple[PackedRowwise, ...] = ()
    # Linears that make several streams side by side (FLUX.2's fused projections).
    packed_columnwise: tuple[PackedColumnwise, ...] = ()
    # Further widths of each attention the processors read, narrowed to the rank's share as `heads` and
    # `inner_dim` are (FLUX.2's single-stream `mlp_hidden_dim`).
    narrowed: tuple[str, ...] = ()


PLANS: dict[str, tuple[BlockPlan, ...]] = {
    "WanTransformer3DModel": (
        BlockPlan(
            blocks="blocks",
            attentions=("attn1", "attn2"),
            columnwise=("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj"),
            rowwise=("to_out.0",),
            norms=("norm_q", "norm_k", "norm_added_k"),
            feed_forwards=("ffn",),
        ),
    ),
    # diffusers' own QwenImageTransformer2DModel._tp_plan splits the same Linears.
    "QwenImageTransformer2DModel": (
        BlockPlan(
            blocks="transformer_blocks",
            attentions=("attn",),
            columnwise=("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"),
            rowwise=("to_out.0", "to_add_out"),
            norms=("norm_q", "norm_k", "norm_added_q", "norm_added_k"),
            feed_forwards=("img_mlp", "txt_mlp"),
        ),
    ),
    # diffusers' own FluxTransformer2DModel._tp_plan splits the same Linears (its PackedRowwiseParallel for
    # proj_out); the double-stream blocks are Qwen-Image's kind.
    "FluxTransformer2DModel": (
        BlockPlan(
            blocks="transformer_blocks",
            attentions=("attn",),
            columnwise=("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"),
            rowwise=("to_out.0", "to_add_out"),
            norms=("norm_q", "norm_k", "norm_added_q", "norm_added_k"),
            feed_forwards=("ff", "ff_context"),
        ),
        BlockPlan(
            blocks="single_transformer_blocks",
            attentions=("attn",),
            columnwise=("to_q", "to_k", "to_v"),
            rowwise=(),
            norms=("norm_q", "norm_k"),
            feed_forwards=(),
            block_columnwise=("proj_mlp",),
            packed_rowwise=(PackedRowwise("proj_out", streams=("attn.to_v", "proj_mlp")),),
        ),
    ),
    # diffusers' own Flux2Transformer2DModel._tp_plan splits the same Linears. The double-stream blocks are
    # FLUX.1's kind with a SwiGLU feed-forward (its gate and up projection packed in linear_in); each
    # single-stream block packs Q, K, V and the MLP's gate and up in to_qkv_mlp_proj and takes the attention and
    # MLP outputs side by side in to_out.
    "Flux2Transformer2DModel": (
        BlockPlan(
            blocks="transformer_blocks",
            attentions=("attn",),
            columnwise=("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"),
            rowwise=("to_out.0", "to_add_out"),
            norms=("norm_q", "norm_k", "norm_added_q", "norm_added_k"),
            feed_forwards=(),
            block_rowwise=("ff.linear_out", "ff_context.linear_out"),
            packed_columnwise=(PackedColumnwise("ff.linear_in", parts=2), PackedColumnwise("ff_context.linear_in", 2)),
        ),
        BlockPlan(
            blocks="single_transformer_blocks",
            attentions=("attn",),
            columnwise=(),
            rowwise=(),
            norms=("norm_q", "norm_k"),
            feed_forwards=(),
            packed_rowwise=(PackedRowwise("attn.to_out"),),
            packed_columnwise=(PackedColumnwise("attn.to_qkv_mlp_proj"),),
            narrowed=("mlp_hidden_dim",),
        ),
    ),
    # The refiners and the main layers are one block class: heads split as Qwen-Image's (each head's own q/k
    # norm), the SwiGLU feed-forward w2(silu(w1(x)) * w3(x)) split as Megatron splits it, both inputs column-wise
    # (so the product is elementwise on each rank's columns) and w2 row-wise.
    "ZImageTransformer2DModel": tuple(
        BlockPlan(
            blocks=blocks,
            attentions=("attention",),
            columnwise=("to_q", "to_k", "to_v"),
            rowwise=("to_out.0",),
            norms=("norm_q", "norm_k"),
            feed_forwards=(),
            block_columnwise=("feed_forward.w1", "feed_forward.w3"),
            block_rowwise=("feed_forward.w2",),
        )
        for blocks in ("noise_refiner", "context_refiner", "layers")
    ),
    # One joint [text; image] stream: the heads (each head's own q/k norm) and the image MLP's SwiGLU, as
    # Z-Image's. diffusers' processor splits the projections by head_dim, which narrowing both `heads` and
    # `inner_dim` keeps.
    # The dual-stream blocks are FLUX.1's double-stream kind; the token refiner and embedders stay whole.
    "HunyuanVideo15Transformer3DModel": (
        BlockPlan(
            blocks="transformer_blocks",
            attentions=("attn",),
            columnwise=("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"),
            rowwise=("to_out.0", "to_add_out"),
            norms=("norm_q", "norm_k", "norm_added_q", "norm_added_k"),
            feed_forwards=("ff", "ff_context"),
        ),
    ),
    "QwenImage21Transformer2DModel": (
        BlockPlan(
            blocks="transformer_blocks",
            attentions=("attn",),
            columnwise=("to_q", "to_k", "to_v"),
            rowwise=("to_out.0",),
            norms=("norm_q", "norm_k"),
            feed_forwards=(),
            block_columnwise=("img_mlp.proj", "img_mlp.gate_layer"),
            block_rowwise=("img_mlp.out",),
        ),
    ),
}


def plan_for(transformer: nn.Module) -> tuple[BlockPlan, ...]:
    """The plans of the transformer's class (or of the diffusers class it derives from), one per block list."""
    for cls in type(transformer).__mro__:
        if cls.__name__ in PLANS:
            return PLANS[cls.__name__]
    raise ParallelConfigError(
        f"tensor parallelism has no plan for {type(transformer).__name__}; it splits {', '.join(PLANS)}"
    )


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    """The submodule at a dotted path, or None where the model has none (or None stands in for it)."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


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


def _normalized_width(norm: nn.Module) -> int | None:
    """The width a norm normalises over (torch's normalized_shape, diffusers' RMSNorm dim), if one dimension."""
    for attribute in ("normalized_shape", "dim"):
        shape = getattr(norm, attribute, None)
        if shape is None:
            continue
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return shape[0] if len(shape) == 1 else None
    return None


def _across_heads(norm: nn.Module, attn: nn.Module, where: str) -> bool:
    """True for a norm over every head's features (it must be sharded), False for one over a single head."""
    head_dim = attn.inner_dim // attn.heads
    width = _normalized_width(norm)
    if width == attn.heads * head_dim and isinstance(norm, nn.RMSNorm):
        return True
    if width == head_dim:
        return False
    raise ParallelConfigError(
        f"{where} is {type(norm).__name__} over {width} features; tensor parallelism supports a norm over one "
        f"head ({head_dim} features) or torch's RMSNorm across heads ({attn.heads * head_dim} features)"
    )


def _check_divisible(transformer: nn.Module, plan: BlockPlan, tp_size: int) -> None:
    """Refuses models that the tp size cannot split evenly, before anything is changed."""
    for index, block in enumerate(transformer.get_submodule(plan.blocks)):
        prefix = f"{plan.blocks}.{index}"
        for name in plan.attentions:
            attn = getattr(block, name)
            if getattr(attn, "fused_projections", False):
                raise ParallelConfigError(
                    f"{prefix}.{name} has fused QKV projections, which tensor parallelism cannot split by "
                    "heads; call unfuse_qkv_projections() on the transformer first"
                )
            if attn.heads % tp_size != 0:
                raise ParallelConfigError(
                    f"--tensor-parallel-size {tp_size} does not divide the model's {attn.heads} attention heads "
                    f"({prefix}.{name}); tensor-parallel sizes that do: {_divisors(attn.heads)}"
                )
            for norm_name in plan.norms:
                norm = getattr(attn, norm_name, None)
                if norm is not None:
                    _across_heads(norm, attn, f"{prefix}.{name}.{norm_name}")
        for name in plan.feed_forwards:
            ffn = getattr(block, name)
            first, last = ffn.net[0].proj, ffn.net[2]
            if not (isinstance(first, nn.Linear) and isinstance(last, nn.Linear)):
                raise ParallelConfigError(f"{prefix}.{name} is not the expected Linear-GELU-Linear feed-forward")
            if first.out_features % tp_size != 0:
                raise ParallelConfigError(
                    f"--tensor-parallel-size {tp_size} does not divide the feed-forward dimension "
                    f"{first.out_features} ({prefix}.{name}); tensor-parallel sizes that do: "
                    f"{_divisors(first.out_features)}"
                )
        for name in plan.block_columnwise:
            _check_width(block.get_submodule(name).out_features, tp_size, f"{prefix}.{name}")
        for name in plan.block_rowwise:
            _check_width(block.get_submodule(name).in_features, tp_size, f"{prefix}.{name}")
        for packed in plan.packed_rowwise:
            for width in _stream_widths(block, packed):
                _check_width(width, tp_size, f"{prefix}.{packed.linear}")
        for packed_columns in plan.packed_columnwise:
            for width in _column_widths(block, packed_columns):
                _check_width(width, tp_size, f"{prefix}.{packed_columns.linear}")


def _check_width(width: int, tp_size: int, where: str) -> None:
    if width % tp_size != 0:
        raise ParallelConfigError(
            f"--tensor-parallel-size {tp_size} does not divide the {width} features of {where}; tensor-parallel "
            f"sizes that do: {_divisors(width)}"
        )


def _stream_widths(block: nn.Module, packed: PackedRowwise) -> tuple[int, ...]:
    """The widths of the streams a packed Linear takes, in its input's order (each stream's Linear's outputs, or
    the widths the Linear lists)."""
    linear = block.get_submodule(packed.linear)
    if packed.streams:
        widths = tuple(block.get_submodule(stream).out_features for stream in packed.streams)
    else:
        widths = tuple(getattr(linear, PACKED_ROWS, ()))
    if not widths or sum(widths) != linear.in_features:
        raise ParallelConfigError(f"{packed.linear} takes {widths} side by side, not its own input width")
    return widths


def _column_widths(block: nn.Module, packed: PackedColumnwise) -> tuple[int, ...]:
    """The widths of the streams a packed Linear makes, in its output's order."""
    linear = block.get_submodule(packed.linear)
    if packed.parts:
        widths = (linear.out_features // packed.parts,) * packed.parts
    else:
        widths = tuple(getattr(linear, PACKED_COLUMNS, ()))
    if not widths or sum(widths) != linear.out_features:
        raise ParallelConfigError(f"{packed.linear} makes {widths} side by side, not its own output width")
    return widths


class PackedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a Linear whose input is column-split streams side by side: the weight keeps, of each
    stream's columns, the rank's slice (the one ColwiseParallel's chunking gave the stream), in the input's
    order; the bias stays whole and is added after the all-reduce, as RowwiseParallel adds it.

    The weight is a DTensor placed Shard(1) whose local columns are not one contiguous slice: it is only used
    locally, and the module lists the layout in `PACKED_SHARDS` for the loader."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.widths = widths

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        weight, bias = module.weight, module.bias
        packed = _packed_shard(weight.detach(), self.widths, 1, device_mesh)
        module.register_parameter("weight", nn.Parameter(packed, requires_grad=weight.requires_grad))
        if bias is not None:
            whole = distribute_tensor(bias.detach(), device_mesh, [Replicate()])
            module.register_parameter("bias", nn.Parameter(whole, requires_grad=bias.requires_grad))
        setattr(module, PACKED_SHARDS, {"weight": (1, self.widths)})


class PackedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a Linear whose output is several streams side by side: the weight's rows (and the
    bias) keep, of each stream, the rank's chunk, in the output's order, so the local output is each stream's
    share side by side and a split of it by the streams' local widths gives each stream's columns.

    The weight is a DTensor placed Shard(0) whose local rows are not one contiguous slice: it is only used
    locally, and the module lists the layout in `PACKED_SHARDS` for the loader."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.widths = widths

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        layout = {}
        for attribute in ("weight", "bias"):
            tensor = getattr(module, attribute)
            if tensor is None:
                continue
            packed = _packed_shard(tensor.detach(), self.widths, 0, device_mesh)
            module.register_parameter(attribute, nn.Parameter(packed, requires_grad=tensor.requires_grad))
            layout[attribute] = (0, self.widths)
        setattr(module, PACKED_SHARDS, layout)


def _packed_shard(tensor: torch.Tensor, widths: tuple[int, ...], dim: int, device_mesh: DeviceMesh) -> DTensor:
    """This rank's chunk of each block of `widths` along `dim`, side by side, as a DTensor placed Shard(dim)."""
    rank, parts = device_mesh.get_local_rank(), device_mesh.size()
    slices, offset = [], 0
    for width in widths:
        chunk = width // parts
        slices.append(tensor.narrow(dim, offset + rank * chunk, chunk))
        offset += width
    return DTensor.from_local(torch.cat(slices, dim=dim), device_mesh, [Shard(dim)], run_check=False)


def _block_plan(block: nn.Module, plan: BlockPlan) -> dict[str, ColwiseParallel | RowwiseParallel]:
    styles: dict[str, ColwiseParallel | RowwiseParallel] = {name: ColwiseParallel() for name in plan.block_columnwise}
    styles.update({name: RowwiseParallel() for name in plan.block_rowwise})
    for packed in plan.packed_rowwise:
        styles[packed.linear] = PackedRowwiseParallel(_stream_widths(block, packed))
    for packed_columns in plan.packed_columnwise:
        styles[packed_columns.linear] = PackedColwiseParallel(_column_widths(block, packed_columns))
    for name in plan.attentions:
        attn = getattr(block, name)
        for projection in plan.columnwise:
            if _submodule(attn, projection) is not None:
                styles[f"{name}.{projection}"] = ColwiseParallel()
        for projection in plan.rowwise:
            if _submodule(attn, projection) is not None:
                styles[f"{name}.{projection}"] = RowwiseParallel()
    for name in plan.feed_forwards:
        styles[f"{name}.net.0.proj"] = ColwiseParallel()
        styles[f"{name}.net.2"] = RowwiseParallel()
    return styles


def apply_tensor_parallel(transformer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Splits every block's attention heads and feed-forwards over `tp_mesh` (1-D), in place.

    The plans are the transformer class's (`PLANS`), one per block list. Every rank of the tp group must hold
    the same full weights beforehand (or the model is still on the meta device, to be loaded shard by shard)
    and feed the same inputs; the transformer's output is then the same on all of them and equals the
    unsplit model's.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism needs a 1-D mesh, got {tp_mesh.ndim} dimensions")
    tp_size = tp_mesh.size()
    if tp_size == 1:
        return
    plans = plan_for(transformer)
    for plan in plans:
        _check_divisible(transformer, plan, tp_size)
    for plan in plans:
        _apply_plan(transformer, plan, tp_mesh)


def _apply_plan(transformer: nn.Module, plan: BlockPlan, tp_mesh: DeviceMesh) -> None:
    tp_size = tp_mesh.size()
    for block in transformer.get_submodule(plan.blocks):
        parallelize_module(block, tp_mesh, _block_plan(block, plan))
        for name in plan.attentions:
            attn = getattr(block, name)
            across_heads = {
                norm_name: _across_heads(getattr(attn, norm_name), attn, norm_name)
                for norm_name in plan.norms
                if getattr(attn, norm_name, None) is not None
            }
            # The processors unflatten the projections' (now local) features into attn.heads heads.
            attn.heads //= tp_size
            attn.inner_dim //= tp_size
            for width in plan.narrowed:
                setattr(attn, width, getattr(attn, width) // tp_size)
            for norm_name, sharded in across_heads.items():
                if sharded:
                    setattr(attn, norm_name, HeadShardedRMSNorm.from_rms_norm(getattr(attn, norm_name), tp_mesh))
