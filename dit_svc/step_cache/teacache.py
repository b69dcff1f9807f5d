"""TeaCache (`teacache`) for Wan, as its reference defines it (the `use_ret_steps` mode).

The relative L1 distance of the timestep modulation between steps, rescaled by the published polynomial of
the model and accumulated, decides whether the blocks run; the first five steps always run (one after an
expert switch), and a full pass resets the accumulator. Block 0 decides (`TeaCacheHead`); the pass-through
and tail blocks are diffusers' first-block ones. Under parallelism the decision is all-reduced
(dit_svc/step_cache/consensus.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, FBCBlockHook, FBCSharedBlockState
from diffusers.hooks.hooks import ModelHook, StateManager
from torch import nn

from dit_svc.step_cache.base import CachePasses, ExpertRequest
from dit_svc.step_cache.consensus import GroupConsensus
from dit_svc.step_cache.hooks import register_hook, registered_class, transformer_blocks

TEACACHE_HOOK = "stagediff_teacache_head"
# The published polynomials of TeaCache4Wan2.1's use_ret_steps mode, by the model they were fitted on.
TEACACHE_COEFFICIENTS = {
    "Wan2.1-T2V-1.3B": (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02),
    "Wan2.1-T2V-14B": (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01),
    "Wan2.1-I2V-14B-480P": (2.57151496e05, -3.54229917e04, 1.40286849e03, -1.35890334e01, 1.32517977e-01),
    "Wan2.1-I2V-14B-720P": (8.10705460e03, 2.13393892e03, -3.72934672e02, 1.66203073e01, -4.17769401e-02),
}
# Steps that always run in full at the start (the reference's ret_steps), and after an expert switch.
TEACACHE_WARMUP_STEPS = 5
TEACACHE_WARMUP_AFTER_SWITCH = 1
_WIDTH_14B = 5120
_AREA_720P = 1280 * 720


def teacache_coefficients(transformer: nn.Module, image_to_video: bool, height: int, width: int) -> str:
    """Which published polynomial a Wan transformer takes: 14B ones for a 5120-wide model, else the 1.3B
    text-to-video one (smaller models, whose own fit is not published); image-to-video takes the 480P or
    720P fit by the request's area (both checkpoints have one config)."""
    config = transformer.config
    wide = config.num_attention_heads * config.attention_head_dim >= _WIDTH_14B
    if image_to_video:
        return "Wan2.1-I2V-14B-720P" if height * width >= _AREA_720P else "Wan2.1-I2V-14B-480P"
    return "Wan2.1-T2V-14B" if wide else "Wan2.1-T2V-1.3B"


@dataclass(frozen=True)
class TeaCacheConfig:
    """The accumulated distance at which the blocks run again, the polynomial that rescales each step's
    distance, and the steps that always run at the start."""

    threshold: float
    coefficients: tuple[float, ...]
    warmup: int

    @classmethod
    def for_request(cls, transformer: nn.Module, request: ExpertRequest) -> TeaCacheConfig:
        setting = request.setting
        fit = teacache_coefficients(transformer, setting.image_to_video, setting.height, setting.width)
        warmup = TEACACHE_WARMUP_STEPS if request.index == 0 else TEACACHE_WARMUP_AFTER_SWITCH
        return cls(request.spec.threshold, TEACACHE_COEFFICIENTS[fit], warmup)


class TeaCacheState(FBCSharedBlockState):
    """The first-block state (the tail residual, whether the pass runs) plus TeaCache's accumulator."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.accumulated = 0.0
        self.previous_modulation: torch.Tensor | None = None


class TeaCacheHead(ModelHook):
    """On block 0: decides from the timestep modulation whether the blocks run, or adds the cached residual.

    The modulation is `condition_embedder`'s timestep projection (the reference's `e0`), caught by a forward
    hook that goes with this hook; the tail block stores the residual against this block's input.
    """

    _is_stateful = True

    def __init__(
        self,
        state_manager: StateManager,
        config: TeaCacheConfig,
        consensus: GroupConsensus | None,
        passes: CachePasses,
    ) -> None:
        super().__init__()
        self.state_manager = state_manager
        self.threshold = config.threshold
        self.rescale = np.poly1d(config.coefficients)
        self.warmup = config.warmup
        self.consensus = consensus
        self.passes = passes
        self.modulation: torch.Tensor | None = None
        # Removes the forward hook on `condition_embedder` that feeds catch_modulation.
        self.remove_modulation_hook: Any = lambda: None
        self._metadata: Any = None

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        self._metadata = TransformerBlockRegistry.get(registered_class(module))
        return module

    def deinitalize_hook(self, module: nn.Module) -> nn.Module:
        self.remove_modulation_hook()
        return module

    def catch_modulation(self, module: nn.Module, args: Any, output: Any) -> None:
        self.modulation = output[1]

    def _decide(self, state: TeaCacheState) -> bool:
        modulation = self.modulation
        assert modulation is not None, "condition_embedder ran before block 0"
        compute = True
        if state.calls >= self.warmup and state.previous_modulation is not None:
            previous = state.previous_modulation
            distance = ((modulation - previous).abs().mean() / previous.abs().mean()).item()
            state.accumulated += float(self.rescale(distance))
            compute = state.accumulated >= self.threshold
        if self.consensus is not None:
            compute = self.consensus.agree(self.state_manager.context.name, compute, modulation.device)
        if compute:
            state.accumulated = 0.0
        state.previous_modulation = modulation.clone()
        state.calls += 1
        return compute

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        hidden_states = self._metadata._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        state: TeaCacheState = self.state_manager.get_state()
        state.should_compute = self._decide(state) or state.tail_block_residuals is None
        self.passes.count(state.should_compute)
        if not state.should_compute:
            return hidden_states + state.tail_block_residuals[0]
        state.head_block_output = hidden_states
        return self.fn_ref.original_forward(*args, **kwargs)


def apply_teacache(
    transformer: nn.Module, config: TeaCacheConfig, consensus: GroupConsensus | None, passes: CachePasses
) -> list[str]:
    """Hooks TeaCache onto one Wan expert; returns the hook names to remove after the request (removing the
    head's also removes its hook on `condition_embedder`)."""
    head, *middle, tail = transformer_blocks(transformer)
    manager = StateManager(TeaCacheState)
    head_hook = TeaCacheHead(manager, config, consensus, passes)
    register_hook(head, head_hook, TEACACHE_HOOK)
    handle = transformer.condition_embedder.register_forward_hook(head_hook.catch_modulation)
    head_hook.remove_modulation_hook = handle.remove
    for block in middle:
        register_hook(block, FBCBlockHook(manager), _FBC_BLOCK_HOOK)
    register_hook(tail, FBCBlockHook(manager, is_tail=True), _FBC_BLOCK_HOOK)
    return [TEACACHE_HOOK, _FBC_BLOCK_HOOK]
