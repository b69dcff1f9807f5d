"""The parallel plan of ZImageTransformer2DModel: `parallelize`, composing the generic `apply_*` functions, and the
attention processor that sequence parallelism installs in its blocks.

The model is a single-stream DiT. Before its main `layers`, two kinds of refiner run apart: the noise refiner
over the image tokens and the context refiner over the caption's; the main layers then run one joint sequence
[image; caption], every token through the same weights and the same timestep modulation, attending to every
other. How sequence parallelism (Ulysses, Ring, or both: USP) splits it:

- The main layers split the joint sequence itself, evenly, without telling image and caption tokens apart.
  Nothing in those blocks treats the two differently, so a plain split balances the work exactly and needs only
  `usp_attention` over one sequence; keeping the caption whole on every rank (as the dual-stream FLUX and
  Qwen-Image plans do, where the text has its own weights) would repeat up to 512 caption tokens on each rank
  for nothing. The tokens `x` are split at the first main layer's input and their rotary table `freqs_cis` at
  every layer's (the model passes it whole to each), and gathered at the last layer's output, so the final layer
  and unpatchify see the whole sequence.
- The noise refiner splits the image tokens the same way, on a state of its own (it runs over another
  sequence length in the same forward), and gathers them before the joint sequence is built.
- The context refiner runs whole on every rank: a few hundred caption tokens through two blocks.

The model pads the image and the caption to multiples of 32 tokens itself, so the degrees that divide 32 never
pad; any other degree zero-pads the split and masks the padded keys, so the result stays exact. Tensor
parallelism splits every block's heads and SwiGLU feed-forward (stagekit/parallel/tensor_parallel.py's plan for
ZImageTransformer2DModel) before the sequence split is installed. HSDP wraps the result
(stagekit/parallel/hsdp.py, one fully_shard group per block of `_repeated_blocks`, refiners included).
CFG-parallel needs no change to the model. With TP or HSDP the plan is applied to the empty model and each rank
reads only its shards (families/z_image/denoise.py).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
from torch.distributed.device_mesh import DeviceMesh

from families.z_image.family import Z_IMAGE
from stagekit.parallel import sequence_parallel
from stagekit.parallel.attention import usp_attention
from stagekit.parallel.hsdp import apply_hsdp
from stagekit.parallel.mesh import ParallelConfig, build_hsdp_mesh, device_type_for, refuse_unsupported_methods
from stagekit.parallel.sequence_parallel import (
    SequenceParallelState,
    install_sequence_parallel,
    register_plan_hooks,
    reset_hook,
    sequence_parallel_state,
)
from stagekit.parallel.tensor_parallel import apply_tensor_parallel

# A block's per-token inputs: its tokens [B, L, dim], split where the first block takes them (the next blocks get
# the previous one's shard), and their rotary table [B, L, head_dim / 2] (complex), which the model passes whole
# to every block.
_TOKENS = {"x": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)}
_ROTARY = {"freqs_cis": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)}
_GATHER = ContextParallelOutput(gather_dim=1, expected_dims=3)


def _plan(blocks: str) -> dict[str, Any]:
    """The splits of the ModuleList `blocks` (its gather is registered apart, on its last block's output, which may
    be the first block too)."""
    return {f"{blocks}.0": _TOKENS, f"{blocks}.*": _ROTARY}


def apply_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, D] rotated by freqs_cis [B, L, D / 2] (complex), in float32, as ZSingleStreamAttnProcessor."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)


class ZImageSequenceParallelAttnProcessor:
    """ZSingleStreamAttnProcessor over a sequence split across the ring x ulysses ranks (and a batch's mask of its
    shorter sequences, split with it)."""

    def __init__(self, state: SequenceParallelState) -> None:
        self.state = state

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query, key, value = (
            projection(hidden_states).unflatten(-1, (attn.heads, -1))
            for projection in (attn.to_q, attn.to_k, attn.to_v)
        )
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if freqs_cis is not None:
            query, key = apply_rotary(query, freqs_cis), apply_rotary(key, freqs_cis)
        batch_size, local_len = hidden_states.shape[:2]
        out = usp_attention(
            query,
            key,
            value,
            self.state.ulysses_group,
            self.state.ring_group,
            key_padding_mask=self.key_padding_mask(attention_mask, batch_size, local_len, hidden_states.device),
        )
        out = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
        if len(attn.to_out) > 1:  # dropout
            out = attn.to_out[1](out)
        return out

    def key_padding_mask(
        self, attention_mask: torch.Tensor | None, batch_size: int, local_len: int, device: torch.device
    ) -> torch.Tensor | None:
        """[B, local_len], True where this rank's key is padding: the split's own padding, and in a batch of
        texts of different lengths the model's padding too (`attention_mask` [B, L], True for a token, whole on
        every rank: this rank's slice of it, the split's padding appended)."""
        padding = self.state.key_padding_mask(batch_size, local_len, device)
        if attention_mask is None:
            return padding
        valid = attention_mask.reshape(batch_size, -1).to(device=device, dtype=torch.bool)
        valid = torch.nn.functional.pad(valid, (0, local_len * self.state.degree - valid.shape[1]), value=False)
        start = self.state.shard_index * local_len
        batch_padding = ~valid[:, start : start + local_len]
        return batch_padding if padding is None else padding | batch_padding


def apply_sequence_parallel(transformer: ZImageTransformer2DModel, mesh: DeviceMesh) -> None:
    """Splits the joint sequence of the main layers, and the image tokens of the noise refiner, over the mesh's
    ring x ulysses ranks, in place; a no-op when both degrees are 1."""
    joint = sequence_parallel_state(mesh)
    image = sequence_parallel_state(mesh)
    if joint is None or image is None:
        return
    layers, refiner = len(transformer.layers), len(transformer.noise_refiner)
    main = [block.attention for block in transformer.layers]
    install_sequence_parallel(transformer, joint, _plan("layers"), main, ZImageSequenceParallelAttnProcessor(joint))
    register_plan_hooks(transformer, {f"layers.{layers - 1}": _GATHER}, joint)
    if refiner:
        # The noise refiner's own split: its state is reset when the model's forward starts, like the joint one.
        image.handles.append(transformer.register_forward_pre_hook(reset_hook(image)))
        register_plan_hooks(transformer, _plan("noise_refiner"), image)
        register_plan_hooks(transformer, {f"noise_refiner.{refiner - 1}": _GATHER}, image)
        # Removed with the joint state's (remove_sequence_parallel below restores both kinds of processor).
        joint.handles.extend(image.handles)
        processor = ZImageSequenceParallelAttnProcessor(image)
        for index, block in enumerate(transformer.noise_refiner):
            joint.original_processors[len(main) + index] = block.attention.processor
            block.attention.set_processor(processor)


def remove_sequence_parallel(transformer: ZImageTransformer2DModel) -> None:
    """Undoes apply_sequence_parallel: removes the hooks and restores the original processors."""
    sequence_parallel.remove_sequence_parallel(transformer, _attentions(transformer))


def _attentions(transformer: ZImageTransformer2DModel) -> list[torch.nn.Module]:
    """The split attentions in the order their original processors are kept: main layers, then noise refiner."""
    return [block.attention for block in (*transformer.layers, *transformer.noise_refiner)]


def parallelize(transformer: torch.nn.Module, config: ParallelConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """Applies the layout to a ZImageTransformer2DModel in place, innermost first: TP, sequence parallel, HSDP.

    The model may still be on the meta device (then it is loaded shard by shard afterwards).
    """
    refuse_unsupported_methods(config, Z_IMAGE)
    if not isinstance(transformer, ZImageTransformer2DModel):
        raise TypeError(f"expected ZImageTransformer2DModel, not {type(transformer).__name__}")
    if config.tp_degree > 1:
        apply_tensor_parallel(transformer, mesh["tp"])
    if config.sequence_parallel:
        apply_sequence_parallel(transformer, mesh)
    if config.use_hsdp and config.hsdp_shard_size * config.hsdp_replicate_size > 1:
        apply_hsdp(transformer, build_hsdp_mesh(config, device_type_for(device)))
