"""Weight-only fp8/int8 quantization of the DiT: memory, which layers, accuracy, flag validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch import nn

from dit_svc.quantization import (
    METHODS,
    expected_storage_dtype,
    linear_layer_names,
    parameter_bytes,
    quantize_transformer,
    validate_quantization_flags,
    weight_storage_dtype,
)
from families.wan.components import build_transformer

BACKENDS = [
    "native",
    "torchao",  # a declared dependency: its absence is a failure, not a skip
]
IGNORED = ["proj_out", "blocks.0.*", "condition_embedder.*"]


@pytest.fixture(scope="module")
def transformer_dirs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoint's transformer, and a small one saved alone (the rest of a small checkpoint is not needed)."""
    small = tmp_path_factory.mktemp("small-transformer")
    torch.manual_seed(0)
    build_transformer("small").save_pretrained(small)
    return {"tiny": tiny_model / "transformer", "small": small}


def load(path: Path, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    # from_pretrained keeps the model's _keep_in_fp32_modules in float32, as the DiT stage loads it.
    return WanTransformer3DModel.from_pretrained(path, torch_dtype=dtype).eval()


def forward_inputs(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    config = model.config
    return dict(
        hidden_states=torch.randn(1, config.in_channels, 3, 16, 16, generator=generator).to(dtype),
        timestep=torch.tensor([700]),
        encoder_hidden_states=torch.randn(1, 12, config.text_dim, generator=generator).to(dtype),
        return_dict=False,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_parameter_bytes_at_most_55_percent_of_bf16(
    transformer_dirs: dict[str, Path], preset: str, method: str, backend: str
) -> None:
    model = load(transformer_dirs[preset])
    bf16_bytes = parameter_bytes(model)
    names = linear_layer_names(model)
    report = quantize_transformer(model, method, [], backend=backend)
    assert report.bytes_before == bf16_bytes
    assert report.bytes_after == parameter_bytes(model)
    assert report.bytes_after <= 0.55 * bf16_bytes, report.summary()
    assert report.quantized == names and report.skipped == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_ignored_layers_keep_their_dtype(transformer_dirs: dict[str, Path], method: str, backend: str) -> None:
    model = load(transformer_dirs["tiny"])
    before = {name: model.get_submodule(name).weight.dtype for name in linear_layer_names(model)}
    assert {torch.bfloat16, torch.float32} <= set(before.values())  # the fp32-kept time embedder is ignored too
    report = quantize_transformer(model, method, IGNORED, backend=backend)

    ignored = {n for n in before if n == "proj_out" or n.startswith(("blocks.0.", "condition_embedder."))}
    assert set(report.skipped) == ignored and set(report.quantized) == set(before) - ignored
    for name, dtype in before.items():
        stored = weight_storage_dtype(model.get_submodule(name))
        assert stored == (dtype if name in ignored else expected_storage_dtype(method)), name
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_quantized_forward_close_to_unquantized(
    transformer_dirs: dict[str, Path], preset: str, method: str, backend: str
) -> None:
    model = load(transformer_dirs[preset])
    inputs = forward_inputs(model, torch.bfloat16)
    with torch.no_grad():
        expected = model(**inputs)[0].float()
        quantize_transformer(model, method, [], backend=backend)
        actual = model(**inputs)[0].float()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    # bf16 itself moves the output by ~0.5%; 8-bit weights add at most a few percent.
    relative = ((actual - expected).norm() / expected.norm()).item()
    assert relative < (0.05 if method == "fp8" else 0.02), relative


def test_bad_method_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'fp4' is not a method; use one of fp8, int8"):
        validate_quantization_flags("fp4", [], ["proj_out"])


def test_pattern_matching_nothing_is_refused(transformer_dirs: dict[str, Path]) -> None:
    model = load(transformer_dirs["tiny"])
    names = linear_layer_names(model)
    with pytest.raises(ValueError, match=r"pattern 'blocks.9.\*' matches no linear layer; layers look like: ") as err:
        validate_quantization_flags("int8", ["proj_out", "blocks.9.*"], names)
    assert names[0] in str(err.value)
    with pytest.raises(ValueError, match="pattern 'x' matches no linear layer"):
        quantize_transformer(model, "fp8", ["x"])
    assert weight_storage_dtype(model.proj_out) == torch.bfloat16  # refused before touching the model


def test_ignored_layers_without_a_method_are_refused() -> None:
    with pytest.raises(ValueError, match="--ignored-layers needs --quantization; use one of fp8, int8"):
        validate_quantization_flags(None, ["proj_out"], ["proj_out"])
    validate_quantization_flags(None, [], ["proj_out"])
    validate_quantization_flags("fp8", ["blocks.0", "proj_*"], ["blocks.0.attn1.to_q", "proj_out"])


def test_a_torchao_that_does_not_import_falls_back_to_the_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed but built for another torch: `auto` must serve with the native kernels rather than crash."""
    import importlib

    from dit_svc import quantization

    real_import = importlib.import_module

    def failing_import(name: str, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("undefined symbol: built for another torch")
        return real_import(name, *args, **kwargs)

    quantization.torchao_available.cache_clear()
    monkeypatch.setattr(importlib, "import_module", failing_import)
    try:
        assert quantization.torchao_available() is False
        assert quantization._resolve_backend("auto") == "native"
        with pytest.raises(ValueError, match="needs the torchao package"):
            quantization._resolve_backend("torchao")
    finally:
        monkeypatch.undo()
        quantization.torchao_available.cache_clear()
    assert quantization.torchao_available() is True, "the real torchao imports here"
