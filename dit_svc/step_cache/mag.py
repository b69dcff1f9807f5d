"""MagCache (`mag`), diffusers' own, counting passes and able to record its calibration.

The decision follows the checkpoint's calibrated magnitude ratios (the residual's norm ratio between
consecutive steps), accumulated until the error passes the threshold; it depends only on the step and the
ratios, so every rank of a group takes it alike. Calibrating (dit_svc/calibrate.py) runs every pass and
records each branch's ratios instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks.hooks import StateManager
from diffusers.hooks.mag_cache import (
    _MAG_CACHE_BLOCK_HOOK,
    _MAG_CACHE_LEADER_BLOCK_HOOK,
    MagCacheBlockHook,
    MagCacheConfig,
    MagCacheHeadHook,
    MagCacheState,
)
from torch import nn

from dit_svc.step_cache.base import CachePasses, ExpertRequest
from dit_svc.step_cache.consensus import GroupConsensus
from dit_svc.step_cache.hooks import register_hook, transformer_blocks


@dataclass(frozen=True)
class MagConfig:
    """diffusers' MagCache config for one expert, and where calibration records its ratios by branch."""

    cache: MagCacheConfig
    calibration: dict[str, list[float]] | None = None

    @classmethod
    def for_request(cls, transformer: nn.Module, request: ExpertRequest) -> MagConfig:
        setting = request.setting
        calibrating = setting.calibration is not None
        cache = MagCacheConfig(
            threshold=request.spec.threshold,
            num_inference_steps=setting.num_inference_steps,
            mag_ratios=None if calibrating or setting.mag_ratios is None else setting.mag_ratios[request.name],
            calibrate=calibrating,
        )
        calibration = None if setting.calibration is None else setting.calibration.setdefault(request.name, {})
        return cls(cache, calibration)


class CountingMagCacheHead(MagCacheHeadHook):
    """diffusers' MagCache head hook, counting passes."""

    def __init__(self, state_manager: StateManager, config: MagCacheConfig, passes: CachePasses) -> None:
        super().__init__(state_manager, config)
        self.passes = passes

    def new_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        output = super().new_forward(module, *args, **kwargs)
        self.passes.count(self.state_manager.get_state().should_compute)
        return output


class CalibratingMagCacheTail(MagCacheBlockHook):
    """The tail hook in calibration mode, keeping each branch's ratios (diffusers only prints them)."""

    def __init__(self, state_manager: StateManager, config: MagCacheConfig, ratios: dict[str, list[float]]) -> None:
        super().__init__(state_manager, is_tail=True, config=config)
        self.ratios = ratios

    def _perform_calibration_step(self, state: MagCacheState, current_residual: torch.Tensor) -> None:
        super()._perform_calibration_step(state, current_residual)
        self.ratios.setdefault(self.state_manager.context.name, []).append(state.calibration_ratios[-1])


def apply_mag(
    transformer: nn.Module, config: MagConfig, consensus: GroupConsensus | None, passes: CachePasses
) -> list[str]:
    """Hooks MagCache onto one expert; returns the hook names to remove after the request. `consensus` is
    unused: the decision is the same on every rank."""
    head, *middle, tail = transformer_blocks(transformer)
    manager = StateManager(MagCacheState)
    register_hook(head, CountingMagCacheHead(manager, config.cache, passes), _MAG_CACHE_LEADER_BLOCK_HOOK)
    for block in middle:
        register_hook(block, MagCacheBlockHook(manager, config=config.cache), _MAG_CACHE_BLOCK_HOOK)
    tail_hook: MagCacheBlockHook
    if config.calibration is not None:
        tail_hook = CalibratingMagCacheTail(manager, config.cache, config.calibration)
    else:
        tail_hook = MagCacheBlockHook(manager, is_tail=True, config=config.cache)
    register_hook(tail, tail_hook, _MAG_CACHE_BLOCK_HOOK)
    return [_MAG_CACHE_LEADER_BLOCK_HOOK, _MAG_CACHE_BLOCK_HOOK]
