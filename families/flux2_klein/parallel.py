"""The parallel plan of Flux2Transformer2DModel: `parallelize`, composing the generic `apply_*` functions, and the
attention processor that sequence parallelism installs in every block.

FLUX.2's transformer is FLUX.1's shape (double-stream blocks, then single-stream blocks over [text; image]), so
the plan is FLUX.1's (families/flux/parallel.py), and so is most of the code:
- Sequence parallelism (Ulysses, Ring, or both) splits the image tokens and keeps the text whole on every rank;
  the split is taken at the transformer's input (`hidden_states` and their position ids `img_ids`, here
  [1, N, 4], so the rotary table the model builds is [text; this rank's image tokens]) and gathered at
  `norm_out`, before the output projection (an adapter on `proj_out` then sees the whole sequence). Token
  counts the degree does not divide are zero-padded and the padded keys masked.
- The double-stream blocks' Flux2Attention has FLUX.1's projections and norms by name, and applies the rotary
  table position by position as FLUX.1 does: FLUX.1's processor serves them unchanged.
- The single-stream blocks differ: Flux2ParallelSelfAttention makes Q, K, V and the MLP input in one projection
  (`to_qkv_mlp_proj`) and projects the attention and MLP outputs together (`to_out`). The processor below adds
  that path, attending as FLUX.1's single-stream path does (the sequence split at the text length, which a
  pre-hook on the transformer records).
- Tensor parallelism splits the heads and both kinds of feed-forward, the fused projections stream by stream
  (stagekit/parallel/tensor_parallel.py's plan for Flux2Transformer2DModel); the processors split the fused
  output by the local widths, which the plan narrows.
- HSDP wraps the result (stagekit/parallel/hsdp.py, one fully_shard group per block of `_repeated_blocks`); with
  HSDP the plan is applied to the empty model and each rank reads only its shards (denoise.py). CFG-parallel
  needs no change to the model.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttention, Flux2Transformer2DModel
from torch.distributed.device_mesh import DeviceMesh

from families.flux.parallel import FluxSequenceParallelAttnProcessor
from families.flux2_klein.family import FLUX2_KLEIN
from stagekit.parallel import sequence_parallel
from stagekit.parallel.attention import joint_usp_attention
from stagekit.parallel.hsdp import apply_hsdp
from stagekit.parallel.mesh import ParallelConfig, build_hsdp_mesh, device_type_for, refuse_unsupported_methods
from stagekit.parallel.sequence_parallel import install_sequence_parallel, sequence_parallel_state
from stagekit.parallel.tensor_parallel import apply_tensor_parallel

# Which inputs carry one entry per image token (ids [1, N, 4], as the pipeline passes them), and where the whole
# image sequence is gathered back.
_IMAGE_PLAN = {
    "": {
        "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        "img_ids": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
    },
    # Before the output projection rather than after it, so that an adapter on `proj_out` sees the whole sequence.
    "norm_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


class Flux2SequenceParallelAttnProcessor(FluxSequenceParallelAttnProcessor):
    """FLUX.1's sequence-parallel processor for the double-stream blocks, and the fused single-stream path."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # Flux2ParallelSelfAttention calls its processor with (hidden_states, attention_mask, image_rotary_emb).
        if isinstance(attn, Flux2ParallelSelfAttention):
            return self.single_stream(attn, hidden_states, *args, **kwargs)
        return super().__call__(attn, hidden_states, *args, **kwargs)

    def single_stream(
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[text; image shard] in, the block's attention-and-MLP output for the same tokens out."""
        if attention_mask is not None:
            raise ValueError("the FLUX.2 sequence-parallel processor takes no attention_mask")
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = projected.split([3 * attn.inner_dim, projected.shape[-1] - 3 * attn.inner_dim], dim=-1)
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in qkv.chunk(3, dim=-1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text = self.text_tokens
        batch_size, local_len = query.shape[0], query.shape[1] - text
        text_out, image_out = joint_usp_attention(
            query[:, text:],
            key[:, text:],
            value[:, text:],
            query[:, :text],
            key[:, :text],
            value[:, :text],
            self.state.ulysses_group,
            self.state.ring_group,
            key_padding_mask=self.state.key_padding_mask(batch_size, local_len, query.device),
        )
        attention = torch.cat([text_out, image_out], dim=1).flatten(2, 3).to(query.dtype)
        return attn.to_out(torch.cat([attention, attn.mlp_act_fn(mlp)], dim=-1))


def apply_sequence_parallel(transformer: Flux2Transformer2DModel, mesh: DeviceMesh) -> None:
    """Splits the image tokens over the mesh's ring x ulysses ranks, in place; a no-op when both are 1."""
    state = sequence_parallel_state(mesh)
    if state is None:
        return
    processor = Flux2SequenceParallelAttnProcessor(state)
    install_sequence_parallel(transformer, state, _IMAGE_PLAN, _attentions(transformer), processor)
    state.handles.append(transformer.register_forward_pre_hook(processor.record_text_tokens, with_kwargs=True))


def remove_sequence_parallel(transformer: Flux2Transformer2DModel) -> None:
    """Undoes apply_sequence_parallel: removes the hooks and restores the original processors."""
    sequence_parallel.remove_sequence_parallel(transformer, _attentions(transformer))


def _attentions(transformer: Flux2Transformer2DModel) -> list[torch.nn.Module]:
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    return [block.attn for block in blocks]


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """Applies the layout to a Flux2Transformer2DModel in place, innermost first: TP, sequence parallel, HSDP.

    The model may still be on the meta device (then it is loaded shard by shard afterwards).
    """
    refuse_unsupported_methods(config, FLUX2_KLEIN)
    if not isinstance(transformer, Flux2Transformer2DModel):
        raise TypeError(f"expected Flux2Transformer2DModel, not {type(transformer).__name__}")
    if config.tp_degree > 1:
        apply_tensor_parallel(transformer, mesh["tp"])
    if config.sequence_parallel:
        apply_sequence_parallel(transformer, mesh)
    if config.use_hsdp and config.hsdp_shard_size * config.hsdp_replicate_size > 1:
        apply_hsdp(transformer, build_hsdp_mesh(config, device_type_for(device)))
