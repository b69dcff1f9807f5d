"""The parallel plan of HunyuanVideo15Transformer3DModel: `parallelize`, composing the generic `apply_*` functions,
and the joint-attention processor that sequence parallelism installs in each block.

The model's 54 dual-stream blocks are FLUX.1's double-stream kind: image and text streams with their own
projections, attending jointly over [image tokens, text tokens] where the text is Qwen2.5-VL's, ByT5's and the
image embedding's tokens, reordered by the model (real ones first) and masked.

- Tensor parallelism first (stagekit/parallel/tensor_parallel.py's plan for the class): each block's heads are
  split over the tp ranks (to_q/k/v and add_q/k/v_proj column-wise, to_out.0 and to_add_out row-wise), and so are
  ff and ff_context; the per-head q/k norms apply unchanged. The token refiner, the embedders and the output
  projection stay whole.
- Sequence parallelism (Ulysses, Ring, or both: USP) then splits the video tokens; every rank keeps the text
  stream whole. `HunyuanVideo15SequenceParallelAttnProcessor` calls `joint_usp_attention`: the video Q/K/V trade
  the sequence split for a head split (all-to-all), the text Q/K/V narrow to the same heads, and both attend to the
  text keys (the model's mask of padded text positions kept) and to every video key block passed around the ring;
  then the video output trades back and the text output all-gathers its heads.
- The split is taken at the first block's input and at the rotary table (the rope module's output), and gathered
  at `proj_out`. Token counts the degree does not divide are zero-padded and the padded keys masked.
- HSDP wraps the result (one fully_shard group per block). CFG-parallel needs no change to the model.

One difference from the library's processor, which changes no real output: a masked text position's own query
attends to every real key here, where the library's mask gives it no key (and a zero output). Such a position's
result is never read: no real token attends to it and the model's output is the video tokens'.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15Transformer3DModel
from torch.distributed.device_mesh import DeviceMesh

from families.hunyuanvideo_15.family import HUNYUANVIDEO_15
from stagekit.parallel import sequence_parallel
from stagekit.parallel.attention import joint_usp_attention
from stagekit.parallel.hsdp import apply_hsdp
from stagekit.parallel.mesh import ParallelConfig, build_hsdp_mesh, device_type_for, refuse_unsupported_methods
from stagekit.parallel.sequence_parallel import (
    SequenceParallelState,
    install_sequence_parallel,
    sequence_parallel_state,
)
from stagekit.parallel.tensor_parallel import apply_tensor_parallel

# Which tensors carry one entry per video token, and where the whole video sequence is gathered back.
_VIDEO_PLAN = {
    "transformer_blocks.0": {
        "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
    },
    "rope": {
        0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
        1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
    },
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


class HunyuanVideo15SequenceParallelAttnProcessor:
    """HunyuanVideo15AttnProcessor2_0 with the video tokens split over the ring x ulysses ranks."""

    def __init__(self, state: SequenceParallelState) -> None:
        self.state = state

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise ValueError("the HunyuanVideo 1.5 sequence-parallel processor needs the text stream")
        state = self.state
        batch_size, local_len = hidden_states.shape[:2]

        # As the library's processor: the head count (the rank's, under TP) from attn.heads.
        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_query = heads(attn.add_q_proj(encoder_hidden_states))
        text_key = heads(attn.add_k_proj(encoder_hidden_states))
        text_value = heads(attn.add_v_proj(encoder_hidden_states))
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)

        text_padding = None if attention_mask is None else ~attention_mask.to(torch.bool)
        text_out, video_out = joint_usp_attention(
            query,
            key,
            value,
            text_query,
            text_key,
            text_value,
            state.ulysses_group,
            state.ring_group,
            key_padding_mask=state.key_padding_mask(batch_size, local_len, hidden_states.device),
            context_padding_mask=text_padding,
        )
        video_out = attn.to_out[1](attn.to_out[0](video_out.flatten(2, 3).to(query.dtype).contiguous()))
        text_out = attn.to_add_out(text_out.flatten(2, 3).to(query.dtype).contiguous())
        return video_out, text_out


def apply_sequence_parallel(transformer: HunyuanVideo15Transformer3DModel, mesh: DeviceMesh) -> None:
    """Splits the video tokens over the mesh's ring x ulysses ranks, in place; a no-op when both are 1."""
    state = sequence_parallel_state(mesh)
    if state is None:
        return
    processor = HunyuanVideo15SequenceParallelAttnProcessor(state)
    install_sequence_parallel(transformer, state, _VIDEO_PLAN, _attentions(transformer), processor)


def remove_sequence_parallel(transformer: HunyuanVideo15Transformer3DModel) -> None:
    """Undoes apply_sequence_parallel: removes the hooks and restores the original processors."""
    sequence_parallel.remove_sequence_parallel(transformer, _attentions(transformer))


def _attentions(transformer: HunyuanVideo15Transformer3DModel) -> list[torch.nn.Module]:
    return [block.attn for block in transformer.transformer_blocks]


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """Applies the layout to a HunyuanVideo15Transformer3DModel in place, innermost first: TP, sequence parallel,
    HSDP. The model may still be on the meta device (then it is loaded shard by shard afterwards)."""
    refuse_unsupported_methods(config, HUNYUANVIDEO_15)
    if not isinstance(transformer, HunyuanVideo15Transformer3DModel):
        raise TypeError(f"expected HunyuanVideo15Transformer3DModel, not {type(transformer).__name__}")
    if config.tp_degree > 1:
        apply_tensor_parallel(transformer, mesh["tp"])
    if config.sequence_parallel:
        apply_sequence_parallel(transformer, mesh)
    if config.use_hsdp and config.hsdp_shard_size * config.hsdp_replicate_size > 1:
        apply_hsdp(transformer, build_hsdp_mesh(config, device_type_for(device)))
