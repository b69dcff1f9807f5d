"""Step caches: the transformer's blocks are skipped on the steps where their output would barely change, and
the residual they added on the last step they ran is added instead.

One method per request (stagekit.denoise.CacheSpec), one module per method, each a config and an `apply_*` function:
`first_block` (diffusers' First Block Cache), `mag` (diffusers' MagCache) and `teacache` (TeaCache for Wan).
`METHODS` names them; `step_cache` applies the request's method to every expert and removes it after.

Each method keeps one state per guidance branch (the families call the transformer inside
`transformer.cache_context(branch)`, as the diffusers pipelines do) and per expert: Wan2.2 A14B's second
expert starts with no cache, so the cache resets at the switch, and its first step runs in full. Under
parallelism every rank takes the single-rank decision (consensus.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from diffusers.hooks.hooks import HookRegistry
from torch import nn

from dit_svc.step_cache.base import CacheMethod, CachePasses, CacheSetting, ExpertRequest, remove_hooks
from dit_svc.step_cache.consensus import BRANCHES, GroupConsensus
from dit_svc.step_cache.first_block import FirstBlockConfig, apply_first_block
from dit_svc.step_cache.mag import MagConfig, apply_mag
from dit_svc.step_cache.teacache import (
    TEACACHE_COEFFICIENTS,
    TEACACHE_WARMUP_AFTER_SWITCH,
    TEACACHE_WARMUP_STEPS,
    TeaCacheConfig,
    apply_teacache,
    teacache_coefficients,
)
from stagekit.denoise import CacheSpec

__all__ = [
    "BRANCHES",
    "METHODS",
    "TEACACHE_COEFFICIENTS",
    "TEACACHE_WARMUP_AFTER_SWITCH",
    "TEACACHE_WARMUP_STEPS",
    "CachePasses",
    "CacheSetting",
    "GroupConsensus",
    "step_cache",
    "teacache_coefficients",
]

# The methods by name: every method of families.base.CACHE_METHODS but "none".
METHODS: dict[str, CacheMethod[Any]] = {
    "first_block": CacheMethod(FirstBlockConfig.for_request, apply_first_block),
    "mag": CacheMethod(MagConfig.for_request, apply_mag),
    "teacache": CacheMethod(TeaCacheConfig.for_request, apply_teacache),
}
# The experts' names, in the order the families list them (the keys of their MagCache ratios).
EXPERT_NAMES = ("transformer", "transformer_2")


@contextmanager
def step_cache(
    experts: list[nn.Module],
    spec: CacheSpec,
    setting: CacheSetting,
    consensus: GroupConsensus | None = None,
) -> Iterator[CachePasses]:
    """Applies the request's cache to every expert for the block's duration; yields this rank's pass counts."""
    passes = CachePasses()
    if not spec.enabled:
        yield passes
        return
    if spec.method not in METHODS:
        raise ValueError(f"step cache '{spec.method}': not one of {', '.join(METHODS)}")
    method = METHODS[spec.method]
    applied: list[tuple[nn.Module, list[str]]] = []
    try:
        for index, expert in enumerate(experts):
            config = method.configure(expert, ExpertRequest(spec, setting, index, EXPERT_NAMES[index]))
            applied.append((expert, method.apply(expert, config, consensus, passes)))
            # `cache_context` finds the hooks through the model's list of hooked children, built once.
            HookRegistry.check_if_exists_or_initialize(expert).invalidate_child_registries_cache()
        yield passes
    finally:
        for expert, hook_names in applied:
            remove_hooks(expert, hook_names)
            HookRegistry.check_if_exists_or_initialize(expert).invalidate_child_registries_cache()
