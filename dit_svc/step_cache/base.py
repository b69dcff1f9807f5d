"""What every step cache method shares: the request's spec and setting, and the pass counts.

A method (one module of this package) builds its config from an `ExpertRequest` and applies its hooks to one
expert (dit_svc/step_cache/hooks.py), returning the hook names that `remove_hooks` takes off after the request;
`CacheMethod` pairs the two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from torch import nn

from dit_svc.step_cache.consensus import GroupConsensus
from stagekit.denoise import CacheSpec

ConfigT = TypeVar("ConfigT")


@dataclass
class CachePasses:
    """Transformer passes (one per step and guidance branch) that ran in full and that the cache skipped."""

    run: int = 0
    skipped: int = 0

    def count(self, computed: bool) -> None:
        if computed:
            self.run += 1
        else:
            self.skipped += 1


@dataclass(frozen=True)
class CacheSetting:
    """What the stage knows for one request besides the CacheSpec."""

    num_inference_steps: int
    height: int
    width: int
    image_to_video: bool = False
    # MagCache ratios per expert name; calibrating records them into `calibration` instead of skipping.
    mag_ratios: dict[str, list[float]] | None = None
    calibration: dict[str, dict[str, list[float]]] | None = None


@dataclass(frozen=True)
class ExpertRequest:
    """One expert's part of a request's cache: what a method builds its config from."""

    spec: CacheSpec
    setting: CacheSetting
    index: int  # 0 for the first expert, 1 for Wan2.2 A14B's second
    name: str  # "transformer" or "transformer_2": the key of the expert's MagCache ratios


@dataclass(frozen=True)
class CacheMethod(Generic[ConfigT]):
    """A step cache method: its config for one expert, and the function that hooks it onto the expert
    (returning the names of the hooks to remove after the request)."""

    configure: Callable[[nn.Module, ExpertRequest], ConfigT]
    apply: Callable[[nn.Module, ConfigT, GroupConsensus | None, CachePasses], list[str]]
