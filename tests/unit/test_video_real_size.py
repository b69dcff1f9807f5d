"""The video families' real-size presets (`*-config`) are the published checkpoints' sizes: each component built on
the meta device has the published parameter count (within 1%), and the checkpoint reader takes the configs as the
published 480p model's. Writing them (about 33 GB) is bench/video_families.py's, with the loads and the memory guard
beside them (BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from families.hunyuanvideo_15.checkpoint import read_image_to_video_geometry
from families.hunyuanvideo_15.init_model import GUIDANCE_SCALE
from families.hunyuanvideo_15.real_size import I2V_PRESET, REAL_BYT5_CONFIG, T2V_PRESET, real_size_builders
from families.init_model import init_model
from families.registry import FAMILIES

# Published parameter counts: HunyuanVideo 1.5's 8.3B DiT (its model card); Qwen2.5-7B's 6.53B non-embedding
# parameters (its model card; Qwen2.5-VL-7B's language model has its layout), so the text model is that plus its
# 152064 x 3584 embedding; SigLIP so400m's vision tower with its attention-pooling head, 428M (timm's
# vit_so400m_patch14_siglip_224 card; 384 pixels add 473 position rows of 1152).
TRANSFORMER = 8.3e9
QWEN_NON_EMBEDDING = 6.53e9
SIGLIP = 428e6 + (729 - 256) * 1152
# google/byt5-small, encoder, 4-layer decoder and head over ByT5's 384 ids: 300M (the ByT5 paper's Table 1).
BYT5_SMALL = 300e6


def parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def built(preset: str) -> dict[str, torch.nn.Module]:
    with torch.device("meta"):
        return {name: build() for name, build in real_size_builders(preset).items()}


def near(count: int, published: float) -> bool:
    return abs(count - published) <= 0.01 * published


@pytest.mark.parametrize(("family", "preset"), [("hunyuanvideo-1.5", T2V_PRESET), ("hunyuanvideo-1.5-i2v", I2V_PRESET)])
def test_hunyuanvideo_15_components_have_the_published_sizes(family: str, preset: str) -> None:
    assert preset in FAMILIES[family].own_presets
    components = built(preset)
    image_to_video = preset == I2V_PRESET
    expected = {"text_encoder", "text_encoder_2", "transformer", "vae"}
    assert set(components) == (expected | {"image_encoder"} if image_to_video else expected)

    transformer = components["transformer"]
    assert near(parameters(transformer), TRANSFORMER), parameters(transformer)
    assert transformer.config.task_type == ("i2v" if image_to_video else "t2v")

    qwen = components["text_encoder"]
    embedding = qwen.config.vocab_size * qwen.config.hidden_size
    assert qwen.config.vocab_size == 152064 and qwen.config.hidden_size == transformer.config.text_embed_dim
    assert near(parameters(qwen) - embedding, QWEN_NON_EMBEDDING), parameters(qwen)
    assert qwen.config.rope_parameters["mrope_section"] == [16, 24, 24]

    byt5 = components["text_encoder_2"]
    assert byt5.config.vocab_size == 1510 and byt5.config.d_model == transformer.config.text_embed_2_dim
    assert byt5.shared.weight is byt5.encoder.embed_tokens.weight  # one table, saved once

    vae = components["vae"].config
    assert (vae.latent_channels, vae.spatial_compression_ratio, vae.temporal_compression_ratio) == (32, 16, 4)
    assert vae.scaling_factor == 1.03682 and 2 * vae.latent_channels + 1 == transformer.config.in_channels

    if image_to_video:
        siglip = components["image_encoder"]
        assert near(parameters(siglip), SIGLIP), parameters(siglip)
        assert siglip.config.hidden_size == transformer.config.image_embed_dim
        assert (siglip.config.image_size // siglip.config.patch_size) ** 2 == 729


def test_the_glyph_encoder_is_byt5_small_with_the_glyph_vocabulary() -> None:
    """The same dimensions with byt5-small's 384 ids and its 4-layer decoder make its published 300M."""
    from transformers import T5Config, T5ForConditionalGeneration

    small = {**REAL_BYT5_CONFIG, "vocab_size": 384, "is_encoder_decoder": True, "num_decoder_layers": 4}
    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(**small))
    assert near(parameters(model), BYT5_SMALL), parameters(model)


def test_the_reader_takes_the_published_480p_defaults() -> None:
    components = built(I2V_PRESET)
    configs = {
        "vae": dict(components["vae"].config),
        "transformer": dict(components["transformer"].config),
        "guider": {"guidance_scale": GUIDANCE_SCALE},
    }
    geometry = read_image_to_video_geometry(configs)
    defaults = geometry["defaults"]
    assert (defaults.height, defaults.width, defaults.guidance_scale) == (480, 848, 6.0)
    assert geometry["latent_channels"] == 32 and geometry["image_size_base"] == 640


def test_each_family_takes_only_its_own_real_size_preset(tmp_path: Path) -> None:
    for family, preset in (("hunyuanvideo-1.5", I2V_PRESET), ("hunyuanvideo-1.5-i2v", T2V_PRESET)):
        with pytest.raises(ValueError, match=f"unknown preset '{preset}' for {family}"):
            init_model(family, preset, tmp_path / family)
        assert not (tmp_path / family).exists()
    with pytest.raises(ValueError, match="not a HunyuanVideo 1.5 real-size preset"):
        real_size_builders("flux.1-dev-config")
