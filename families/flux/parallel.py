"""The parallel plan of FluxTransformer2DModel: `parallelize`, composing the generic `apply_*` functions, and the
attention processor that sequence parallelism installs in every block.

- Tensor parallelism first (stagekit/parallel/tensor_parallel.py): the double-stream blocks split as Qwen-Image's
  (Q/K/V and the added projections column-wise, to_out.0 and to_add_out row-wise, ff and ff_context); the
  single-stream blocks split Q/K/V and proj_mlp column-wise, and their proj_out, which takes cat([attention output,
  MLP output]), keeps each rank's columns of both halves (a packed row-wise split).
- Sequence parallelism (Ulysses, Ring, or both: USP) splits the image tokens; every rank keeps the text stream
  whole (512 T5 tokens beside 4,096 image tokens at 1024x1024: an eighth more work on each rank, for joint
  attention that needs no mask and no split text). diffusers' own `_cp_plan` for FLUX splits the text too,
  which needs the text length divisible by the degree and each rank's text rotary positions; keeping it whole
  is what Qwen-Image does here, and the same kernel (`joint_usp_attention`) serves both.
- The split is taken at the transformer's input (`hidden_states` and their position ids `img_ids`, so the rotary
  table the model builds is already [text; this rank's image tokens]) and gathered at `norm_out`, before the
  final `proj_out`: a LoRA adapter may wrap that linear, and PEFT's wrapper would add its product on this rank's
  tokens to a base output already gathered. Image token counts the degree does not divide are zero-padded and
  the padded keys masked, so the result stays exact.
- The double-stream blocks attend as Qwen-Image's: image Q/K/V trade the sequence split for a head split
  (all-to-all), the text Q/K/V narrow to the same heads, both attend to the text keys and every image key block
  passed around the ring. The single-stream blocks run one sequence [text; image shard]: the processor splits it
  at the text length (recorded by a pre-hook on the transformer) and attends the same way.
- HSDP wraps the result (stagekit/parallel/hsdp.py, one fully_shard group per double and single block).
  CFG-parallel needs no change to the model. With HSDP the plan is applied to the empty model and each rank reads
  only its shards (families/flux/denoise.py).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel, _get_qkv_projections
from torch.distributed.device_mesh import DeviceMesh

from families.flux.family import FLUX
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

# Which inputs carry one entry per image token, and where the whole image sequence is gathered back.
_IMAGE_PLAN = {
    "": {
        "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        "img_ids": ContextParallelInput(split_dim=0, expected_dims=2, split_output=False),
    },
    "norm_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


class FluxSequenceParallelAttnProcessor:
    """FluxAttnProcessor with the image tokens split over the ring x ulysses ranks, for both kinds of block."""

    def __init__(self, state: SequenceParallelState) -> None:
        self.state = state
        # The text's token count in the forward in progress (set by the transformer's pre-hook).
        self.text_tokens = 0

    def record_text_tokens(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self.text_tokens = kwargs["encoder_hidden_states"].shape[1]

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise ValueError("the FLUX sequence-parallel processor takes no attention_mask")
        single_stream = encoder_hidden_states is None
        query, key, value, text_query, text_key, text_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if single_stream:
            if image_rotary_emb is not None:
                query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
                key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
            text = self.text_tokens
            text_query, text_key, text_value = query[:, :text], key[:, :text], value[:, :text]
            query, key, value = query[:, text:], key[:, text:], value[:, text:]
        else:
            text_query, text_key, text_value = (
                x.unflatten(-1, (-1, attn.head_dim)) for x in (text_query, text_key, text_value)
            )
            text_query, text_key = attn.norm_added_q(text_query), attn.norm_added_k(text_key)
            if image_rotary_emb is not None:
                text = text_query.shape[1]
                text_freqs = tuple(freqs[:text] for freqs in image_rotary_emb)
                image_freqs = tuple(freqs[text:] for freqs in image_rotary_emb)
                text_query = apply_rotary_emb(text_query, text_freqs, sequence_dim=1)
                text_key = apply_rotary_emb(text_key, text_freqs, sequence_dim=1)
                query = apply_rotary_emb(query, image_freqs, sequence_dim=1)
                key = apply_rotary_emb(key, image_freqs, sequence_dim=1)

        batch_size, local_len = query.shape[:2]
        text_out, image_out = joint_usp_attention(
            query,
            key,
            value,
            text_query,
            text_key,
            text_value,
            self.state.ulysses_group,
            self.state.ring_group,
            key_padding_mask=self.state.key_padding_mask(batch_size, local_len, query.device),
        )
        text_out = text_out.flatten(2, 3).to(query.dtype)
        image_out = image_out.flatten(2, 3).to(query.dtype)
        if single_stream:
            return torch.cat([text_out, image_out], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


def apply_sequence_parallel(transformer: FluxTransformer2DModel, mesh: DeviceMesh) -> None:
    """Splits the image tokens over the mesh's ring x ulysses ranks, in place; a no-op when both are 1."""
    state = sequence_parallel_state(mesh)
    if state is None:
        return
    processor = FluxSequenceParallelAttnProcessor(state)
    install_sequence_parallel(transformer, state, _IMAGE_PLAN, _attentions(transformer), processor)
    state.handles.append(transformer.register_forward_pre_hook(processor.record_text_tokens, with_kwargs=True))


def remove_sequence_parallel(transformer: FluxTransformer2DModel) -> None:
    """Undoes apply_sequence_parallel: removes the hooks and restores the original processors."""
    sequence_parallel.remove_sequence_parallel(transformer, _attentions(transformer))


def _attentions(transformer: FluxTransformer2DModel) -> list[torch.nn.Module]:
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    return [block.attn for block in blocks]


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """Applies the layout to a FluxTransformer2DModel in place, innermost first: TP, sequence parallel, HSDP.

    The model may still be on the meta device (then it is loaded shard by shard afterwards).
    """
    refuse_unsupported_methods(config, FLUX)
    if not isinstance(transformer, FluxTransformer2DModel):
        raise TypeError(f"expected FluxTransformer2DModel, not {type(transformer).__name__}")
    if config.tp_degree > 1:
        apply_tensor_parallel(transformer, mesh["tp"])
    if config.sequence_parallel:
        apply_sequence_parallel(transformer, mesh)
    if config.use_hsdp and config.hsdp_shard_size * config.hsdp_replicate_size > 1:
        apply_hsdp(transformer, build_hsdp_mesh(config, device_type_for(device)))
