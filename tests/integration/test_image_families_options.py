"""Offload and quantization on the image-conditioned families: the denoiser the DiT stage serves for each
(WanImageToVideoDenoiser, QwenImageEditDenoiser) with the stage's ModelOptions, on the tiny checkpoints, with
the image conditioning of the parallel tests (Wan's concatenated or overwritten frame latents and CLIP
embedding, Qwen-Image-Edit's image tokens after the noise tokens).

Offload moves weights, never arithmetic: the latents equal the resident denoiser's exactly, and layerwise
offload keeps one block on the device at a time (across both experts of A14B). 8-bit weights halve the
transformers' bytes and keep the latents close to bf16's, measured against what the steps changed.

The startup checks accept every parallel layout and memory option the families claim in docs/features.md and
refuse VAE tiling, naming the family's reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline

from dit_svc.model_options import ModelOptions
from dit_svc.offload import ResidencyCounter, group_offload_units
from dit_svc.quantization import parameter_bytes
from families.init_model import init_model
from families.qwen_image_edit.denoise import QwenImageEditDenoiser
from families.wan_i2v.denoise import WanImageToVideoDenoiser
from stagekit.denoise import DenoiseSpec
from tests.helpers import qwen_image_edit as edit_helpers
from tests.helpers import wan_i2v as wan_helpers

CPU = torch.device("cpu")
# (denoiser class, spec, conditioning of a denoiser for the spec), by family.
CASES = {
    **{
        family: (WanImageToVideoDenoiser, spec, wan_helpers.parallel_conditioning)
        for family, spec in wan_helpers.PARALLEL_SPECS.items()
    },
    **{
        family: (QwenImageEditDenoiser, spec, edit_helpers.parallel_conditioning)
        for family, spec in edit_helpers.PARALLEL_SPECS.items()
    },
}
FAMILY_NAMES = list(CASES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image-family-models")
    return {name: init_model(name, "tiny", root / name, seed=0) for name in FAMILY_NAMES}


def _denoiser(checkpoints: dict[str, Path], family: str, dtype: torch.dtype, options: ModelOptions | None = None):
    denoiser_class = CASES[family][0]
    return denoiser_class(checkpoints[family], CPU, dtype, options=options or ModelOptions())


def _denoise(denoiser, family: str) -> torch.Tensor:
    _, spec, conditioning = CASES[family]
    return denoiser.denoise(spec, conditioning(denoiser, spec), on_step=lambda s, t: None, cancelled=lambda: False)


def _noise(denoiser, spec: DenoiseSpec) -> torch.Tensor:
    """The seed's noise in the shape of the final latents."""
    if isinstance(denoiser, QwenImageEditDenoiser):
        packed = denoiser.initial_noise(spec, torch.float32)
        return QwenImagePipeline._unpack_latents(packed, spec.height, spec.width, denoiser.vae_scale_factor)
    return denoiser.initial_noise(spec)


@pytest.fixture(scope="module")
def fp32_latents(checkpoints) -> dict[str, torch.Tensor]:
    return {family: _denoise(_denoiser(checkpoints, family, torch.float32), family) for family in FAMILY_NAMES}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_module_offload_leaves_latents_unchanged(checkpoints, fp32_latents, family) -> None:
    denoiser = _denoiser(checkpoints, family, torch.float32, ModelOptions(offload="module"))
    assert torch.equal(_denoise(denoiser, family), fp32_latents[family])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_layerwise_offload_keeps_one_block_resident(checkpoints, fp32_latents, family) -> None:
    denoiser = _denoiser(checkpoints, family, torch.float32, ModelOptions(offload="layerwise", offload_blocks=1))
    units = [unit for expert in denoiser.experts for unit in group_offload_units(expert)]
    # The transformer blocks, as each model class declares them (diffusers' `_repeated_blocks`).
    blocks = [
        module
        for expert in denoiser.experts
        for module in expert.modules()
        if type(module).__name__ in expert._repeated_blocks
    ]
    counter = ResidencyCounter(units, blocks, CPU)
    latents = _denoise(denoiser, family)
    print(f"{family}: at most {counter.max_resident_blocks} blocks resident, {counter.onloads} onloads")
    assert torch.equal(latents, fp32_latents[family])
    assert counter.violations == [] and counter.leaf_calls > 0
    assert counter.max_resident_blocks == 1 and counter.onloaded == set()
    counter.close()


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_quantized_denoiser_halves_bytes_and_stays_close(checkpoints, family, method) -> None:
    reference = _denoiser(checkpoints, family, torch.bfloat16)
    expected = _denoise(reference, family).float()
    quantized = _denoiser(checkpoints, family, torch.bfloat16, ModelOptions(quantization=method))
    for index, (before, after) in enumerate(zip(reference.experts, quantized.experts, strict=True)):
        ratio = parameter_bytes(after) / parameter_bytes(before)
        print(f"{family} {method} expert {index}: parameters at {ratio:.1%} of bf16")
        assert ratio <= 0.55, f"expert {index}: {ratio:.1%} of the bf16 bytes"
    # Relative to what the steps changed (latents - noise), so the noise itself does not hide the error;
    # bf16 alone moves that change by a few percent against fp32.
    change = (expected - _noise(reference, CASES[family][1])).norm()
    relative = ((_denoise(quantized, family).float() - expected).norm() / change).item()
    print(f"{family} {method}: relative difference of the denoising update {relative:.4f}")
    assert relative < 0.05, f"{family} {method}: relative difference {relative:.4f}"


# ------------------------------------------------------------------------------- startup checks


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_claimed_dit_options_pass_the_startup_checks(checkpoints, family) -> None:
    """Every parallel layout and memory option the family claims (docs/features.md) passes the DiT's checks."""
    from dit_svc.config import DitConfig
    from tests.helpers.serving import parse_serve

    for flags in (
        ["--ulysses-degree", "2"],
        ["--ring-degree", "2"],
        ["--cfg-parallel-size", "2"],
        ["--tensor-parallel-size", "2"],
        ["--use-hsdp", "--hsdp-shard-size", "2"],
    ):
        DitConfig.from_args(parse_serve(["dit", "--model", str(checkpoints[family]), *flags]))
    for flags in (
        ["--enable-cpu-offload"],
        ["--enable-layerwise-offload"],
        ["--quantization", "fp8"],
        ["--quantization", "int8"],
    ):
        DitConfig.from_args(parse_serve(["dit", "--model", str(checkpoints[family]), *flags]))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_vae_tiling_is_refused_at_startup(checkpoints, family) -> None:
    from families.registry import FAMILIES
    from tests.helpers.serving import parse_serve
    from vae_svc.config import VaeConfig

    assert FAMILIES[family].support("vae_tiling").refused_at_startup
    args = parse_serve(["vae", "--model", str(checkpoints[family]), "--vae-use-tiling"])
    with pytest.raises(SystemExit) as refused:
        VaeConfig.from_args(args)
    assert f"the {family} family does not support" in str(refused.value), str(refused.value)
    assert FAMILIES[family].support("vae_tiling").reason in str(refused.value), str(refused.value)
    VaeConfig.from_args(parse_serve(["vae", "--model", str(checkpoints[family]), "--vae-patch-parallel-size", "2"]))
