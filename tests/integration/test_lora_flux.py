"""FLUX.1's community LoRA formats on the DiT, read through diffusers' own FluxPipeline conversion: kohya's
sd-scripts files, ComfyUI's (BFL's module names with kohya's lora_down/lora_up and alphas), XLabs', and
diffusers' own names with an alpha per layer (which the loader hands over as network alphas), each equal to
FluxPipeline with `load_lora_weights` of the same file and `set_adapters`; BFL's names with PEFT's lora_A/lora_B,
which diffusers 0.42.1 leaves unconverted and the family's loader (families/flux/lora.py) reads as ComfyUI's
layout; an alpha that is not a number, refused by name; and a community adapter fused at startup (--lora) equal
to it applied per request.

Adapters in diffusers' own format, under the parallel layouts, are LoRATesterMixin's (TestFluxLoRA in
tests/integration/test_family_features.py and tests/integration/test_lora.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from diffusers import FluxPipeline

from dit_svc.denoise import make_adapter_cache
from dit_svc.lora import AdapterCache, AdapterError, LoraSettings
from dit_svc.model_options import ModelOptions
from tests.helpers.feature_mixins import FluxTesterConfig
from tests.helpers.feature_mixins.lora import adapter_run, lora_options
from tests.helpers.lora_adapters import FLUX_FORMATS, flux_community_adapter

# FluxPipeline's latents and ours run the same operations: the bound is float32 rounding, not an approximation.
TOLERANCE = 1e-5
# The formats diffusers converts, each at its own scale.
CONVERTED = {"kohya": 0.8, "comfyui": -0.6, "xlabs": 1.0, "peft-alphas": 0.5}


@pytest.fixture(scope="module")
def community_dir(flux_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One adapter per format, named after it, each drawn from its own seed."""
    directory = tmp_path_factory.mktemp("flux-community-loras")
    for seed, layout in enumerate(FLUX_FORMATS):
        flux_community_adapter(flux_model, directory / f"{layout}.safetensors", layout, seed=seed)
    return directory


@dataclasses.dataclass
class PerRequest:
    """Our DiT's runs of the config's `lora_spec` with the community adapters: the base model's latents, then
    each converted format's at its scale (shared by the module's tests)."""

    denoiser: Any
    adapters: AdapterCache
    base: torch.Tensor
    latents: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def per_request(flux_model: Path, community_dir: Path) -> PerRequest:
    config = FluxTesterConfig()
    options = lora_options(config, community_dir)
    denoiser = config.build_denoiser(flux_model, torch.float32, options)
    adapters = make_adapter_cache(denoiser, options)
    assert adapters is not None
    base = adapter_run(config, denoiser, adapters, ())
    latents = {
        layout: adapter_run(config, denoiser, adapters, ((layout, scale),)) for layout, scale in CONVERTED.items()
    }
    return PerRequest(denoiser, adapters, base, latents)


def test_community_flux_adapters_equal_diffusers_conversion(flux_model: Path, per_request: PerRequest) -> None:
    """Each converted format changes the latents, which equal FluxPipeline's with the same file loaded and set
    at the same scale; BFL's lora_A/lora_B file equals the ComfyUI file of the same weights."""
    config, directory = FluxTesterConfig(), per_request.adapters.settings.directory
    assert directory is not None
    pipeline = FluxPipeline.from_pretrained(flux_model)
    for layout in CONVERTED:
        pipeline.load_lora_weights(str(directory / f"{layout}.safetensors"), adapter_name=layout)
    for layout, scale in CONVERTED.items():
        latents = per_request.latents[layout]
        assert (latents - per_request.base).abs().max() > 1e-2, f"the {layout} adapter must change the output"
        pipeline.set_adapters([layout], [scale])
        expected = config.pipeline_run(pipeline, per_request.denoiser, config.lora_spec)
        difference = (latents - expected).abs().max().item()
        print(f"flux {layout} adapter at {scale}: max abs diff {difference:.2e} against FluxPipeline")
        assert difference <= TOLERANCE, (layout, difference)
    adapters = per_request.adapters
    # BFL's names with PEFT's lora_A/lora_B, which FluxPipeline's converter leaves as they are and the family's
    # loader renames into ComfyUI's layout with an alpha of the rank. Drawn from ComfyUI's seed, whose alpha is
    # twice the rank, it is the ComfyUI adapter at half the strength.
    path = flux_community_adapter(flux_model, directory / "bfl.safetensors", "bfl-peft", FLUX_FORMATS.index("comfyui"))
    unconverted = FluxPipeline.lora_state_dict(safetensors.torch.load_file(str(path)))
    assert all(".lora_A." in key or ".lora_B." in key for key in unconverted), "diffusers converts it now"
    bfl = adapter_run(config, per_request.denoiser, adapters, (("bfl", 2 * CONVERTED["comfyui"]),))
    difference = (bfl - per_request.latents["comfyui"]).abs().max().item()
    print(f"flux BFL lora_A/lora_B adapter: max abs diff {difference:.2e} against ComfyUI's at half the scale")
    assert difference <= TOLERANCE
    state = safetensors.torch.load_file(str(directory / "peft-alphas.safetensors"))
    key = next(key for key in state if key.endswith(".alpha"))
    safetensors.torch.save_file({**state, key: torch.tensor(float("nan"))}, str(directory / "nan-alpha.safetensors"))
    with pytest.raises(AdapterError, match=f"lora 'nan-alpha': {key} is not one finite number"):
        adapters.check((("nan-alpha", 1.0),))
    assert list(adapters.loaded) == [*CONVERTED, "bfl"]
    assert torch.equal(adapter_run(config, per_request.denoiser, adapters, ()), per_request.base)


def test_a_fused_community_flux_adapter_equals_it_per_request(flux_model: Path, per_request: PerRequest) -> None:
    """--lora kohya:0.8 fuses the kohya adapter, converted by FluxPipeline, into the weights: the latents of the
    adapter applied per request at 0.8, and no LoRA layer left in the transformer."""
    config = FluxTesterConfig()
    fused_options = ModelOptions(
        lora=LoraSettings(
            directory=per_request.adapters.settings.directory,
            pipeline="families.flux.lora:FluxLoraLoader",
            fused=(("kohya", CONVERTED["kohya"]),),
            max_per_request=0,
        )
    )
    fused = config.build_denoiser(flux_model, torch.float32, fused_options)
    assert make_adapter_cache(fused, fused_options) is None
    assert not any("lora" in name for name, _ in fused.transformer.named_parameters())
    difference = (adapter_run(config, fused, None, ()) - per_request.latents["kohya"]).abs().max().item()
    print(f"flux kohya adapter fused at {CONVERTED['kohya']}: max abs diff {difference:.2e} against it per request")
    assert difference <= 1e-4
