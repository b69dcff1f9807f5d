"""The parallel plan of WanTransformer3DModel: `parallelize`, composing the generic `apply_*` functions, and
the self-attention processor that sequence parallelism installs in each block.

Sequence parallelism executes the model's own `_cp_plan` (stagekit/parallel/sequence_parallel.py) and
replaces each block's self-attention with `WanSequenceParallelAttnProcessor`, which calls `usp_attention`.
Cross-attention to the text stays whole: each rank's queries attend to every text token.

Tensor parallelism goes first, since it changes each attention's local head count and norms, which the
sequence-parallel attention then builds on; HSDP wraps the result, sharding whatever parameters each rank
still holds whole. CFG-parallel needs no change to the model: the denoising loop runs one branch per CFG
rank group (stagekit/denoise.py `guidance_predictions`).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_wan import WanAttention, WanTransformer3DModel, _get_qkv_projections
from torch.distributed.device_mesh import DeviceMesh

from stagekit.parallel import sequence_parallel
from stagekit.parallel.attention import usp_attention
from stagekit.parallel.hsdp import apply_hsdp
from stagekit.parallel.mesh import ParallelConfig, build_hsdp_mesh, device_type_for
from stagekit.parallel.sequence_parallel import (
    SequenceParallelState,
    install_sequence_parallel,
    sequence_parallel_state,
)
from stagekit.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """Applies the layout to a WanTransformer3DModel in place, innermost first."""
    if config.tp_degree > 1:
        apply_tensor_parallel(transformer, mesh["tp"])
    if config.sequence_parallel:
        apply_sequence_parallel(transformer, mesh)
    if config.use_hsdp and config.hsdp_shard_size * config.hsdp_replicate_size > 1:
        apply_hsdp(transformer, build_hsdp_mesh(config, device_type_for(device)))


def _apply_rotary_emb(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    # Same as the function inside WanAttnProcessor.__call__.
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


class WanSequenceParallelAttnProcessor:
    """WanAttnProcessor's self-attention step by step, with usp_attention instead of dispatch_attention_fn.

    Heads come from `attn.heads` and the norms from `attn.norm_q/norm_k`, so a model whose attention
    tensor parallelism already narrowed to its local heads works unchanged.
    """

    def __init__(self, state: SequenceParallelState) -> None:
        self.state = state

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the sequence-parallel processor handles self-attention without a mask only")

        query, key, value = _get_qkv_projections(attn, hidden_states, None)

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        if rotary_emb is not None:
            query = _apply_rotary_emb(query, *rotary_emb)
            key = _apply_rotary_emb(key, *rotary_emb)

        batch_size, local_len = hidden_states.shape[:2]
        key_padding_mask = self.state.key_padding_mask(batch_size, local_len, hidden_states.device)
        hidden_states = usp_attention(
            query, key, value, self.state.ulysses_group, self.state.ring_group, key_padding_mask
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.type_as(query)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


def apply_sequence_parallel(transformer: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Splits the token sequence over the mesh's ring x ulysses ranks, in place; a no-op when both are 1."""
    state = sequence_parallel_state(mesh)
    if state is None:
        return
    if not isinstance(transformer, WanTransformer3DModel):
        raise TypeError(f"sequence parallelism supports WanTransformer3DModel, not {type(transformer).__name__}")
    processor = WanSequenceParallelAttnProcessor(state)
    install_sequence_parallel(transformer, state, transformer._cp_plan, _self_attentions(transformer), processor)


def remove_sequence_parallel(transformer: torch.nn.Module) -> None:
    """Undoes apply_sequence_parallel: removes the hooks and restores the original processors."""
    sequence_parallel.remove_sequence_parallel(transformer, _self_attentions(transformer))


def _self_attentions(transformer: WanTransformer3DModel) -> list[WanAttention]:
    return [block.attn1 for block in transformer.blocks]
