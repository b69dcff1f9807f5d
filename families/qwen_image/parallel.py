"""The parallel plan of QwenImageTransformer2DModel: `parallelize`, and the Ulysses sequence parallelism it
applies (the family runs Ulysses and CFG-parallel; families/qwen_image/family.py says why not the others).

Qwen-Image's blocks attend jointly over [text, image] tokens. Only the image
tokens are split across the Ulysses ranks; every rank keeps the text stream
whole and computes it identically. Per block:

- the image Q/K/V (rank's shard of the tokens, all heads) trade the sequence
  split for a head split with one all-to-all, as in Ulysses attention;
- the text Q/K/V are narrowed to the same head group;
- attention runs over [text, every image token] with the rank's heads, the
  text padding (encoder_hidden_states_mask) and the image padding masked out;
- the image output trades back (all-to-all) and the text output gathers its
  heads from every rank (all-gather), so each rank again holds its image shard
  and the whole text stream.

The split is taken where the model's own `_cp_plan` takes it (the input of the
first block, the image rotary table from `pos_embed`, the per-token
`modulate_index`) and gathered at `proj_out`; the text inputs stay whole. Image
token counts the degree does not divide are zero-padded to a multiple of it and
the padded keys are masked, so the result stays exact. Ring attention is not
implemented for this model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel, apply_rotary_emb_qwen
from torch.distributed.device_mesh import DeviceMesh

from dit_svc.parallel.attention import heads_to_ranks, ranks_to_heads
from dit_svc.parallel.mesh import ParallelConfig, ParallelConfigError, refuse_unsupported_methods
from dit_svc.parallel.sequence_parallel import (
    SequenceParallelState,
    install_sequence_parallel,
    remove_sequence_parallel,
    sequence_parallel_state,
)
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


class QwenUlyssesAttnProcessor:
    """QwenDoubleStreamAttnProcessor2_0 with the image tokens split over the Ulysses group."""

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
            raise ValueError("the Qwen-Image Ulysses processor needs the text stream and takes no attention_mask")
        state = self.state
        group = state.ulysses_group
        size = state.ulysses_size
        if state.seq_len is None:
            raise RuntimeError("sequence-parallel attention ran outside the transformer's forward")
        batch_size, local_len = hidden_states.shape[:2]
        seq_txt = encoder_hidden_states.shape[1]

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

        # Image: rank's tokens of every head -> every token of rank's heads. Text: rank's heads.
        img_query, img_key, img_value = heads_to_ranks([img_query, img_key, img_value], group)
        num_heads = txt_query.shape[2]
        local_heads = num_heads // size
        rank = dist.get_rank(group)
        txt_query, txt_key, txt_value = (
            x.narrow(2, rank * local_heads, local_heads) for x in (txt_query, txt_key, txt_value)
        )
        joint_query = torch.cat([txt_query, img_query], dim=1)
        joint_key = torch.cat([txt_key, img_key], dim=1)
        joint_value = torch.cat([txt_value, img_value], dim=1)

        # Boolean mask (True = attend) over [text, padded image], as the original processor builds it.
        padded_len = size * local_len
        attn_mask = None
        if encoder_hidden_states_mask is not None or padded_len != state.seq_len:
            device = hidden_states.device
            image_keep = (torch.arange(padded_len, device=device) < state.seq_len).expand(batch_size, padded_len)
            text_keep = (
                encoder_hidden_states_mask.to(torch.bool)
                if encoder_hidden_states_mask is not None
                else torch.ones(batch_size, seq_txt, dtype=torch.bool, device=device)
            )
            attn_mask = torch.cat([text_keep, image_keep], dim=1)[:, None, None, :]

        out = F.scaled_dot_product_attention(
            joint_query.transpose(1, 2),
            joint_key.transpose(1, 2),
            joint_value.transpose(1, 2),
            attn_mask=attn_mask,
            dropout_p=0.0,
            is_causal=False,
        ).transpose(1, 2)
        out = out.to(joint_query.dtype)

        txt_out = out[:, :seq_txt].contiguous()
        parts = [torch.empty_like(txt_out) for _ in range(size)]
        dist.all_gather(parts, txt_out, group=group)
        txt_out = torch.cat(parts, dim=2)
        img_out = ranks_to_heads(out[:, seq_txt:], group)

        img_attn_output = attn.to_out[0](img_out.flatten(2, 3).contiguous())
        if len(attn.to_out) > 1:
            img_attn_output = attn.to_out[1](img_attn_output)
        txt_attn_output = attn.to_add_out(txt_out.flatten(2, 3).contiguous())
        return img_attn_output, txt_attn_output


def apply_qwen_ulysses(transformer: QwenImageTransformer2DModel, mesh: DeviceMesh) -> None:
    """Splits the image tokens over the mesh's Ulysses ranks, in place; a no-op at degree 1."""
    if mesh["ring"].size() > 1:
        raise ParallelConfigError("the qwen-image family runs Ulysses sequence parallelism only, not --ring-degree")
    state = sequence_parallel_state(mesh)
    if state is None:
        return
    if not isinstance(transformer, QwenImageTransformer2DModel):
        raise TypeError(f"expected QwenImageTransformer2DModel, not {type(transformer).__name__}")
    processor = QwenUlyssesAttnProcessor(state)
    install_sequence_parallel(transformer, state, _IMAGE_PLAN, _attentions(transformer), processor)


def remove_qwen_ulysses(transformer: QwenImageTransformer2DModel) -> None:
    """Undoes apply_qwen_ulysses: removes the hooks and restores the original processors."""
    remove_sequence_parallel(transformer, _attentions(transformer))


def _attentions(transformer: QwenImageTransformer2DModel) -> list[torch.nn.Module]:
    return [block.attn for block in transformer.transformer_blocks]


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """Applies the layout to a QwenImageTransformer2DModel in place: Ulysses over the image tokens."""
    refuse_unsupported_methods(config, QWEN_IMAGE)
    if config.sequence_parallel:
        apply_qwen_ulysses(transformer, mesh)
