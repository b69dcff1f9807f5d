"""Sequence parallelism (Ulysses, Ring, USP): the executor of a diffusers model's `_cp_plan`.

A model ships its own plan, `_cp_plan`: which submodule inputs or outputs to
split along the token sequence (ContextParallelInput) and which output to gather
back (ContextParallelOutput). diffusers' executor for it needs an accelerator and
an LSE-returning attention kernel, so we execute the same plan with plain
PyTorch module hooks (`register_plan_hooks`). Each family installs its own
attention processor that calls `usp_attention` (stagekit/parallel/attention.py)
in its `parallelize` (families/<family>/parallel.py).

Token counts the degree does not divide are padded with zeros up to a multiple
of it; the padded keys are masked out of self-attention and the padded tokens
are dropped when the output is gathered, so the result stays exact.

Sequence shard order: rank (ring r, ulysses u) holds shard r * ulysses_size + u.
The Ulysses all-to-all concatenates tokens in ulysses rank order, so each ring
rank then holds one contiguous chunk; the gather undoes the split in the same
order (over ulysses first, then over ring).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from stagekit.parallel.mesh import ParallelConfigError

_STATE_ATTRIBUTE = "_sequence_parallel_state"


@dataclass
class SequenceParallelState:
    """What the hooks and attention processors applied to one model share."""

    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    ulysses_size: int
    ring_size: int
    # This rank's sequence shard: ring_rank * ulysses_size + ulysses_rank.
    shard_index: int
    # Tokens before padding in the forward in progress; reset when the model's forward starts.
    seq_len: int | None = None
    handles: list[RemovableHandle] = field(default_factory=list)
    original_processors: dict[int, Any] = field(default_factory=dict)

    @property
    def degree(self) -> int:
        return self.ulysses_size * self.ring_size

    def key_padding_mask(self, batch_size: int, local_len: int, device: torch.device) -> torch.Tensor | None:
        """[B, local_len], True where this rank's token is padding; None when nothing was padded."""
        if self.seq_len is None:
            raise RuntimeError("sequence-parallel attention ran outside the transformer's forward")
        if self.seq_len == local_len * self.degree:
            return None
        positions = self.shard_index * local_len + torch.arange(local_len, device=device)
        return (positions >= self.seq_len).expand(batch_size, local_len)


# Splitting and gathering along the sequence.


def _split_sequence(x: torch.Tensor, split: ContextParallelInput, state: SequenceParallelState) -> torch.Tensor:
    """This rank's shard of x along split.split_dim, after zero-padding the length to a multiple of the degree."""
    if split.expected_dims is not None and x.dim() != split.expected_dims:
        # Not a per-token tensor (e.g. a per-sample timestep [B]): every rank keeps it whole.
        return x
    dim = split.split_dim % x.dim()
    seq_len = x.shape[dim]
    if state.seq_len is None:
        state.seq_len = seq_len
    elif state.seq_len != seq_len:
        raise ValueError(f"the sequence-parallel plan splits {state.seq_len} tokens and then {seq_len}")
    pad = -seq_len % state.degree
    if pad:
        pad_shape = list(x.shape)
        pad_shape[dim] = pad
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    local_len = x.shape[dim] // state.degree
    return x.narrow(dim, state.shard_index * local_len, local_len).contiguous()


def _gather_sequence(x: torch.Tensor, gather: ContextParallelOutput, state: SequenceParallelState) -> torch.Tensor:
    """The whole sequence from every rank's shard, without the padding."""
    if gather.expected_dims is not None and x.dim() != gather.expected_dims:
        return x
    dim = gather.gather_dim % x.dim()
    x = x.contiguous()
    # Inner dimension first: shard index = ring_rank * ulysses_size + ulysses_rank.
    for group, size in ((state.ulysses_group, state.ulysses_size), (state.ring_group, state.ring_size)):
        if size > 1:
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x, group=group)
            x = torch.cat(parts, dim=dim)
    return x.narrow(dim, 0, state.seq_len)


# One hook per kind of plan entry.


def reset_hook(state: SequenceParallelState) -> Callable:
    """Forward pre-hook on the model: a new forward may have another token count."""

    def hook(module: torch.nn.Module, args: tuple) -> None:
        state.seq_len = None

    return hook


def _input_split_hook(
    module: torch.nn.Module, splits: dict[str, ContextParallelInput], state: SequenceParallelState
) -> Callable:
    """Forward pre-hook (with kwargs) splitting the named inputs, passed by keyword or by position."""
    parameter_names = list(inspect.signature(module.forward).parameters)

    def hook(module: torch.nn.Module, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = list(inputs)
        for name, split in splits.items():
            if name in kwargs:
                if isinstance(kwargs[name], torch.Tensor):
                    kwargs[name] = _split_sequence(kwargs[name], split, state)
                continue
            index = parameter_names.index(name)
            if index < len(args) and isinstance(args[index], torch.Tensor):
                args[index] = _split_sequence(args[index], split, state)
        return tuple(args), kwargs

    return hook


def _output_split_hook(splits: dict[int, ContextParallelInput], state: SequenceParallelState) -> Callable:
    """Forward hook splitting the module's outputs by index (split_output=True, e.g. the rotary freqs)."""

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return _split_sequence(output, splits[0], state) if 0 in splits else output
        outputs = list(output)
        for index, split in splits.items():
            outputs[index] = _split_sequence(outputs[index], split, state)
        return type(output)(outputs)

    return hook


def _output_gather_hook(gathers: list[ContextParallelOutput | None], state: SequenceParallelState) -> Callable:
    """Forward hook gathering the module's outputs back into the whole sequence."""

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return _gather_sequence(output, gathers[0], state)
        return type(output)(
            x if gather is None else _gather_sequence(x, gather, state)
            for x, gather in zip(output, gathers, strict=True)
        )

    return hook


def _plan_modules(model: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    """The submodules one plan entry names: "" is the model, "blocks.*" every child of `blocks`."""
    if name.endswith(".*"):
        return list(model.get_submodule(name[:-2]).children())
    return [model.get_submodule(name)]


def register_plan_hooks(model: torch.nn.Module, plan: dict[str, Any], state: SequenceParallelState) -> None:
    for name, entry in plan.items():
        for module in _plan_modules(model, name):
            if isinstance(entry, dict):
                input_splits = {k: v for k, v in entry.items() if not v.split_output}
                output_splits = {k: v for k, v in entry.items() if v.split_output}
                if input_splits:
                    hook = _input_split_hook(module, input_splits, state)
                    state.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
                if output_splits:
                    state.handles.append(module.register_forward_hook(_output_split_hook(output_splits, state)))
            else:
                gathers = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)
                state.handles.append(module.register_forward_hook(_output_gather_hook(gathers, state)))


# Installing a family's plan and attention processor on a model, and removing them.


def sequence_parallel_state(mesh: DeviceMesh) -> SequenceParallelState | None:
    """The state of this rank's split over the mesh's ring x ulysses ranks; None when both degrees are 1."""
    ulysses_mesh, ring_mesh = mesh["ulysses"], mesh["ring"]
    ulysses_size, ring_size = ulysses_mesh.size(), ring_mesh.size()
    if ulysses_size * ring_size == 1:
        return None
    ulysses_group, ring_group = ulysses_mesh.get_group(), ring_mesh.get_group()
    return SequenceParallelState(
        ulysses_group=ulysses_group,
        ring_group=ring_group,
        ulysses_size=ulysses_size,
        ring_size=ring_size,
        shard_index=dist.get_rank(ring_group) * ulysses_size + dist.get_rank(ulysses_group),
    )


def install_sequence_parallel(
    transformer: torch.nn.Module,
    state: SequenceParallelState,
    plan: dict[str, Any],
    attentions: list[torch.nn.Module],
    processor: Any,
) -> None:
    """Registers the plan's split and gather hooks and sets `processor` on every attention module, in place.

    Every rank must call it (and then the model) with the same inputs: each takes its shard locally.
    """
    if hasattr(transformer, _STATE_ATTRIBUTE):
        raise RuntimeError("sequence parallelism is already applied to this model")
    for attention in attentions:
        if attention.heads % state.ulysses_size != 0:
            raise ParallelConfigError(
                f"--ulysses-degree {state.ulysses_size} must divide the {attention.heads} attention heads per rank"
            )
    # Registered before the plan's hooks on the model itself, so it runs first.
    state.handles.append(transformer.register_forward_pre_hook(reset_hook(state)))
    register_plan_hooks(transformer, plan, state)
    for index, attention in enumerate(attentions):
        state.original_processors[index] = attention.processor
        attention.set_processor(processor)
    setattr(transformer, _STATE_ATTRIBUTE, state)


def remove_sequence_parallel(transformer: torch.nn.Module, attentions: list[torch.nn.Module]) -> None:
    """Undoes install_sequence_parallel: removes the hooks and restores the original processors."""
    state = getattr(transformer, _STATE_ATTRIBUTE, None)
    if state is None:
        return
    for handle in state.handles:
        handle.remove()
    for index, processor in state.original_processors.items():
        attentions[index].set_processor(processor)
    delattr(transformer, _STATE_ATTRIBUTE)
