"""First Block Cache (`first_block`), diffusers' own with the group's decision under parallelism.

Block 0 always runs; when its residual changed by less than the threshold (relative mean absolute difference)
since the last full pass, the other blocks are skipped and the residual they added on that pass is added
instead. Under parallelism the statistics are summed over the group before the comparison
(dit_svc/step_cache/consensus.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks.first_block_cache import (
    _FBC_BLOCK_HOOK,
    _FBC_LEADER_BLOCK_HOOK,
    FBCBlockHook,
    FBCHeadBlockHook,
    FBCSharedBlockState,
)
from diffusers.hooks.hooks import StateManager
from torch import nn

from dit_svc.step_cache.base import CachePasses, ExpertRequest
from dit_svc.step_cache.consensus import GroupConsensus, valid_token_weights
from dit_svc.step_cache.hooks import register_hook, transformer_blocks
from stagekit.parallel.sequence_parallel import SequenceParallelState


@dataclass(frozen=True)
class FirstBlockConfig:
    """The relative change of block 0's residual below which the other blocks are skipped."""

    threshold: float

    @classmethod
    def for_request(cls, transformer: nn.Module, request: ExpertRequest) -> FirstBlockConfig:
        return cls(request.spec.threshold)


class FirstBlockHead(FBCHeadBlockHook):
    """diffusers' first-block head hook, counting passes and deciding with the group under parallelism."""

    def __init__(
        self,
        state_manager: StateManager,
        threshold: float,
        consensus: GroupConsensus | None,
        sequence_state: SequenceParallelState | None,
        passes: CachePasses,
    ) -> None:
        super().__init__(state_manager, threshold)
        self.consensus = consensus
        self.sequence_state = sequence_state
        self.passes = passes

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        output = super().new_forward(module, *args, **kwargs)
        self.passes.count(self.state_manager.get_state().should_compute)
        return output

    @torch.compiler.disable
    def _should_compute_remaining_blocks(self, hidden_states_residual: torch.Tensor) -> bool:
        if self.consensus is None:
            return super()._should_compute_remaining_blocks(hidden_states_residual)
        state = self.state_manager.get_state()
        branch = self.state_manager.context.name
        compute = True
        if state.head_block_residual is not None:
            previous = state.head_block_residual
            change, size = (hidden_states_residual - previous).abs().float(), previous.abs().float()
            weights = valid_token_weights(self.sequence_state, hidden_states_residual)
            if weights is not None:
                change, size = change * weights, size * weights
            # Ratio of sums over every token = ratio of the means one rank takes.
            totals = self.consensus.sums(branch, torch.stack([change.sum(), size.sum()]))
            compute = (totals[0] / totals[1]).item() > self.threshold
        return self.consensus.agree(branch, compute, hidden_states_residual.device)


def apply_first_block(
    transformer: nn.Module, config: FirstBlockConfig, consensus: GroupConsensus | None, passes: CachePasses
) -> list[str]:
    """Hooks the first-block cache onto one expert; returns the hook names to remove after the request."""
    head, *middle, tail = transformer_blocks(transformer)
    sequence_state = getattr(transformer, "_sequence_parallel_state", None)
    manager = StateManager(FBCSharedBlockState)
    register_hook(
        head, FirstBlockHead(manager, config.threshold, consensus, sequence_state, passes), _FBC_LEADER_BLOCK_HOOK
    )
    for block in middle:
        register_hook(block, FBCBlockHook(manager), _FBC_BLOCK_HOOK)
    register_hook(tail, FBCBlockHook(manager, is_tail=True), _FBC_BLOCK_HOOK)
    return [_FBC_LEADER_BLOCK_HOOK, _FBC_BLOCK_HOOK]
