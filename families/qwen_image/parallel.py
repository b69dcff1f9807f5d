"""The parallel plan of QwenImageTransformer2DModel: `parallelize`, composing the generic `apply_*` functions,
and the joint-attention processor that sequence parallelism installs in each block.

Tensor parallelism goes first (dit_svc/parallel/tensor_parallel.py, the Qwen-Image plan): each block's
heads are split over the tp ranks (to_q/k/v and add_q/k/v_proj column-wise, to_out.0 and to_add_out
row-wise), and so are img_mlp and txt_mlp; the q/k norms normalise each head alone, so a rank applies
them to its own heads unchanged. The attention's `heads` and `inner_dim` count the rank's heads, which
the processors below (and diffusers' own) read.

Sequence parallelism (Ulysses, Ring, or both: USP) then splits the image tokens over the ring x ulysses
ranks; every rank keeps the text stream whole and computes it. Qwen-Image's blocks attend jointly over
[text, image] tokens; per block, `QwenSequenceParallelAttnProcessor` calls `joint_usp_attention`
(dit_svc/parallel/attention.py):

- the image Q/K/V (rank's shard of the tokens, its heads) trade the sequence split for a head split
  with one all-to-all over the Ulysses group; the text Q/K/V are narrowed to the same head group;
- the text queries and the image queries attend to the text keys (local) and to every image key
  block, passed around the ring; the partial results are merged exactly through their log-sum-exp,
  with the text padding (encoder_hidden_states_mask) and the image padding masked out;
- the image output trades back (all-to-all) and the text output gathers its heads from every Ulysses
  rank (all-gather), so each rank again holds its image shard and the whole text stream.

The split is taken where the model's own `_cp_plan` takes it (the input of the first block, the image
rotary table from `pos_embed`, the per-token `modulate_index`) and gathered at `proj_out`; the text
inputs stay whole. Image token counts the degree does not divide are zero-padded to a multiple of it
and the padded keys are masked, so the result stays exact.

HSDP wraps the result (dit_svc/parallel/hsdp.py: one fully_shard group per QwenImageTransformerBlock),
sharding whatever parameters each rank still holds whole. CFG-parallel needs no change to the model:
the denoising loop runs one branch per CFG rank group. With tensor parallelism or HSDP the plan is
applied to the empty model and each rank reads only its shards (families/qwen_image/denoise.py).
"""

from __future__ import annotations

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel, apply_rotary_emb_qwen
from torch.distributed.device_mesh import DeviceMesh

from dit_svc.parallel import sequence_parallel
from dit_svc.parallel.attention import joint_usp_attention
from dit_svc.parallel.hsdp import apply_hsdp
from dit_svc.parallel.mesh import ParallelConfig, build_hsdp_mesh, device_type_for, refuse_unsupported_methods
from dit_svc.parallel.sequence_parallel import SequenceParallelState, install_sequence_parallel, sequence_parallel_state
from dit_svc.parallel.tensor_parallel import apply_tensor_parallel
from families.qwen_image.family import QWEN_IMAGE

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
        attn,
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
