"""LTX-2's real-size presets ("ltx-2-config", "ltx-2.3-config": the published configs, random bf16 weights) have
the published sizes, the memory guard counts each stage's components at their parameters' bytes (the connectors in
the text encoder stage, the audio VAE and vocoder in the VAE stage), and the streamed writer they use writes what
`random_bf16` would, shard by shard. Writing them whole (68 and 71 GB) is bench/video_families.py's (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.family_stages import estimate, stage_of
from families.ltx2.encode import LTX2PromptEncoder
from families.ltx2.family import LTX2
from families.ltx2.init_model import write_checkpoint
from families.ltx2.real_size import LTX_2_3_PRESET, LTX_2_PRESET, real_size_builders
from families.real_size import random_bf16, write_streamed
from services.checkpoint import read_checkpoint
from services.memory_budget import RUNTIME_RESERVE_BYTES, text_encoder_components
from stagekit.weights import load_pretrained, planned_bytes
from text_encoder_svc.service import TextEncoderServicer

PRESETS = (LTX_2_PRESET, LTX_2_3_PRESET)
# Parameters: the video VAE, audio VAE and vocoder as counted from diffusers' conversion script's configs (1.22B
# and 0.73B, 53M, 56M and 129M); Gemma-3-12B with its SigLIP tower (12.19B); the published names (ltx-2-19b-dev,
# ltx-2.3-22b-dev) round the rest: LTX-2's 19B is its transformer (18.88B), LTX-2.3's 22B its transformer (18.99B)
# with its connectors (3.17B: a text projection per modality, 8-layer connectors). Which components a name counts
# is not stated with it; the counts agree within 1%.
PUBLISHED = {
    LTX_2_PRESET: {"vae": 1.22e9, "audio_vae": 53e6, "vocoder": 56e6, "named": 19e9},
    LTX_2_3_PRESET: {"vae": 0.73e9, "audio_vae": 53e6, "vocoder": 129e6, "named": 22e9},
}
NAMED = {LTX_2_PRESET: ("transformer",), LTX_2_3_PRESET: ("transformer", "connectors")}
GEMMA_3_12B = 12.19e9


@functools.cache
def built(preset: str) -> dict[str, torch.nn.Module]:
    with torch.device("meta"):
        return {name: build() for name, build in real_size_builders(preset).items()}


def parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def saved_bf16_bytes(module: torch.nn.Module) -> int:
    """Two bytes for each parameter and each saved (persistent) buffer element."""
    names = set(module.state_dict())
    buffers = sum(buffer.numel() for name, buffer in module.named_buffers() if name in names)
    return 2 * (parameters(module) + buffers)


def near(count: int, published: float, tolerance: float = 0.01) -> bool:
    return abs(count - published) <= tolerance * published


@pytest.mark.parametrize("preset", PRESETS)
def test_the_components_have_the_published_sizes(preset: str) -> None:
    assert preset in LTX2.own_presets
    components = built(preset)
    assert set(components) == {"text_encoder", "connectors", "transformer", "vae", "audio_vae", "vocoder"}
    for name in ("vae", "audio_vae", "vocoder"):
        assert near(parameters(components[name]), PUBLISHED[preset][name]), (name, parameters(components[name]))
    named = sum(parameters(components[name]) for name in NAMED[preset])
    assert near(named, PUBLISHED[preset]["named"]), named
    assert near(parameters(components["transformer"]), 19e9), parameters(components["transformer"])
    gemma = components["text_encoder"]
    assert near(parameters(gemma), GEMMA_3_12B), parameters(gemma)

    # The widths agree from one component to the next, as the pipeline chains them.
    text = gemma.config.text_config
    connectors, transformer = components["connectors"].config, components["transformer"].config
    assert connectors.caption_channels == text.hidden_size == transformer.caption_channels == 3840
    assert connectors.text_proj_in_factor == text.num_hidden_layers + 1 == 49
    assert components["vae"].config.latent_channels == transformer.in_channels == 128
    audio = components["audio_vae"].config
    assert audio.latent_channels * audio.mel_bins // 4 == transformer.audio_in_channels == 128
    vocoder = components["vocoder"]
    assert type(vocoder).__name__ == ("LTX2Vocoder" if preset == LTX_2_PRESET else "LTX2VocoderWithBWE")


@pytest.mark.parametrize("preset", PRESETS)
def test_the_guard_counts_each_stage_at_its_parameters_bytes(preset: str) -> None:
    """The connectors count in the text encoder stage, the audio VAE and vocoder in the VAE stage; each component
    at two bytes a saved weight (no module of these classes is kept in fp32)."""
    components = built(preset)
    stages = estimate({name: (lambda module=module: module) for name, module in components.items()})["stages"]
    assert set(stages["text-encoder"]["components"]) == {"text_encoder", "connectors"}
    assert set(stages["dit"]["components"]) == {"transformer"}
    assert set(stages["vae"]["components"]) == {"vae", "audio_vae", "vocoder"}
    for name, module in components.items():
        assert stages[stage_of(name)]["components"][name] == saved_bf16_bytes(module), name
    for stage, verdict in stages.items():
        assert verdict["need_bytes"] == RUNTIME_RESERVE_BYTES + sum(verdict["components"].values()), stage


def test_the_text_encoder_stage_counts_the_connectors(tmp_path: Path) -> None:
    """From a checkpoint's files, as the stage computes its need before it loads: Gemma and the connectors (of
    library "ltx2"), each at the bytes the loader will hold."""
    write_checkpoint(LTX2, tmp_path, "tiny", 0, {})
    runtime = SimpleNamespace(
        checkpoint=read_checkpoint(tmp_path), device=torch.device("cpu"), dtype=torch.bfloat16, stage="text-encoder"
    )
    need = TextEncoderServicer.memory_need(SimpleNamespace(runtime=runtime))  # type: ignore[arg-type]
    assert LTX2PromptEncoder.other_components == ("connectors",)
    components = text_encoder_components(tmp_path, LTX2PromptEncoder.other_components)
    assert set(components) == {"text_encoder", "connectors"}
    assert need.components == {
        name: planned_bytes(cls, folder, dtype=torch.bfloat16) for name, (cls, folder) in components.items()
    }
    assert need.components["connectors"] > 0
    assert set(text_encoder_components(tmp_path)) == {"text_encoder"}


def tiny_gemma() -> torch.nn.Module:
    """A Gemma3ForConditionalGeneration whose head is tied to its embedding, on the meta device."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from families.ltx2.init_model import GEMMA_ROPE, TEXT_ENCODER_CONFIGS, VISION_CONFIG

    text = dict(TEXT_ENCODER_CONFIGS["tiny"], vocab_size=300, rope_parameters=GEMMA_ROPE)
    config = Gemma3Config(text_config=text, vision_config=dict(VISION_CONFIG), mm_tokens_per_image=4)
    with torch.device("meta"):
        return Gemma3ForConditionalGeneration(config)


def tiny_vocoder() -> torch.nn.Module:
    """LTX-2.3's vocoder class at a small width (its saved filters and STFT bases are buffers), on the meta device."""
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    from families.ltx2.real_size import REAL_VOCODER_CONFIGS

    # The narrowest widths that keep a channel after each upsampler (six halve the vocoder's, five the extender's).
    narrow = dict(hidden_channels=64, bwe_hidden_channels=32, resnet_kernel_sizes=[3], bwe_resnet_kernel_sizes=[3])
    config = dict(REAL_VOCODER_CONFIGS["2.3"], resnet_dilations=[[1, 3, 5]], bwe_resnet_dilations=[[1, 3, 5]], **narrow)
    with torch.device("meta"):
        return LTX2VocoderWithBWE(**config)


@pytest.mark.parametrize("make", [tiny_gemma, tiny_vocoder])
def test_a_streamed_component_is_random_bf16s_in_shards(tmp_path: Path, make) -> None:
    """Written shard by shard (several here), it loads to the values `random_bf16` gives the same module, a tied
    head saved once, and the guard's estimate from its files is its bf16 bytes."""
    module = make()
    write_streamed(module, tmp_path, seed=3, max_shard_bytes=20_000)
    index = json.loads(next(tmp_path.glob("*.safetensors.index.json")).read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not any(name.startswith("lm_head") for name in index["weight_map"])

    cls = type(module)
    expected = random_bf16(make(), seed=3).state_dict()
    loaded = load_pretrained(cls, tmp_path, dtype=torch.bfloat16, num_threads=1)
    state = loaded.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    assert planned_bytes(cls, tmp_path, dtype=torch.bfloat16) == saved_bf16_bytes(make())
