"""FamilyTesterConfig, the interface every feature mixin is written against, and what the mixins share: the
fp32 one-rank reference run of a config's request (one per checkpoint, for every module that compares with
it) and the forward calls of each expert while a denoiser runs it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from dit_svc.config import DenoiserBuild
from dit_svc.denoise import make_denoiser
from dit_svc.model_options import ModelOptions
from dit_svc.quantization import parameter_bytes
from families.init_model import init_model
from stagekit.denoise import CacheSpec, DenoiseSpec
from stagekit.parallel import ParallelConfig
from stagekit.parallel.hsdp import local_parameter_bytes
from stagekit.parallel.launch import run_ranks

CPU = torch.device("cpu")


class FamilyTesterConfig:
    """How the feature mixins test one family's DiT on its tiny checkpoint.

    A subclass names the family and its request, says what conditioning the DiT stage would hand its denoiser
    (text embeddings, and the input images' tensors for the image-conditioned families) and describes its
    experts. The per-family lists the mixins run over (layerwise offload group sizes, parallel layouts) are
    class attributes that `pytest_generate_tests` turns into parameters.

    The parallel checks run `parallel_outputs` on one rank and on every rank of each layout; a family adds
    what its ranks must also report by extending it, and checks that in `check_parallel_outputs`.
    """

    family: ClassVar[str]
    """The family's registry name (families/registry.py)."""
    model_fixture: ClassVar[str] = ""
    """The conftest fixture of its random-weight checkpoint; empty: the tiny preset, written once per session."""
    pipeline_fixture: ClassVar[str] = ""
    """The conftest fixture of the diffusers pipeline loaded from that checkpoint; empty: each expert is loaded
    with `transformer_class.from_pretrained`, as the pipeline loads it."""
    spec: ClassVar[DenoiseSpec]
    parallel_specs: ClassVar[tuple[DenoiseSpec, ...]] = ()
    """The requests the parallel layouts run (empty: `spec` alone); the same steps and guidance as `spec`."""
    forwards_per_expert: ClassVar[list[int]]
    """Transformer forward calls of each expert while denoising `spec` (and each of `parallel_specs`) on one
    rank; CFG-parallel ranks run their share."""
    expert_names: ClassVar[tuple[str, ...]]
    """The pipeline attribute of each expert, in the denoiser's order."""
    transformer_class: ClassVar[type[torch.nn.Module]]
    blocks_attribute: ClassVar[str]
    """The ModuleList of each expert's transformer blocks."""
    more_block_lists: ClassVar[tuple[str, ...]] = ()
    """Further ModuleLists of blocks each expert runs after those (FLUX's single-stream blocks)."""
    more_repeated_modules: ClassVar[tuple[str, ...]] = ()
    """Modules outside those lists of classes the model's `_repeated_blocks` names, which regional compilation
    compiles too (HunyuanVideo 1.5's patch embedder and text token refiner)."""
    ignored_layers: ClassVar[tuple[str, ...]]
    """`--ignored-layers` patterns the quantization checks pass."""
    ignored_prefixes: ClassVar[tuple[str, ...]]
    """Written out independently of the pattern matcher: the linear layers those patterns keep."""
    distinct_weight: ClassVar[str] = ""
    """A parameter that two experts must not share (with more than one expert)."""
    min_reference_std: ClassVar[float] = 0.0
    layerwise_blocks: ClassVar[tuple[int, ...]] = (1, 2)
    """The `--layerwise-offload-blocks` values the layerwise offload check runs (parameter `blocks`)."""
    parallel_layouts: ClassVar[dict[int, list[tuple[str, ParallelConfig]]]] = {}
    """By world size (parameter `world_size`), the named layouts one spawn of that many gloo ranks runs."""
    gguf_types: ClassVar[tuple[str, ...]] = ()
    """The GGUF quantization types the GGUF check converts the experts to (parameter `gguf_type`)."""
    step_cache_spec: ClassVar[DenoiseSpec]
    """The request the step caches run: enough steps, with CFG, for each cache to skip some passes."""
    step_caches: ClassVar[tuple[CacheSpec, ...]] = ()
    """The step caches the family offers, each with a threshold at which it skips some passes of that request."""
    step_cache_layouts: ClassVar[dict[int, list[tuple[str, ParallelConfig]]]] = {}
    """By world size (parameter `cache_world_size`), the layouts the step caches run under."""
    pipeline_class: ClassVar[Any]
    """The family's diffusers pipeline, which `pipeline_run` runs."""
    lora_spec: ClassVar[DenoiseSpec]
    """The request the LoRA adapters run."""
    lora_targets: ClassVar[tuple[str, ...]] = ()
    """The linears the test adapters wrap (tests/helpers/lora_adapters.py)."""
    lora_layouts: ClassVar[list[tuple[str, ParallelConfig]]] = []
    """The layouts on two ranks the adapters run under (one spawn for every config, tests/integration/test_lora.py)."""
    quantized_limit: ClassVar[float] = 0.05
    """How far a quantized run's update may move from the bf16 run's, relative to its size."""
    max_quantized_fraction: ClassVar[float] = 0.55
    """The most of an expert's bf16 parameter bytes it may hold with every linear layer quantized (what stays in
    bf16 beside the 8-bit weights, the biases and one scale per output row, is a larger share of narrow layers)."""
    max_sharded_fraction: ClassVar[float] = 0.8
    """The most of an expert's parameter bytes a rank of a TP or HSDP layout may hold (what the plan leaves
    replicated is a larger share of a tiny model than of the real one)."""
    batch_layouts: ClassVar[list[tuple[str, ParallelConfig]]] = []
    """The layouts on two ranks batches run under, rank 0 alone seeing a member leave (one spawn for every config,
    tests/integration/test_batching.py)."""
    step_scheduling_specs: ClassVar[tuple[DenoiseSpec, DenoiseSpec]]
    """The two requests the step scheduling checks run (one latent shape, the same guidance branches): the first
    is exported and resumed at every step boundary; the second, with another seed, guidance scale and step count,
    joins the first's continuous batch."""
    continuous_batch_tolerance: ClassVar[float] = 0.0
    """How far a row of a continuous batch may be from its run alone: 0, exactly equal, where the family runs its
    batch-variant modules row by row (stagekit/batch_invariance.py)."""
    step_scheduling_schedulers: ClassVar[dict[str, dict[str, Any]]] = {}
    """Further schedulers (class name: scheduler config) the exported states must resume exactly with, each on a
    copy of the checkpoint with that scheduler."""
    compile_specs: ClassVar[tuple[DenoiseSpec, ...]] = ()
    """The requests the compile check runs eagerly, then compiled (their conditioning: `compile_conditioning`):
    the first two bring every variant of structure dynamo compiles, the others only new sizes and text lengths."""

    def build_denoiser(
        self,
        model_dir: Path,
        dtype: torch.dtype,
        options: ModelOptions | None = None,
        load_threads: int = 4,
        parallel: ParallelConfig | None = None,
    ) -> Any:
        build = DenoiserBuild(
            parallel=parallel or ParallelConfig(), options=options or ModelOptions(), load_threads=load_threads
        )
        return make_denoiser(model_dir, CPU, dtype, build)

    def conditioning(self, denoiser: Any, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
        """What the DiT stage hands `denoiser` for `spec`: the same tensors on every call and every rank."""
        raise NotImplementedError

    def denoised(self, denoiser: Any, spec: DenoiseSpec, conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        """The final latents of `spec` the checks compare: the denoiser's `denoise`. A family whose DiT stage sends
        more than the video's latents returns all of it (LTX-2 its audio latents too), so a feature that breaks any
        of it fails its check."""
        return denoiser.denoise(spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)

    def compile_conditioning(self, denoiser: Any, index: int) -> dict[str, torch.Tensor]:
        """The conditioning of `compile_specs[index]`, with that request's text lengths (and masks)."""
        raise NotImplementedError

    def pipeline_latents(self, model_dir: Path, denoiser: Any, experts: dict[str, torch.nn.Module]) -> torch.Tensor:
        """The diffusers pipeline's final latents of `spec` with `conditioning(denoiser, spec)`, its experts
        replaced by `experts`."""
        raise NotImplementedError

    def pipeline_run(self, pipeline: Any, denoiser: Any, spec: DenoiseSpec) -> torch.Tensor:
        """`pipeline`'s final latents of `spec` with `conditioning(denoiser, spec)`, in the denoiser's layout."""
        raise NotImplementedError

    def parallel_outputs(self, denoiser: Any) -> dict[str, Any]:
        """What a rank reports: the latents and each expert's forward calls of every parallel spec, and the
        parameter bytes each expert holds on the rank."""
        runs = [denoise_counting(self, denoiser, spec) for spec in self.parallel_specs or (self.spec,)]
        return {
            "latents": [latents for latents, _ in runs],
            "calls": [calls for _, calls in runs],
            "bytes": [local_parameter_bytes(expert) for expert in denoiser.experts],
        }

    def check_parallel_outputs(
        self, name: str, layout: ParallelConfig, per_rank: list[dict[str, Any]], one_rank: dict[str, Any]
    ) -> None:
        """The family's own checks of one layout's `parallel_outputs` (every rank's) against one rank's."""

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        """The seed's noise in the layout of the denoiser's final latents."""
        raise NotImplementedError

    def offloaded_block_lists(self, expert: torch.nn.Module) -> list[list[torch.nn.Module]]:
        """The lists of blocks diffusers' block-level group offloading makes groups of (each ModuleList or
        Sequential child of the expert): the expert's `blocks_attribute` and `more_block_lists` unless the family
        says otherwise."""
        return [list(getattr(expert, name)) for name in (self.blocks_attribute, *self.more_block_lists)]

    def is_ignored(self, name: str) -> bool:
        return name == "proj_out" or name.startswith(self.ignored_prefixes)

    def reference_experts(self, request: pytest.FixtureRequest, model_dir: Path) -> list[torch.nn.Module]:
        """Each expert as the diffusers pipeline loads it from the checkpoint."""
        if self.pipeline_fixture:
            pipeline = request.getfixturevalue(self.pipeline_fixture)
            return [getattr(pipeline, name) for name in self.expert_names]
        return [self.transformer_class.from_pretrained(model_dir / name) for name in self.expert_names]  # type: ignore[attr-defined]

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "blocks" in metafunc.fixturenames:
            metafunc.parametrize("blocks", self.layerwise_blocks)
        if "gguf_type" in metafunc.fixturenames:
            metafunc.parametrize("gguf_type", self.gguf_types)
        if "world_size" in metafunc.fixturenames:
            sizes = sorted(self.parallel_layouts)
            metafunc.parametrize("world_size", sizes, ids=[f"{size}-ranks" for size in sizes])
        if "cache_world_size" in metafunc.fixturenames:
            sizes = sorted(self.step_cache_layouts)
            metafunc.parametrize("cache_world_size", sizes, ids=[f"{size}-ranks" for size in sizes])

    @pytest.fixture
    def model_dir(self, request: pytest.FixtureRequest) -> Path:
        return checkpoint(self, request)

    @pytest.fixture
    def reference(self, model_dir: Path) -> Reference:
        return reference_run(self, model_dir)


_CHECKPOINTS: dict[str, Path] = {}


def checkpoint(config: FamilyTesterConfig | type[FamilyTesterConfig], request: pytest.FixtureRequest) -> Path:
    """The config's checkpoint: its conftest fixture's, or the family's tiny preset."""
    if config.model_fixture:
        return request.getfixturevalue(config.model_fixture)
    return tiny_checkpoint(config.family, request.getfixturevalue("tmp_path_factory"))


def tiny_checkpoint(family: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The family's tiny random-weight checkpoint (seed 0), written once per session."""
    if family not in _CHECKPOINTS:
        _CHECKPOINTS[family] = init_model(family, "tiny", tmp_path_factory.mktemp("tester-models") / family, seed=0)
    return _CHECKPOINTS[family]


@dataclass(frozen=True)
class Reference:
    """The fp32 one-rank run every feature is compared with."""

    latents: torch.Tensor
    expert_bytes: list[int]


def tester_config(test_class: type) -> type[FamilyTesterConfig]:
    """The tester config a test class combines with its mixins."""
    (config,) = [base for base in test_class.__bases__ if issubclass(base, FamilyTesterConfig)]
    return config


SpawnResults = dict[tuple[type[FamilyTesterConfig], int], list[dict[str, Any]] | Exception]


def shared_spawn(
    request: pytest.FixtureRequest,
    config: type[FamilyTesterConfig],
    world_size: int,
    *,
    mixin: type,
    layouts: str,
    results: SpawnResults,
    case: Callable[[type[FamilyTesterConfig]], tuple[Any, ...]],
    rank_function: Callable[..., dict[str, dict[str, Any]]],
) -> list[dict[str, Any]]:
    """Every rank's results for `config` at `world_size`, by layout name.

    Spawning ranks is the expensive part, so the first call for a world size runs, in one group of gloo ranks,
    every config collected with `mixin` that declares layouts of that size (its attribute `layouts`):
    `rank_function(rank, world_size, [case(config), ...])` returns each config's results by its qualified name.
    `results` keeps them for the session; a failed group fails every config in it, without spawning again.
    """
    if (config, world_size) not in results:
        pending = [config]
        for item in request.session.items:
            test_class = getattr(item, "cls", None)
            if test_class is None or not issubclass(test_class, mixin):
                continue
            other = tester_config(test_class)
            if world_size in getattr(other, layouts) and (other, world_size) not in results and other not in pending:
                pending.append(other)
        try:
            outputs = run_ranks(rank_function, world_size, [case(each) for each in pending])
        except Exception as failed:
            for each in pending:
                results[(each, world_size)] = failed
            raise
        for each in pending:
            results[(each, world_size)] = [by_config[each.__qualname__] for by_config in outputs]
    found = results[(config, world_size)]
    if isinstance(found, Exception):
        raise found
    return found


_REFERENCES: dict[tuple[str, str], Reference] = {}


def denoise_counting(
    config: FamilyTesterConfig, denoiser: Any, spec: DenoiseSpec | None = None
) -> tuple[torch.Tensor, list[int]]:
    """The final latents of `spec` (the config's by default), and how many forward calls each expert ran."""
    spec = spec or config.spec
    experts = denoiser.experts
    assert len(experts) == len(config.expert_names), f"{config.family}: experts {len(experts)}"
    calls = [0] * len(experts)
    handles = [
        expert.register_forward_pre_hook(lambda module, args, index=index: calls.__setitem__(index, calls[index] + 1))
        for index, expert in enumerate(experts)
    ]
    conditioning = config.conditioning(denoiser, spec)
    try:
        latents = config.denoised(denoiser, spec, conditioning)
    finally:
        for handle in handles:
            handle.remove()
    return latents, calls


def reference_run(config: FamilyTesterConfig, model_dir: Path) -> Reference:
    """The fp32 one-rank latents of `config.spec`, run once per checkpoint for every module that compares with it."""
    key = (config.family, str(model_dir))
    if key not in _REFERENCES:
        denoiser = config.build_denoiser(model_dir, torch.float32)
        latents, calls = denoise_counting(config, denoiser)
        assert calls == config.forwards_per_expert, f"{config.family}: every expert must run its steps: {calls}"
        assert latents.std() > config.min_reference_std, "the reference latents are flat"
        _REFERENCES[key] = Reference(latents, [parameter_bytes(expert) for expert in denoiser.experts])
    return _REFERENCES[key]


def assert_same_tensors(ours: torch.nn.Module, reference: torch.nn.Module, name: str) -> None:
    """The same parameter and buffer names, dtypes and values."""
    for kind in ("named_parameters", "named_buffers"):
        mine = dict(getattr(ours, kind)(remove_duplicate=False))
        theirs = dict(getattr(reference, kind)(remove_duplicate=False))
        assert mine.keys() == theirs.keys(), f"{name} {kind}: {sorted(mine.keys() ^ theirs.keys())}"
        for key, value in theirs.items():
            assert mine[key].dtype == value.dtype, f"{name}.{key}: {mine[key].dtype} != {value.dtype}"
            assert torch.equal(mine[key], value), f"{name}.{key}"
