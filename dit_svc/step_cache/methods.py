"""The step cache methods by name, and applying one to a request's experts and taking it off after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from diffusers.hooks.hooks import HookRegistry
from torch import nn

from dit_svc.step_cache.base import CacheMethod, CachePasses, CacheSetting, ExpertRequest
from dit_svc.step_cache.consensus import GroupConsensus
from dit_svc.step_cache.first_block import FirstBlockConfig, apply_first_block
from dit_svc.step_cache.hooks import remove_hooks
from dit_svc.step_cache.mag import MagConfig, apply_mag
from dit_svc.step_cache.teacache import TeaCacheConfig, apply_teacache
from stagekit.denoise import CacheSpec

# The methods by name: every method of families.base.CACHE_METHODS but "none".
METHODS: dict[str, CacheMethod[Any]] = {
    "first_block": CacheMethod(FirstBlockConfig.for_request, apply_first_block),
    "mag": CacheMethod(MagConfig.for_request, apply_mag),
    "teacache": CacheMethod(TeaCacheConfig.for_request, apply_teacache),
}
# The experts' names, in the order the families list them (the keys of their MagCache ratios).
EXPERT_NAMES = ("transformer", "transformer_2")


@contextmanager
def methods_applied(
    experts: list[nn.Module],
    spec: CacheSpec,
    setting: CacheSetting,
    consensus: GroupConsensus | None,
    passes: CachePasses,
) -> Iterator[None]:
    """The request's method on every expert for the block's duration, counting into `passes`."""
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
        yield
    finally:
        for expert, hook_names in applied:
            remove_hooks(expert, hook_names)
            HookRegistry.check_if_exists_or_initialize(expert).invalidate_child_registries_cache()
