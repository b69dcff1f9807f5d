"""The parallel plan of QwenImageTransformer2DModel: `parallelize`, composing the generic `apply_*` functions,
and the joint-attention processor that sequence parallelism installs in each block.

- Tensor parallelism first (stagekit/parallel/tensor_parallel.py): each block's heads are split over the tp
  ranks (to_q/k/v and add_q/k/v_proj column-wise, to_out.0 and to_add_out row-wise), and so are img_mlp and
  txt_mlp; the per-head q/k norms apply unchanged. The attention's `heads` and `inner_dim` count the rank's heads.
- Sequence parallelism (Ulysses, Ring, or both: USP) then splits the image tokens; every rank keeps the text
  stream whole. `QwenSequenceParallelAttnProcessor` calls `joint_usp_attention` (stagekit/parallel/attention.py):
  the image Q/K/V trade the sequence split for a head split (all-to-all), the text Q/K/V narrow to the same
  heads, both attend to the text keys and to every image key block passed around the ring, merged exactly
  through their log-sum-exp with the padding masked; then the image output trades back and the text output
  all-gathers its heads.
- The split is taken where the model's own `_cp_plan` takes it (the first block's input, the image rotary table,
  `modulate_index`) and gathered at `proj_out`. Image token counts the degree does not divide are zero-padded
  and the padded keys masked, so the result stays exact.
- HSDP wraps the result (stagekit/parallel/hsdp.py, one fully_shard group per block). CFG-parallel needs no
  change to the model. With tensor parallelism or HSDP the plan is applied to the empty model and each rank
  reads only its shards (families/qwen_image/denoise.py).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel, apply_rotary_emb_qwen
from torch.distributed.device_mesh import DeviceMesh

from families.qwen_image.family import QWEN_IMAGE
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

# Which tensors carry one entry per image token, and where the whole image sequence is gathered back.
_IMAGE_PLAN = {
    "transformer_blocks.0": {
        "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
    },
    "transformer_blocks.*": {
        "modulate_index": ContextParallelInput(split_dim=1, expected_dims=2, split_output=False),
    },
    "pos_embed": {
        0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
    },
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


class QwenSequenceParallelAttnProcessor:
    """QwenDoubleStreamAttnProcessor2_0 with the image tokens split over the ring x ulysses ranks."""

    def __init__(self, state: SequenceParallelState) -> None:
        self.state = state

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError(
                "the Qwen-Image sequence-parallel processor needs the text stream and takes no attention_mask"
            )
        state = self.state
        batch_size, local_len = hidden_states.shape[:2]

        # As diffusers' processor: a fixed head_dim, the head count (the rank's, under TP) from the features.
        head_dim = attn.inner_dim // attn.heads
        img_query = attn.to_q(hidden_states).unflatten(-1, (-1, head_dim))
        img_key = attn.to_k(hidden_states).unflatten(-1, (-1, head_dim))
        img_value = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        txt_query = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_key = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        txt_value = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))

        if attn.norm_q is not None:
            img_query = attn.norm_q(img_query)
        if attn.norm_k is not None:
            img_key = attn.norm_k(img_key)
        if attn.norm_added_q is not None:
            txt_query = attn.norm_added_q(txt_query)
        if attn.norm_added_k is not None:
            txt_key = attn.norm_added_k(txt_key)

        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_query = apply_rotary_emb_qwen(img_query, img_freqs, use_real=False)
            img_key = apply_rotary_emb_qwen(img_key, img_freqs, use_real=False)
            txt_query = apply_rotary_emb_qwen(txt_query, txt_freqs, use_real=False)
            txt_key = apply_rotary_emb_qwen(txt_key, txt_freqs, use_real=False)

        image_padding = state.key_padding_mask(batch_size, local_len, hidden_states.device)
        text_padding = None
        if encoder_hidden_states_mask is not None:
            text_padding = ~encoder_hidden_states_mask.to(torch.bool)
        txt_out, img_out = joint_usp_attention(
            img_query,
            img_key,
            img_value,
            txt_query,
            txt_key,
            txt_value,
            state.ulysses_group,
            state.ring_group,
            key_padding_mask=image_padding,
            context_padding_mask=text_padding,
        )
        img_out = img_out.flatten(2, 3).to(img_query.dtype)
        txt_out = txt_out.flatten(2, 3).to(txt_query.dtype)

        img_attn_output = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_attn_output = attn.to_out[1](img_attn_output)
        txt_attn_output = attn.to_add_out(txt_out.contiguous())
        return img_attn_output, txt_attn_output


def apply_sequence_parallel(transformer: QwenImageTransformer2DModel, mesh: DeviceMesh) -> None:
    """Splits the image tokens over the mesh's ring x ulysses ranks, in place; a no-op when both are 1."""
    state = sequence_parallel_state(mesh)
    if state is None:
        return
    processor = QwenSequenceParallelAttnProcessor(state)
    install_sequence_parallel(transformer, state, _IMAGE_PLAN, _attentions(transformer), processor)


def remove_sequence_parallel(transformer: QwenImageTransformer2DModel) -> None:
    """Undoes apply_sequence_parallel: removes the hooks and restores the original processors."""
    sequence_parallel.remove_sequence_parallel(transformer, _attentions(transformer))


def _attentions(transformer: QwenImageTransformer2DModel) -> list[torch.nn.Module]:
    return [block.attn for block in transformer.transformer_blocks]


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """Applies the layout to a QwenImageTransformer2DModel in place, innermost first: TP, sequence parallel, HSDP.

    The model may still be on the meta device (then it is loaded shard by shard afterwards).
    """
    refuse_unsupported_methods(config, QWEN_IMAGE)
    if not isinstance(transformer, QwenImageTransformer2DModel):
        raise TypeError(f"expected QwenImageTransformer2DModel, not {type(transformer).__name__}")
    if config.tp_degree > 1:
        apply_tensor_parallel(transformer, mesh["tp"])
    if config.sequence_parallel:
        apply_sequence_parallel(transformer, mesh)
    if config.use_hsdp and config.hsdp_shard_size * config.hsdp_replicate_size > 1:
        apply_hsdp(transformer, build_hsdp_mesh(config, device_type_for(device)))
