"""Step caches: the transformer's blocks are skipped on the steps where their output would barely change, and
the residual they added on the last step they ran is added instead.

One method per request (stagekit.denoise.CacheSpec), one module per method, each a config and an `apply_*` function:
`first_block` (diffusers' First Block Cache), `mag` (diffusers' MagCache) and `teacache` (TeaCache for Wan).
`methods.METHODS` names them; `step_cache` applies the request's method to every expert and removes it after.
The methods (and diffusers' hooks under them) are imported with the first request that asks for a cache.

Each method keeps one state per guidance branch (the families call the transformer inside
`transformer.cache_context(branch)`, as the diffusers pipelines do) and per expert: Wan2.2 A14B's second
expert starts with no cache, so the cache resets at the switch, and its first step runs in full. Under
parallelism every rank takes the single-rank decision (consensus.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from dit_svc.step_cache.base import CachePasses, CacheSetting
from dit_svc.step_cache.consensus import BRANCHES, GroupConsensus
from stagekit.denoise import CacheSpec

__all__ = ["BRANCHES", "CachePasses", "CacheSetting", "GroupConsensus", "step_cache"]


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
    from dit_svc.step_cache.methods import methods_applied

    with methods_applied(experts, spec, setting, consensus, passes):
        yield passes
