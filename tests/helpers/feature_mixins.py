"""The family x feature matrix as tests: one tester config per family, one mixin per feature.

A tester config says how to test one family's DiT: which checkpoint fixture, which request (`spec`), how to
build its denoiser, what conditioning to feed it, how many forwards each expert runs, where its blocks are and
which layers `--ignored-layers` patterns keep. A mixin holds one feature's checks, written once against that
interface; a test class combines the two (`class TestQwenImageOffload(QwenImageTesterConfig,
ModuleOffloadTesterMixin)`), and a family's `Support` entries name the class's tests. tests/unit/test_families.py
checks that a supported cell of a feature in FEATURE_MIXINS names a class that mixes in that feature's mixin.

Adding a family: write its tester config (a subclass of FamilyTesterConfig), add it to TESTER_CONFIGS, and
list its test classes beside the others (tests/integration/test_family_features.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel, WanTransformer3DModel

from dit_svc.config import DenoiserBuild
from dit_svc.denoise import make_denoiser
from dit_svc.model_options import ModelOptions
from dit_svc.offload import ModuleOffloader, ResidencyCounter, apply_offload, group_offload_units
from dit_svc.quantization import (
    expected_storage_dtype,
    linear_layer_names,
    parameter_bytes,
    quantize_transformer,
    weight_storage_dtype,
)
from stagekit.denoise import DenoiseSpec
from stagekit.weights import load_stats

CPU = torch.device("cpu")
# Relative to what the steps changed (latents - noise), so the noise itself does not hide the error: bf16 alone
# moves that change by a few percent against fp32; 8-bit weights may add a few percent more.
QUANTIZED_LIMIT = 0.05


class FamilyTesterConfig:
    """How the feature mixins test one family's DiT on its tiny checkpoint."""

    family: ClassVar[str]
    """The family's registry name (families/registry.py)."""
    model_fixture: ClassVar[str]
    """The conftest fixture of its random-weight checkpoint."""
    pipeline_fixture: ClassVar[str]
    """The conftest fixture of the diffusers pipeline loaded from that checkpoint."""
    spec: ClassVar[DenoiseSpec]
    forwards_per_expert: ClassVar[list[int]]
    """Transformer forward calls of each expert while denoising `spec`."""
    expert_names: ClassVar[tuple[str, ...]]
    """The pipeline attribute of each expert, in the denoiser's order."""
    transformer_class: ClassVar[type[torch.nn.Module]]
    blocks_attribute: ClassVar[str]
    """The ModuleList of each expert's transformer blocks."""
    ignored_layers: ClassVar[tuple[str, ...]]
    """`--ignored-layers` patterns the quantization checks pass."""
    ignored_prefixes: ClassVar[tuple[str, ...]]
    """Written out independently of the pattern matcher: the linear layers those patterns keep."""
    distinct_weight: ClassVar[str] = ""
    """A parameter that two experts must not share (with more than one expert)."""
    min_reference_std: ClassVar[float] = 0.0

    def build_denoiser(
        self, model_dir: Path, dtype: torch.dtype, options: ModelOptions | None = None, load_threads: int = 4
    ) -> Any:
        return make_denoiser(
            model_dir, CPU, dtype, DenoiserBuild(options=options or ModelOptions(), load_threads=load_threads)
        )

    def conditioning(self, text_dim: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        """The seed's noise in the layout of the denoiser's final latents."""
        raise NotImplementedError

    def is_ignored(self, name: str) -> bool:
        return name == "proj_out" or name.startswith(self.ignored_prefixes)

    @pytest.fixture
    def model_dir(self, request: pytest.FixtureRequest) -> Path:
        return request.getfixturevalue(self.model_fixture)

    @pytest.fixture
    def reference(self, model_dir: Path) -> Reference:
        return reference_run(self, model_dir)


@dataclass(frozen=True)
class Reference:
    """The fp32 one-rank run every feature is compared with."""

    latents: torch.Tensor
    expert_bytes: list[int]


_REFERENCES: dict[tuple[str, str], Reference] = {}


def denoise_counting(config: FamilyTesterConfig, denoiser: Any) -> tuple[torch.Tensor, list[int]]:
    """The final latents of `config.spec`, and how many forward calls each expert ran."""
    experts = denoiser.experts
    assert len(experts) == len(config.expert_names), f"{config.family}: experts {len(experts)}"
    calls = [0] * len(experts)
    handles = [
        expert.register_forward_pre_hook(lambda module, args, index=index: calls.__setitem__(index, calls[index] + 1))
        for index, expert in enumerate(experts)
    ]
    conditioning = config.conditioning(denoiser.text_dim)
    try:
        latents = denoiser.denoise(config.spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)
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


# ------------------------------------------------------------------------------------------- tester configs


class WanA14BTesterConfig(FamilyTesterConfig):
    """Wan2.2 A14B: two UniPC steps, 999 on `transformer` and 750 on `transformer_2` (the boundary is
    0.875 * 1000); counting each expert's forwards makes a feature that dropped or swapped an expert fail."""

    family = "wan2.2-a14b"
    model_fixture = "a14b_model"
    pipeline_fixture = "a14b_pipeline"
    # 48x80x5 -> latents [1, 16, 2, 6, 10]: 30 tokens (even over two ranks), 6 latent rows (3 per VAE rank).
    spec = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=1)
    # One step per expert, two forwards per step (the prompt and the negative prompt).
    forwards_per_expert = [2, 2]
    expert_names = ("transformer", "transformer_2")
    transformer_class = WanTransformer3DModel
    blocks_attribute = "blocks"
    ignored_layers = ("proj_out", "blocks.0.*", "condition_embedder.*")
    ignored_prefixes = ("blocks.0.", "condition_embedder.")
    distinct_weight = "blocks.0.attn1.to_q.weight"

    def conditioning(self, text_dim: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        return {
            "prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
            "negative_prompt_embeds": torch.randn(1, 24, text_dim, generator=generator),
        }

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        return denoiser.initial_noise(self.spec)


class QwenImageTesterConfig(FamilyTesterConfig):
    """Qwen-Image: two steps with true CFG, a prompt whose mask has a hole (so the mask reaches the transformer)."""

    family = "qwen-image"
    model_fixture = "qwen_model"
    pipeline_fixture = "qwen_pipeline"
    # 64x48 -> 4 x 3 packed image tokens; two steps with true CFG: four transformer forwards.
    spec = DenoiseSpec(height=64, width=48, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0)
    forwards_per_expert = [4]
    expert_names = ("transformer",)
    transformer_class = QwenImageTransformer2DModel
    blocks_attribute = "transformer_blocks"
    ignored_layers = ("proj_out", "transformer_blocks.0.*", "time_text_embed.*")
    ignored_prefixes = ("transformer_blocks.0.", "time_text_")
    min_reference_std = 0.1

    def conditioning(self, text_dim: int) -> dict[str, torch.Tensor]:
        """A masked prompt and an unmasked negative prompt, as the DiT stage receives them."""
        from families.qwen_image.denoise import QwenTextEmbeds

        generator = torch.Generator().manual_seed(0)
        conditioning = {
            "prompt_embeds": torch.randn(1, 7, text_dim, generator=generator),
            "prompt_embeds_mask": torch.tensor([[1, 1, 0, 1, 1, 1, 1]]),
            "negative_prompt_embeds": torch.randn(1, 5, text_dim, generator=generator),
        }
        assert QwenTextEmbeds.from_conditioning(conditioning, "prompt_embeds").mask is not None
        return conditioning

    def initial_noise(self, denoiser: Any) -> torch.Tensor:
        packed = denoiser.initial_noise(self.spec, torch.float32)
        return QwenImagePipeline._unpack_latents(packed, self.spec.height, self.spec.width, denoiser.vae_scale_factor)


TESTER_CONFIGS: tuple[type[FamilyTesterConfig], ...] = (WanA14BTesterConfig, QwenImageTesterConfig)


# ------------------------------------------------------------------------------------------- feature mixins


class ModuleOffloadTesterMixin:
    """`--enable-cpu-offload`: the same latents, one expert on the device at a time, and each layer computes
    only while its expert is there."""

    def test_module_offload_leaves_latents_unchanged(self: Any, model_dir: Path, reference: Reference) -> None:
        offloaded = self.build_denoiser(model_dir, torch.float32, ModelOptions(offload="module"))
        latents, calls = denoise_counting(self, offloaded)
        assert calls == self.forwards_per_expert and torch.equal(latents, reference.latents)

        # The one offloader apply_model_options shares between the experts, observed through a whole request.
        denoiser = self.build_denoiser(model_dir, torch.float32)
        offloader = ModuleOffloader(CPU)
        experts = denoiser.experts
        for expert in experts:
            apply_offload(expert, "module", CPU, offloader=offloader)
        counter = ResidencyCounter(list(offloader.units.values()), experts, CPU)
        assert counter.onloaded == set()  # waits in CPU memory until its first forward
        latents, calls = denoise_counting(self, denoiser)
        print(f"module offload: {counter.onloads} onloads, {counter.offloads} offloads, {counter.leaf_calls} calls")
        assert calls == self.forwards_per_expert and torch.equal(latents, reference.latents)
        assert counter.violations == [] and counter.leaf_calls > 0
        assert counter.max_resident_blocks == 1
        # Each expert comes on once and replaces the one before: the steps of one expert move nothing.
        assert (counter.onloads, counter.offloads) == (len(experts), len(experts) - 1)
        assert offloader.active is offloader.units[experts[-1]]
        offloader.offload_all()
        assert counter.resident_blocks == 0
        counter.close()


class LayerwiseOffloadTesterMixin:
    """`--enable-layerwise-offload`: the same latents, at most N blocks resident across all experts."""

    @pytest.mark.parametrize("blocks", [1, 2])
    def test_layerwise_offload_keeps_at_most_n_blocks_resident(
        self: Any, model_dir: Path, reference: Reference, blocks: int
    ) -> None:
        options = ModelOptions(offload="layerwise", offload_blocks=blocks)
        denoiser = self.build_denoiser(model_dir, torch.float32, options)
        expert_blocks = [list(getattr(expert, self.blocks_attribute)) for expert in denoiser.experts]
        units = [group_offload_units(expert) for expert in denoiser.experts]
        for expert_units, own_blocks in zip(units, expert_blocks, strict=True):
            # One group per `blocks` transformer blocks, plus the parameters outside them.
            assert len(expert_units) == math.ceil(len(own_blocks) / blocks) + 1
        all_blocks = [block for own_blocks in expert_blocks for block in own_blocks]
        counter = ResidencyCounter([unit for expert_units in units for unit in expert_units], all_blocks, CPU)
        assert counter.onloaded == set()

        latents, calls = denoise_counting(self, denoiser)
        difference = (latents - reference.latents).abs().max().item()
        print(
            f"layerwise {blocks} block(s): max abs diff {difference:.2e}, at most {counter.max_resident_blocks} "
            f"blocks resident, {counter.onloads} onloads, expert calls {calls}"
        )
        assert calls == self.forwards_per_expert and torch.equal(latents, reference.latents)
        assert counter.violations == [] and counter.leaf_calls > 0
        # Across all experts at once.
        assert counter.max_resident_blocks == min(blocks, max(len(own_blocks) for own_blocks in expert_blocks))
        assert counter.onloaded == set()  # offloaded again after each forward
        # Each forward of an expert moves each of its groups once.
        expected = sum(len(expert_units) * n for expert_units, n in zip(units, calls, strict=True))
        assert counter.onloads == counter.offloads == expected
        counter.close()


class QuantizationTesterMixin:
    """`--quantization fp8|int8` (and `--ignored-layers`): bytes, the kept layers' dtypes, latents close to bf16."""

    @pytest.mark.parametrize("backend", ["native", "torchao"])
    @pytest.mark.parametrize("method", ["fp8", "int8"])
    def test_quantize_reports_bytes_and_ignored_layers(self: Any, model_dir: Path, method: str, backend: str) -> None:
        def load() -> torch.nn.Module:
            return self.transformer_class.from_pretrained(model_dir / self.expert_names[0], torch_dtype=torch.bfloat16)

        model = load()
        bf16_bytes = parameter_bytes(model)
        names = linear_layer_names(model)
        report = quantize_transformer(model, method, [], backend=backend)
        print(f"{method} ({backend}): {report.summary()}")
        assert report.quantized == names and report.skipped == []
        assert report.bytes_before == bf16_bytes and report.bytes_after == parameter_bytes(model)
        assert report.bytes_after <= 0.55 * bf16_bytes, report.summary()

        model = load()
        before = {name: weight_storage_dtype(model.get_submodule(name)) for name in names}
        report = quantize_transformer(model, method, list(self.ignored_layers), backend=backend)
        ignored = {name for name in names if self.is_ignored(name)}
        assert ignored and set(report.skipped) == ignored and set(report.quantized) == set(names) - ignored
        for name, dtype in before.items():
            stored = weight_storage_dtype(model.get_submodule(name))
            assert stored == (dtype if name in ignored else expected_storage_dtype(method)), name

    @pytest.mark.parametrize("method", ["fp8", "int8"])
    def test_quantized_denoiser_halves_bytes_and_stays_close(self: Any, model_dir: Path, method: str) -> None:
        """Through the family's denoiser (bf16, the stage's default backend), on every expert."""
        reference = self.build_denoiser(model_dir, torch.bfloat16)
        expected, _ = denoise_counting(self, reference)
        noise = self.initial_noise(reference)
        bf16_bytes = [parameter_bytes(expert) for expert in reference.experts]
        dtypes = [
            {name: weight_storage_dtype(expert.get_submodule(name)) for name in linear_layer_names(expert)}
            for expert in reference.experts
        ]
        change = (expected.float() - noise).norm()
        for ignored in ((), self.ignored_layers):
            options = ModelOptions(quantization=method, ignored_layers=ignored)
            denoiser = self.build_denoiser(model_dir, torch.bfloat16, options)
            for index, expert in enumerate(denoiser.experts):
                if not ignored:
                    ratio = parameter_bytes(expert) / bf16_bytes[index]
                    print(f"{method} expert {index}: parameters at {ratio:.1%} of bf16")
                    assert ratio <= 0.55, f"{method} expert {index}: {ratio:.1%} of the bf16 bytes"
                    continue
                for name, before in dtypes[index].items():
                    stored = weight_storage_dtype(expert.get_submodule(name))
                    kept = self.is_ignored(name)
                    assert stored == (before if kept else expected_storage_dtype(method)), f"{index} {name}: {stored}"
            latents, calls = denoise_counting(self, denoiser)
            relative = ((latents.float() - expected.float()).norm() / change).item()
            print(f"{method} ignoring {list(ignored)}: relative difference of the update {relative:.4f}, calls {calls}")
            assert calls == self.forwards_per_expert
            assert relative < QUANTIZED_LIMIT, f"{method} ignoring {list(ignored)}: relative difference {relative:.4f}"


class LoadingTesterMixin:
    """`--num-weight-load-threads`: the DiT's loader reads every expert with its thread count, and each holds
    exactly the pipeline's (from_pretrained) weights."""

    @pytest.mark.parametrize("load_threads", [1, 4])
    def test_denoiser_loads_like_from_pretrained(
        self: Any, model_dir: Path, request: pytest.FixtureRequest, load_threads: int
    ) -> None:
        pipeline = request.getfixturevalue(self.pipeline_fixture)
        denoiser = self.build_denoiser(model_dir, torch.float32, load_threads=load_threads)
        for name, expert in zip(self.expert_names, denoiser.experts, strict=True):
            assert load_stats(expert).threads == load_threads, name
            assert_same_tensors(expert, getattr(pipeline, name), name)
        if len(denoiser.experts) > 1:
            first, second = (dict(expert.named_parameters()) for expert in denoiser.experts[:2])
            assert not torch.equal(first[self.distinct_weight], second[self.distinct_weight])


# The feature whose supported cells must name a test class that mixes in this mixin (tests/unit/test_families.py).
FEATURE_MIXINS: dict[str, type] = {
    "cpu_offload": ModuleOffloadTesterMixin,
    "layerwise_offload": LayerwiseOffloadTesterMixin,
    "fp8": QuantizationTesterMixin,
    "int8": QuantizationTesterMixin,
    "multithread_loading": LoadingTesterMixin,
}
