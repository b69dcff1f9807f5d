"""CPU offload of a stage's models: `--enable-cpu-offload` and `--enable-layerwise-offload`.

Module-wise (`--enable-cpu-offload`): the stage's models (the DiT's experts, a VAE) wait in
pinned CPU memory and one at a time is on the device: the one whose forward runs, or that
the caller asked for with `ModuleOffloader.resident(model)`. It stays until another model
needs the device, so the DiT of a two-expert checkpoint (Wan2.2 A14B's `transformer` and
`transformer_2`) holds one expert, and the steps of one expert move nothing.

Layerwise (`--enable-layerwise-offload --offload-blocks N`): diffusers' block-level group
offloading of the transformer. N blocks form a group that is moved to the device for its
forward and back after; the parameters outside the blocks (embeddings, output projection)
are on the device for the whole forward. On a device with streams and N = 1, the next block
is copied on a side stream while the current one computes (so two blocks are resident);
diffusers 0.42 prefetches only single-block groups, so N > 1 copies synchronously.

On a CPU-only machine both modes run with device = offload device = CPU: the machinery does
all of its bookkeeping and its copies are no-ops, so outputs are unchanged and what would be
resident is the machinery's own onload/offload state, which `ResidencyCounter` observes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import apply_group_offloading
from diffusers.hooks.group_offloading import (
    _GROUP_OFFLOADING,
    ModuleGroup,
    _is_torchao_tensor,
    _restore_torchao_tensor,
    _swap_torchao_tensor,
)
from torch import nn

logger = logging.getLogger(__name__)

MODES = ("module", "layerwise")
CPU = torch.device("cpu")


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _stored_bytes(tensor: torch.Tensor) -> int:
    if _is_torchao_tensor(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(_stored_bytes(getattr(tensor, name)) for name in names if getattr(tensor, name) is not None)
    return tensor.numel() * tensor.element_size()


def parameter_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(_stored_bytes(tensor) for tensor in tensors)


class OffloadUnit:
    """One model of a `ModuleOffloader`: its host copies, and whether it is on the device.

    The host copies are made once (pinned when the device is an accelerator, so host-to-device
    copies are asynchronous); offloading points the parameters back at them instead of copying
    device memory back, since inference never changes a weight.
    """

    def __init__(self, module: nn.Module, device: torch.device, offload_device: torch.device) -> None:
        self.modules = [module]
        self.device = device
        self.offload_device = offload_device
        self.onloaded = False
        pin = device.type == "cuda" and offload_device.type == "cpu"
        self._host: dict[torch.Tensor, torch.Tensor] = {}
        for tensor in _tensors(module):
            host = tensor.to(offload_device) if _is_torchao_tensor(tensor) else tensor.data.to(offload_device)
            self._host[tensor] = host.pin_memory() if pin else host
        self.offload_()

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self._host)

    def onload_(self) -> None:
        for tensor, host in self._host.items():
            moved = host.to(self.device, non_blocking=True)
            if _is_torchao_tensor(tensor):
                _swap_torchao_tensor(tensor, moved)
            else:
                tensor.data = moved
        self.onloaded = True

    def offload_(self) -> None:
        for tensor, host in self._host.items():
            if _is_torchao_tensor(tensor):
                _restore_torchao_tensor(tensor, host)
            else:
                tensor.data = host
        self.onloaded = False


class ModuleOffloader:
    """Keeps at most one of its models on the device; the others wait in (pinned) host memory.

    `add(model)` hooks the model's forward so that calling it makes it resident. Code that
    runs a model's submodules directly (the streaming VAE decode calls `vae.decoder`) wraps
    the work in `with offloader.resident(vae):` instead.
    """

    def __init__(self, device: torch.device, offload_device: torch.device = CPU) -> None:
        self.device = torch.device(device)
        self.offload_device = torch.device(offload_device)
        self.units: dict[nn.Module, OffloadUnit] = {}
        self.active: OffloadUnit | None = None

    def add(self, module: nn.Module, hook_forward: bool = True) -> nn.Module:
        unit = OffloadUnit(module, self.device, self.offload_device)
        self.units[module] = unit
        if hook_forward:
            module.register_forward_pre_hook(lambda mod, args: self.onload(mod))
        return module

    def onload(self, module: nn.Module) -> None:
        """Makes `module` the resident model, offloading the one that was."""
        unit = self.units[module]
        if unit is self.active:
            return
        if self.active is not None:
            self.active.offload_()
        unit.onload_()
        self.active = unit

    def offload_all(self) -> None:
        if self.active is not None:
            self.active.offload_()
            self.active = None

    @contextmanager
    def resident(self, module: nn.Module) -> Iterator[nn.Module]:
        """`module` on the device for the block; it stays there after, until another model is needed."""
        self.onload(module)
        yield module


@dataclass
class LayerwiseOffload:
    """What `apply_offload(..., "layerwise")` set up: the group size and whether copies use a side stream."""

    module: nn.Module
    blocks_per_group: int
    use_stream: bool


def _has_streams(device: torch.device) -> bool:
    return device.type == "cuda"


def apply_offload(
    module: nn.Module,
    mode: str,
    device: torch.device,
    blocks_per_group: int = 1,
    offloader: ModuleOffloader | None = None,
    offload_device: torch.device = CPU,
) -> ModuleOffloader | LayerwiseOffload:
    """Applies `mode` to `module` in place; call after quantization, which must see the weights on the device.

    "module": adds it to `offloader` (a new one if None; pass the same one for every model
    of a stage so only one is resident). "layerwise": diffusers' block-level group offloading
    with `blocks_per_group` blocks per group.
    """
    device = torch.device(device)
    if mode == "module":
        offloader = offloader or ModuleOffloader(device, offload_device)
        offloader.add(module)
        return offloader
    if mode != "layerwise":
        raise ValueError(f"offload mode: '{mode}' is not a mode; use one of {', '.join(MODES)}")
    use_stream = _has_streams(device) and blocks_per_group == 1
    if _has_streams(device) and not use_stream:
        logger.info("layerwise offload of %d blocks per group copies without prefetch", blocks_per_group)
    apply_group_offloading(
        module,
        onload_device=device,
        offload_device=offload_device,
        offload_type="block_level",
        num_blocks_per_group=blocks_per_group,
        non_blocking=use_stream,
        use_stream=use_stream,
    )
    return LayerwiseOffload(module, blocks_per_group, use_stream)


def group_offload_units(module: nn.Module) -> list:
    """The diffusers ModuleGroups that group offloading attached to `module`'s submodules, in module order."""
    groups: dict[int, object] = {}
    for child in module.modules():
        registry = getattr(child, "_diffusers_hook", None)
        hook = registry.get_hook(_GROUP_OFFLOADING) if registry is not None else None
        if hook is not None:
            groups.setdefault(id(hook.group), hook.group)
    return list(groups.values())


def _unit_tensors(unit: ModuleGroup) -> list[torch.Tensor]:
    tensors = [tensor for module in unit.modules for tensor in _tensors(module)]
    tensors += list(getattr(unit, "parameters", None) or []) + list(getattr(unit, "buffers", None) or [])
    return list(dict.fromkeys(tensors))


@dataclass
class ResidencyCounter:
    """Watches an offload machinery's own onload/offload calls, and every layer that computes.

    `units` are objects with `onload_()`/`offload_()` and `modules` (diffusers ModuleGroups or
    our OffloadUnits); their methods are wrapped on the instance to keep the set of onloaded
    units. `blocks` are the modules counted as blocks (e.g. `transformer.blocks`). A forward
    pre-hook on every leaf module that holds tensors records a violation if the leaf computes
    while its unit is not onloaded, or while its tensors are not on the onload device; so on a
    CPU-only machine, where the copies are no-ops, the counts still prove the schedule.
    """

    units: list
    blocks: list[nn.Module]
    onload_device: torch.device
    onloaded: set[int] = field(default_factory=set)
    onloads: int = 0
    offloads: int = 0
    max_resident_blocks: int = 0
    max_resident_bytes: int = 0
    leaf_calls: int = 0
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        block_ids = {id(block) for block in self.blocks}
        self._blocks_in = {id(u): sum(id(m) in block_ids for m in u.modules) for u in self.units}
        self._bytes_in = {id(u): parameter_bytes(_unit_tensors(u)) for u in self.units}
        self._handles = []
        self._unit_onloads: dict[int, int] = {}
        for unit in self.units:
            if self._is_onloaded(unit):
                self.onloaded.add(id(unit))
            self._wrap(unit)
            for module in unit.modules:
                for name, leaf in module.named_modules():
                    if next(leaf.children(), None) is None and _tensors(leaf):
                        if leaf is module:
                            # A group's module that is itself a leaf (a Sequential's layer) is onloaded by its
                            # own wrapped forward, after any pre-hook: checked once that forward has run.
                            self._handles.append(leaf.register_forward_hook(self._leaf_check(unit, leaf, name)))
                        else:
                            self._handles.append(leaf.register_forward_pre_hook(self._leaf_check(unit, leaf, name)))
        self._note()

    def _is_onloaded(self, unit: ModuleGroup) -> bool:
        return bool(getattr(unit, "onloaded", False))

    def _wrap(self, unit: ModuleGroup) -> None:
        onload, offload = unit.onload_, unit.offload_

        def counted_onload() -> None:
            onload()
            self.onloads += 1
            self._unit_onloads[id(unit)] = self._unit_onloads.get(id(unit), 0) + 1
            self.onloaded.add(id(unit))
            self._note()

        def counted_offload() -> None:
            offload()
            self.offloads += 1
            self.onloaded.discard(id(unit))

        unit.onload_, unit.offload_ = counted_onload, counted_offload

    def _note(self) -> None:
        self.max_resident_blocks = max(self.max_resident_blocks, self.resident_blocks)
        self.max_resident_bytes = max(self.max_resident_bytes, self.resident_bytes)

    @property
    def resident_blocks(self) -> int:
        return sum(self._blocks_in[i] for i in self.onloaded)

    @property
    def resident_bytes(self) -> int:
        return sum(self._bytes_in[i] for i in self.onloaded)

    def _leaf_check(self, unit: ModuleGroup, leaf: nn.Module, name: str) -> Callable[..., None]:
        onloads_before = [0]

        def check(module: nn.Module, args: tuple, *output: Any) -> None:
            self.leaf_calls += 1
            if output:  # after the forward: its group was onloaded during it, or stays onloaded
                onloaded = id(unit) in self.onloaded or self._unit_onloads.get(id(unit), 0) > onloads_before[0]
                onloads_before[0] = self._unit_onloads.get(id(unit), 0)
            else:
                onloaded = id(unit) in self.onloaded
            if not onloaded:
                self.violations.append(f"{name} computed while its group was offloaded")
            elif id(unit) in self.onloaded and any(t.device != self.onload_device for t in _tensors(leaf)):
                self.violations.append(f"{name} computed with tensors off {self.onload_device}")

        return check

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
