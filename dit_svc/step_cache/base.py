"""What every step cache method shares: the request's spec and setting, the pass counts, and registering
hooks on a transformer's blocks through diffusers' registries.

A method (one module of this package) builds its config from an `ExpertRequest` and applies its hooks to one
expert, returning the hook names that `remove_hooks` takes off after the request; `CacheMethod` pairs the two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.hooks import HookRegistry, ModelHook
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


def registered_class(block: nn.Module) -> type:
    """The block's class as diffusers' registry knows it: FSDP2 wraps a block in a subclass of its own."""
    for cls in type(block).__mro__:
        try:
            TransformerBlockRegistry.get(cls)
            return cls
        except ValueError:
            continue
    raise ValueError(f"the step caches do not know the block class {type(block).__name__}")


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The transformer's blocks, in order: every ModuleList of blocks diffusers' caches hook, one after another
    (FLUX's double-stream blocks, then its single-stream ones), as `apply_first_block_cache` collects them."""
    blocks = [
        block
        for name, child in transformer.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, nn.ModuleList)
        for block in child
    ]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no transformer blocks the step caches know")
    return blocks


def register_hook(block: nn.Module, hook: ModelHook, name: str) -> None:
    cls = registered_class(block)
    if cls is not type(block):  # the wrapped class shares its base's metadata
        TransformerBlockRegistry.register(type(block), TransformerBlockRegistry.get(cls))
    HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, name)


def remove_hooks(transformer: nn.Module, names: list[str]) -> None:
    """Takes the hooks `names` off every block of the transformer (their `deinitalize_hook` runs)."""
    for block in transformer_blocks(transformer):
        registry = HookRegistry.check_if_exists_or_initialize(block)
        for name in names:
            if registry.get_hook(name) is not None:
                registry.remove_hook(name)
