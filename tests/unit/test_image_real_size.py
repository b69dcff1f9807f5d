"""The image families' real-size presets (`*-config`) are the published checkpoints' sizes: each component built
on the meta device has the published parameter count (within 1%), and the checkpoint reader takes the configs
as those of the family's variant. Writing them (tens of GB) is bench/image_families.py's, with the loads and the
memory guard beside them (BENCHMARKS.md)."""

from __future__ import annotations

import importlib

import pytest
import torch

from families.registry import FAMILIES

# Published parameter counts: FLUX.1 12B with T5-XXL's 4.76B encoder and CLIP-L's 123M; Z-Image 6.15B with
# Qwen3-4B (4.02B without its tied head); FLUX.2 klein 4B (3.88B) with the same Qwen3-4B.
PUBLISHED = {
    "flux.1-dev-config": {"transformer": 11.90e9, "text_encoder_2": 4.76e9, "text_encoder": 0.123e9},
    "flux.1-schnell-config": {"transformer": 11.90e9, "text_encoder_2": 4.76e9, "text_encoder": 0.123e9},
    "z-image-turbo-config": {"transformer": 6.15e9, "text_encoder": 4.02e9},
    "flux2-klein-4b-config": {"transformer": 3.88e9, "text_encoder": 4.02e9},
}
MODULES = {
    "flux.1-dev-config": ("flux", "families.flux.real_size"),
    "flux.1-schnell-config": ("flux", "families.flux.real_size"),
    "z-image-turbo-config": ("z-image", "families.z_image.real_size"),
    "flux2-klein-4b-config": ("flux2-klein", "families.flux2_klein.real_size"),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_real_size_components_have_the_published_sizes(preset: str) -> None:
    family, module = MODULES[preset]
    assert preset in FAMILIES[family].own_presets
    builders = importlib.import_module(module).real_size_builders(preset)
    assert {"transformer", "vae"} <= set(builders)
    for name, expected in PUBLISHED[preset].items():
        with torch.device("meta"):
            built = builders[name]()
        parameters = sum(p.numel() for p in built.parameters())
        assert abs(parameters - expected) <= 0.01 * expected, (name, parameters)
    with torch.device("meta"):
        transformer = builders["transformer"]()
    # dev is guidance-distilled, schnell and klein are not.
    assert getattr(transformer.config, "guidance_embeds", False) == (preset == "flux.1-dev-config")
