"""Step caches: the transformer's blocks are skipped on the steps where their output would barely change, and
the residual they added on the last step they ran is added instead.

Three methods, one per request (`CacheSpec`), applied to every expert for the request and removed after it:

- `first_block`: diffusers' First Block Cache. Block 0 always runs; when its residual changed by less than
  the threshold (relative mean absolute difference) since the last full pass, the other blocks are skipped.
- `mag`: diffusers' MagCache. The decision follows the checkpoint's calibrated magnitude ratios (the
  residual's norm ratio between consecutive steps), accumulated until the error passes the threshold.
- `teacache`: TeaCache for Wan as its reference defines it (the `use_ret_steps` mode): the relative L1
  distance of the timestep modulation between steps, rescaled by the published polynomial of the model and
  accumulated; the first five steps always run, and a full pass resets the accumulator.

Each method keeps one state per guidance branch (the families call the transformer inside
`transformer.cache_context(branch)`, as the diffusers pipelines do) and per expert: Wan2.2 A14B's second
expert starts with no cache, so the cache resets at the switch, and its first step runs in full.

Under parallelism every rank must take the same decision, equal to one rank's, or the ranks would run
different collectives and hang. `GroupConsensus` makes it so: the first-block statistics are summed over the
DiT group before the threshold is compared (each rank holds a shard of the tokens under Ulysses and Ring;
tokens added as padding are left out), and every decision is all-reduced (any rank that computes makes all
compute). Under CFG-parallel both branches are in flight at once on different ranks; each rank writes its
branch's slot of the reduced vector, so one collective serves both branches and each reads its own.
MagCache's decision depends only on the step and the ratios, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.first_block_cache import (
    _FBC_BLOCK_HOOK,
    _FBC_LEADER_BLOCK_HOOK,
    FBCBlockHook,
    FBCHeadBlockHook,
    FBCSharedBlockState,
)
from diffusers.hooks.hooks import HookRegistry, ModelHook, StateManager
from diffusers.hooks.mag_cache import (
    _MAG_CACHE_BLOCK_HOOK,
    _MAG_CACHE_LEADER_BLOCK_HOOK,
    MagCacheBlockHook,
    MagCacheConfig,
    MagCacheHeadHook,
    MagCacheState,
)
from torch import nn

from dit_svc.parallel.sequence_parallel import SequenceParallelState

BRANCHES = ("cond", "uncond")
_TEACACHE_HOOK = "stagediff_teacache_head"


@dataclass(frozen=True)
class CacheSpec:
    """A request's step cache: a method of families.base.CACHE_METHODS and its threshold (higher skips more)."""

    method: str = "none"
    threshold: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.method != "none"


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


# --------------------------------------------------------------------------------- agreement across ranks


class GroupConsensus:
    """Reductions over the DiT group that make every rank's decision the single-rank one (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        # None: the default group, which is the DiT's rank group.
        self.group = group

    def _slot(self, branch: str) -> int:
        return BRANCHES.index(branch)

    def sums(self, branch: str, values: torch.Tensor) -> torch.Tensor:
        """`values` [n] summed over the ranks that run `branch` now (all ranks under sequential CFG)."""
        packed = torch.zeros(len(BRANCHES), values.numel(), dtype=torch.float64, device=values.device)
        packed[self._slot(branch)] = values.to(torch.float64)
        dist.all_reduce(packed, group=self.group)
        return packed[self._slot(branch)]

    def agree(self, branch: str, compute: bool, device: torch.device) -> bool:
        """True when any rank of `branch` wants the full pass."""
        flags = torch.zeros(len(BRANCHES), dtype=torch.int32, device=device)
        flags[self._slot(branch)] = int(compute)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[self._slot(branch)].item())


def _valid_token_weights(state: SequenceParallelState | None, hidden: torch.Tensor) -> torch.Tensor | None:
    """[B, L, 1] with 0 on this rank's padding tokens (sequence parallelism pads to a multiple of the degree)."""
    if state is None:
        return None
    padding = state.key_padding_mask(hidden.shape[0], hidden.shape[1], hidden.device)
    return None if padding is None else (~padding).unsqueeze(-1).to(hidden.dtype)


# ------------------------------------------------------------------------------------------- first block


class FirstBlockHead(FBCHeadBlockHook):
    """diffusers' first-block head hook, counting passes and deciding with the group under parallelism."""

    def __init__(self, state_manager: StateManager, threshold: float, consensus, sequence_state, passes) -> None:
        super().__init__(state_manager, threshold)
        self.consensus: GroupConsensus | None = consensus
        self.sequence_state: SequenceParallelState | None = sequence_state
        self.passes: CachePasses = passes

    def new_forward(self, module: nn.Module, *args, **kwargs):
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
            weights = _valid_token_weights(self.sequence_state, hidden_states_residual)
            if weights is not None:
                change, size = change * weights, size * weights
            # Ratio of sums over every token = ratio of the means one rank takes.
            totals = self.consensus.sums(branch, torch.stack([change.sum(), size.sum()]))
            compute = (totals[0] / totals[1]).item() > self.threshold
        return self.consensus.agree(branch, compute, hidden_states_residual.device)


# --------------------------------------------------------------------------------------------------- mag


class CountingMagCacheHead(MagCacheHeadHook):
    """diffusers' MagCache head hook, counting passes."""

    def __init__(self, state_manager: StateManager, config: MagCacheConfig, passes: CachePasses) -> None:
        super().__init__(state_manager, config)
        self.passes = passes

    def new_forward(self, module: nn.Module, *args, **kwargs):
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


# ---------------------------------------------------------------------------------------------- teacache

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
    hook; the pass-through and tail blocks are diffusers' first-block ones (the tail stores the residual
    against this block's input).
    """

    _is_stateful = True

    def __init__(self, state_manager, threshold, coefficients, warmup, consensus, passes) -> None:
        super().__init__()
        self.state_manager = state_manager
        self.threshold = threshold
        self.rescale = np.poly1d(coefficients)
        self.warmup = warmup
        self.consensus: GroupConsensus | None = consensus
        self.passes: CachePasses = passes
        self.modulation: torch.Tensor | None = None
        # Removes the forward hook on `condition_embedder` that feeds catch_modulation.
        self.remove_modulation_hook = lambda: None
        self._metadata = None

    def initialize_hook(self, module: nn.Module) -> nn.Module:
        self._metadata = TransformerBlockRegistry.get(_registered_class(module))
        return module

    def catch_modulation(self, module: nn.Module, args, output) -> None:
        self.modulation = output[1]

    def _decide(self, state: TeaCacheState) -> bool:
        modulation = self.modulation
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

    def new_forward(self, module: nn.Module, *args, **kwargs):
        hidden_states = self._metadata._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
        state: TeaCacheState = self.state_manager.get_state()
        state.should_compute = self._decide(state) or state.tail_block_residuals is None
        self.passes.count(state.should_compute)
        if not state.should_compute:
            return hidden_states + state.tail_block_residuals[0]
        state.head_block_output = hidden_states
        return self.fn_ref.original_forward(*args, **kwargs)


# ------------------------------------------------------------------------------------------ applying them


def _registered_class(block: nn.Module) -> type:
    """The block's class as diffusers' registry knows it: FSDP2 wraps a block in a subclass of its own."""
    for cls in type(block).__mro__:
        try:
            TransformerBlockRegistry.get(cls)
            return cls
        except ValueError:
            continue
    raise ValueError(f"the step caches do not know the block class {type(block).__name__}")


def _blocks(transformer: nn.Module) -> list[nn.Module]:
    for name, child in transformer.named_children():
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, nn.ModuleList):
            return list(child)
    raise ValueError(f"{type(transformer).__name__} has no transformer blocks the step caches know")


def _register(block: nn.Module, hook: ModelHook, name: str) -> None:
    cls = _registered_class(block)
    if cls is not type(block):  # the wrapped class shares its base's metadata
        TransformerBlockRegistry.register(type(block), TransformerBlockRegistry.get(cls))
    HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, name)


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


def _apply(
    transformer: nn.Module,
    expert_index: int,
    expert_name: str,
    spec: CacheSpec,
    setting: CacheSetting,
    consensus: GroupConsensus | None,
    passes: CachePasses,
) -> list[str]:
    """Registers the method's hooks on one expert; returns the hook names to remove after the request."""
    head, *middle, tail = _blocks(transformer)
    sequence_state = getattr(transformer, "_sequence_parallel_state", None)
    if spec.method in ("first_block", "teacache"):
        manager = StateManager(FBCSharedBlockState if spec.method == "first_block" else TeaCacheState)
        if spec.method == "first_block":
            head_hook = FirstBlockHead(manager, spec.threshold, consensus, sequence_state, passes)
            _register(head, head_hook, _FBC_LEADER_BLOCK_HOOK)
            names = [_FBC_LEADER_BLOCK_HOOK, _FBC_BLOCK_HOOK]
        else:
            coefficients = TEACACHE_COEFFICIENTS[
                teacache_coefficients(transformer, setting.image_to_video, setting.height, setting.width)
            ]
            warmup = TEACACHE_WARMUP_STEPS if expert_index == 0 else TEACACHE_WARMUP_AFTER_SWITCH
            head_hook = TeaCacheHead(manager, spec.threshold, coefficients, warmup, consensus, passes)
            _register(head, head_hook, _TEACACHE_HOOK)
            handle = transformer.condition_embedder.register_forward_hook(head_hook.catch_modulation)
            head_hook.remove_modulation_hook = handle.remove
            names = [_TEACACHE_HOOK, _FBC_BLOCK_HOOK]
        for block in middle:
            _register(block, FBCBlockHook(manager), _FBC_BLOCK_HOOK)
        _register(tail, FBCBlockHook(manager, is_tail=True), _FBC_BLOCK_HOOK)
        return names
    calibrating = setting.calibration is not None
    config = MagCacheConfig(
        threshold=spec.threshold,
        num_inference_steps=setting.num_inference_steps,
        mag_ratios=None if calibrating else setting.mag_ratios[expert_name],
        calibrate=calibrating,
    )
    manager = StateManager(MagCacheState)
    _register(head, CountingMagCacheHead(manager, config, passes), _MAG_CACHE_LEADER_BLOCK_HOOK)
    for block in middle:
        _register(block, MagCacheBlockHook(manager, config=config), _MAG_CACHE_BLOCK_HOOK)
    if calibrating:
        tail_hook = CalibratingMagCacheTail(manager, config, setting.calibration.setdefault(expert_name, {}))
    else:
        tail_hook = MagCacheBlockHook(manager, is_tail=True, config=config)
    _register(tail, tail_hook, _MAG_CACHE_BLOCK_HOOK)
    return [_MAG_CACHE_LEADER_BLOCK_HOOK, _MAG_CACHE_BLOCK_HOOK]


def _remove(transformer: nn.Module, names: list[str]) -> None:
    head = _blocks(transformer)[0]
    teacache = HookRegistry.check_if_exists_or_initialize(head).get_hook(_TEACACHE_HOOK)
    if teacache is not None:
        teacache.remove_modulation_hook()
    for block in _blocks(transformer):
        registry = HookRegistry.check_if_exists_or_initialize(block)
        for name in names:
            if registry.get_hook(name) is not None:
                registry.remove_hook(name)


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
    names = ("transformer", "transformer_2")
    applied: list[tuple[nn.Module, list[str]]] = []
    try:
        for index, expert in enumerate(experts):
            applied.append((expert, _apply(expert, index, names[index], spec, setting, consensus, passes)))
            # `cache_context` finds the hooks through the model's list of hooked children, built once.
            HookRegistry.check_if_exists_or_initialize(expert).invalidate_child_registries_cache()
        yield passes
    finally:
        for expert, hook_names in applied:
            _remove(expert, hook_names)
            HookRegistry.check_if_exists_or_initialize(expert).invalidate_child_registries_cache()
