"""`--quantization gguf` (each expert a GGUF file, as published quantized checkpoints are): GGUFTesterMixin."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import GGUFQuantizationConfig

from dit_svc.config import DitConfig
from dit_svc.model_options import ModelOptions
from families.gguf import convert_checkpoint
from families.registry import FAMILIES
from stagekit.gguf import gguf_file
from tests.helpers.feature_mixins.base import FamilyTesterConfig, Reference, denoise_counting
from tests.helpers.serving import parse_serve

TOLERANCE = 1e-4
# Bytes of the blocks' linear weights against float32's: 32 weights in 34 bytes for Q8_0, 18 for Q4_0, 128 in
# float32; and how far the latents may move from the float32 model's, relative to their norm.
BYTES_RATIO = {"Q8_0": 34 / 128, "Q4_0": 18 / 128}
LATENTS_LIMIT = {"Q8_0": 0.01, "Q4_0": 0.1}

_CHECKPOINTS: dict[tuple[str, str], Path] = {}


def gguf_checkpoint(
    config: FamilyTesterConfig, model_dir: Path, quant_type: str, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A copy of the config's checkpoint with every expert converted to a GGUF file of `quant_type`, written
    once per session."""
    key = (config.family, quant_type)
    if key not in _CHECKPOINTS:
        out = tmp_path_factory.mktemp("gguf") / f"{config.family}-{quant_type}"
        shutil.copytree(model_dir, out)
        written = convert_checkpoint(out, FAMILIES[config.family], quant_type)
        assert len(written) == len(config.expert_names), written
        _CHECKPOINTS[key] = out
    return _CHECKPOINTS[key]


class GGUFTesterMixin:
    """`--quantization gguf`, chosen by the files: the denoiser on the GGUF files equals the diffusers pipeline
    with each expert loaded by `from_single_file` (GGUFQuantizationConfig), every expert running its forwards;
    the blocks' linear weights stay packed, and the latents stay near the float32 model's. For each of the
    config's `gguf_types`."""

    def test_gguf_denoiser_equals_diffusers_from_single_file(
        self: Any, model_dir: Path, reference: Reference, request: pytest.FixtureRequest, gguf_type: str
    ) -> None:
        model = gguf_checkpoint(self, model_dir, gguf_type, request.getfixturevalue("tmp_path_factory"))
        # The stage takes the files' quantization without a flag.
        assert DitConfig.from_args(parse_serve(["dit", "--model", str(model)])).options.quantization == "gguf"
        experts = {
            name: self.transformer_class.from_single_file(
                str(gguf_file(model / name)),
                config=str(model),
                subfolder=name,
                quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
                torch_dtype=torch.float32,
            )
            for name in self.expert_names
        }
        denoiser = self.build_denoiser(model, torch.float32, ModelOptions(quantization="gguf"))
        actual, calls = denoise_counting(self, denoiser)
        assert calls == self.forwards_per_expert, f"{gguf_type}: expert calls {calls}"
        expected = self.pipeline_latents(model, denoiser, experts)
        difference = (actual - expected).abs().max().item()
        print(f"{gguf_type}: max abs diff {difference:.2e} against the pipeline")
        assert difference <= TOLERANCE, f"{gguf_type}: max abs difference {difference:.2e}"

        for name, full in zip(self.expert_names, self.reference_experts(request, model_dir), strict=True):
            blocks, full_blocks = getattr(experts[name], self.blocks_attribute), getattr(full, self.blocks_attribute)
            linears = [path for path, module in full_blocks.named_modules() if isinstance(module, torch.nn.Linear)]
            packed = sum(_bytes(blocks.get_submodule(path).weight) for path in linears)
            ratio = packed / sum(_bytes(full_blocks.get_submodule(path).weight) for path in linears)
            assert ratio == pytest.approx(BYTES_RATIO[gguf_type]), f"{name}: {ratio}"
        relative = ((actual - reference.latents).norm() / reference.latents.norm()).item()
        print(f"{gguf_type}: relative difference {relative:.4f} from the float32 latents")
        assert 0 < relative < LATENTS_LIMIT[gguf_type], relative


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
