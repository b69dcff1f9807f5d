"""LoRA adapters applied per request (`--lora-dir`, dit_svc/lora/): LoRATesterMixin.

A config declares the request its adapters run (`lora_spec`), the linears its test adapters wrap
(`lora_targets`) and the two-rank layouts to run them under (`lora_layouts`). Two adapters, "a" and "b", are
written once per checkpoint by diffusers' own saver (tests/helpers/lora_adapters.py); one rank's run of every
adapter case is made once and shared: the parallel layouts of every config run in one spawn of two ranks
(tests/integration/test_lora.py, `rank_runs`) and compare with it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from dit_svc.denoise import denoise_request, make_adapter_cache
from dit_svc.lora import LoraSettings
from dit_svc.model_options import ModelOptions
from families.registry import FAMILIES
from tests.helpers.feature_mixins.base import FamilyTesterConfig
from tests.helpers.lora_adapters import write_adapter

TOLERANCE = 1e-4
# One adapter, two at different scales (one negative), scale 0, then none: the base model again.
CASES: list[tuple[tuple[str, float], ...]] = [(("a", 1.0),), (("a", 0.7), ("b", -0.5)), (("a", 0.0),), ()]
# The cases the parallel layouts run: two adapters, then none.
PARALLEL_CASES = (1, 3)


@dataclasses.dataclass
class OneRank:
    """One rank's run of a config's adapters on `denoiser`: the base model's latents before any adapter, each
    of CASES in order, and the adapter cache's misses and hits after them."""

    denoiser: Any
    base: torch.Tensor
    results: list[torch.Tensor]
    misses: int
    hits: int


_ADAPTERS: dict[tuple[str, str], Path] = {}
_ONE_RANK: dict[tuple[str, str], OneRank] = {}


def lora_dir(config: FamilyTesterConfig, model_dir: Path, request: pytest.FixtureRequest) -> Path:
    """The directory of the config's adapters "a" and "b" (seeds 0 and 1), written once per checkpoint."""
    key = (config.family, str(model_dir))
    if key not in _ADAPTERS:
        directory = request.getfixturevalue("tmp_path_factory").mktemp("lora") / config.family
        for seed, name in enumerate(("a", "b")):
            write_adapter(
                model_dir,
                directory / f"{name}.safetensors",
                pipeline=config.pipeline_class.__name__,
                transformer_class=config.transformer_class.__name__,
                targets=list(config.lora_targets),
                seed=seed,
            )
        _ADAPTERS[key] = directory
    return _ADAPTERS[key]


def adapter_loader(config: FamilyTesterConfig) -> str:
    """The loader the DiT stage reads the family's adapters with (its own, or its pipeline's)."""
    return FAMILIES[config.family].lora_loader or config.pipeline_class.__name__


def lora_options(config: FamilyTesterConfig, directory: Path) -> ModelOptions:
    return ModelOptions(lora=LoraSettings(directory=directory, pipeline=adapter_loader(config)))


def adapter_run(config: FamilyTesterConfig, denoiser: Any, adapters: Any, loras: tuple) -> torch.Tensor:
    """The latents of the config's `lora_spec` with `loras`, as the DiT stage runs a request."""
    spec = dataclasses.replace(config.lora_spec, loras=loras)
    conditioning = config.conditioning(denoiser, spec)
    latents, _ = denoise_request(
        denoiser, spec, conditioning, lambda step, total: None, lambda: False, adapters=adapters
    )
    return latents


def one_rank_runs(config: FamilyTesterConfig, model_dir: Path, directory: Path) -> OneRank:
    """The config's `OneRank`, once per checkpoint."""
    key = (config.family, str(model_dir))
    if key not in _ONE_RANK:
        options = lora_options(config, directory)
        denoiser = config.build_denoiser(model_dir, torch.float32, options)
        adapters = make_adapter_cache(denoiser, options)
        base = adapter_run(config, denoiser, adapters, ())
        results = [adapter_run(config, denoiser, adapters, loras) for loras in CASES]
        _ONE_RANK[key] = OneRank(denoiser, base, results, adapters.misses, adapters.hits)
    return _ONE_RANK[key]


def rank_runs(
    rank: int, world_size: int, cases: list[tuple[type[FamilyTesterConfig], str, str]]
) -> dict[str, dict[str, list[torch.Tensor]]]:
    """On one rank: by family and layout name, the latents of PARALLEL_CASES under each of the config's
    `lora_layouts`, with the adapters of the directory given."""
    results: dict[str, dict[str, list[torch.Tensor]]] = {}
    for config_class, model_dir, directory in cases:
        config = config_class()
        options = lora_options(config, Path(directory))
        results[config.family] = {}
        for name, layout in config.lora_layouts:
            denoiser = config.build_denoiser(Path(model_dir), torch.float32, options, parallel=layout)
            adapters = make_adapter_cache(denoiser, options)
            latents = [adapter_run(config, denoiser, adapters, CASES[index]) for index in PARALLEL_CASES]
            results[config.family][name] = latents
    return results


class LoRATesterMixin:
    """`--lora-dir` and a request's `loras`: one adapter, two at different scales (one negative), scale 0 and
    none, each as the diffusers pipeline computes it with `load_lora_weights` and `set_adapters`; scale 0 and
    the request after the adapters equal the base model exactly, and each adapter file is read once. `--lora a:1.0`
    (fused into the weights at startup) equals the adapter applied per request, with no LoRA layer left."""

    def test_adapters_equal_diffusers_set_adapters(self: Any, request: pytest.FixtureRequest, model_dir: Path) -> None:
        directory = lora_dir(self, model_dir, request)
        one_rank = one_rank_runs(self, model_dir, directory)
        base, results = one_rank.base, one_rank.results
        assert torch.equal(results[2], base), "scale 0 must leave the base model's output"
        assert torch.equal(results[3], base), "a request without adapters after some must get the base model"
        assert (results[0] - base).abs().max() > 1e-2, "the adapter must change the output"
        assert (results[1] - results[0]).abs().max() > 1e-2
        assert (one_rank.misses, one_rank.hits) == (2, 2), "a and b each read once, then reused"
        for loras, latents in zip(CASES[:2], results[:2], strict=True):
            pipeline = self.pipeline_class.from_pretrained(model_dir)
            for name in ("a", "b"):
                pipeline.load_lora_weights(str(directory / f"{name}.safetensors"), adapter_name=name)
            pipeline.set_adapters([name for name, _ in loras], [scale for _, scale in loras])
            expected = self.pipeline_run(pipeline, one_rank.denoiser, dataclasses.replace(self.lora_spec, loras=loras))
            difference = (latents.reshape(expected.shape) - expected).abs().max().item()
            print(f"{self.family} {loras}: max abs diff {difference:.2e} against the pipeline")
            assert difference <= TOLERANCE, (loras, difference)

    def test_a_fused_adapter_equals_it_per_request(self: Any, request: pytest.FixtureRequest, model_dir: Path) -> None:
        directory = lora_dir(self, model_dir, request)
        per_request = one_rank_runs(self, model_dir, directory).results[0]
        options = ModelOptions(
            lora=LoraSettings(directory=directory, pipeline=adapter_loader(self), fused=CASES[0], max_per_request=0)
        )
        fused = self.build_denoiser(model_dir, torch.float32, options)
        assert make_adapter_cache(fused, options) is None
        assert not any("lora" in name for expert in fused.experts for name, _ in expert.named_parameters())
        difference = (adapter_run(self, fused, None, ()) - per_request).abs().max().item()
        print(f"{self.family} adapter fused at {CASES[0]}: max abs diff {difference:.2e} against it per request")
        assert difference <= TOLERANCE
