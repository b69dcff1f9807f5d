"""`--quantization fp8|int8` and `--ignored-layers`: QuantizationTesterMixin."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dit_svc.model_options import ModelOptions
from dit_svc.quantization import (
    expected_storage_dtype,
    linear_layer_names,
    parameter_bytes,
    quantize_transformer,
    weight_storage_dtype,
)
from tests.helpers.feature_mixins.base import FamilyTesterConfig, denoise_counting

# Relative to what the steps changed (latents - noise), so the noise itself does not hide the error: bf16 alone
# moves that change by a few percent against fp32; 8-bit weights may add a few percent more.


@dataclass(frozen=True)
class Bf16Reference:
    """The unquantized bf16 run the quantized ones are compared with: its latents, the seed's noise, each
    expert's parameter bytes and the storage dtype of each of its linear layers."""

    latents: torch.Tensor
    noise: torch.Tensor
    expert_bytes: list[int]
    dtypes: list[dict[str, torch.dtype]]


_BF16_REFERENCES: dict[tuple[str, str], Bf16Reference] = {}


def bf16_reference_run(config: FamilyTesterConfig, model_dir: Path) -> Bf16Reference:
    """Run once per checkpoint, for every method."""
    key = (config.family, str(model_dir))
    if key not in _BF16_REFERENCES:
        denoiser = config.build_denoiser(model_dir, torch.bfloat16)
        latents, _ = denoise_counting(config, denoiser)
        _BF16_REFERENCES[key] = Bf16Reference(
            latents.float(),
            config.initial_noise(denoiser),
            [parameter_bytes(expert) for expert in denoiser.experts],
            [
                {name: weight_storage_dtype(expert.get_submodule(name)) for name in linear_layer_names(expert)}
                for expert in denoiser.experts
            ],
        )
    return _BF16_REFERENCES[key]


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
        assert report.bytes_after <= self.max_quantized_fraction * bf16_bytes, report.summary()

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
        reference = bf16_reference_run(self, model_dir)
        change = (reference.latents - reference.noise).norm()
        for ignored in ((), self.ignored_layers):
            options = ModelOptions(quantization=method, ignored_layers=ignored)
            denoiser = self.build_denoiser(model_dir, torch.bfloat16, options)
            for index, expert in enumerate(denoiser.experts):
                if not ignored:
                    ratio = parameter_bytes(expert) / reference.expert_bytes[index]
                    print(f"{method} expert {index}: parameters at {ratio:.1%} of bf16")
                    assert ratio <= self.max_quantized_fraction, (
                        f"{method} expert {index}: {ratio:.1%} of the bf16 bytes"
                    )
                    continue
                for name, before in reference.dtypes[index].items():
                    stored = weight_storage_dtype(expert.get_submodule(name))
                    kept = self.is_ignored(name)
                    assert stored == (before if kept else expected_storage_dtype(method)), f"{index} {name}: {stored}"
            latents, calls = denoise_counting(self, denoiser)
            relative = ((latents.float() - reference.latents).norm() / change).item()
            print(f"{method} ignoring {list(ignored)}: relative difference of the update {relative:.4f}, calls {calls}")
            assert calls == self.forwards_per_expert
            limit = self.quantized_limit
            assert relative < limit, f"{method} ignoring {list(ignored)}: relative difference {relative:.4f}"
