"""Registering a step cache's hooks on a transformer's blocks through diffusers' registries, and taking them off."""

from __future__ import annotations

from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.hooks import HookRegistry, ModelHook
from torch import nn


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
