"""Random-weight checkpoints load and run unchanged in diffusers and transformers."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from families.base import DEFAULTS_FILE
from families.init_model import ALL_PRESETS, OWN_PRESETS, PRESETS, init_model
from families.registry import FAMILIES, FAMILY_NAMES, family_for_index
from families.wan.components import build_text_encoder, build_transformer, build_vae
from families.wan.presets import (
    DEFAULT_REQUESTS,
    TEXT_ENCODER_CONFIGS,
    TOKENIZER_CONFIGS,
    TRANSFORMER_CONFIGS,
    VAE_CONFIGS,
)
from families.wan.real_size import (
    REAL_SIZE_PRESET,
    REAL_SIZE_SHARD_BYTES,
    REAL_TEXT_ENCODER_CONFIG,
    REAL_TRANSFORMER_CONFIG,
    REAL_VAE_CONFIG,
    random_bf16,
)


def _weight_files(checkpoint: Path) -> dict[str, bytes]:
    return {str(p.relative_to(checkpoint)): p.read_bytes() for p in sorted(checkpoint.rglob("*.safetensors"))}


def test_wan_pipeline_loads_and_generates(tiny_model: Path) -> None:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_model)
    pipe.set_progress_bar_config(disable=True)
    index = json.loads((tiny_model / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert type(getattr(pipe, name)).__name__ == index[name][1]
    assert pipe.scheduler.config.prediction_type == "flow_prediction"
    assert pipe.scheduler.config.use_flow_sigmas and pipe.scheduler.config.flow_shift == 3.0

    request = DEFAULT_REQUESTS["tiny"]
    assert request == dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0)
    frames = pipe(
        prompt="A red fox runs through a snowy forest at dawn",
        negative_prompt="blurry, low quality",
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        **request,
    ).frames

    assert frames.shape == (1, 9, 64, 64, 3)
    assert frames.min() >= 0.0 and frames.max() <= 1.0
    assert frames.std() > 1e-3


def test_weights_are_deterministic_in_seed(tiny_model: Path, tmp_path: Path) -> None:
    reference = _weight_files(tiny_model)
    assert {Path(name).parent.name for name in reference} == {"transformer", "vae", "text_encoder"}

    assert _weight_files(init_model("wan-t2v", "tiny", tmp_path / "same", seed=0)) == reference

    other = _weight_files(init_model("wan-t2v", "tiny", tmp_path / "other", seed=1))
    assert other.keys() == reference.keys()
    for name in reference:
        assert other[name] != reference[name], name


def test_tokenizer_behaves_like_umt5(tiny_model: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model / "tokenizer")
    index = json.loads((tiny_model / "model_index.json").read_text())
    assert type(tokenizer).__name__ == index["tokenizer"][1]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    text_encoder_config = AutoConfig.from_pretrained(tiny_model / "text_encoder")
    assert text_encoder_config.vocab_size == len(tokenizer)

    # The call WanPipeline makes.
    batch = tokenizer(
        ["A red fox runs through a snowy forest", "Ａ  ｃat"],
        padding="max_length",
        max_length=226,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ids, mask = batch.input_ids, batch.attention_mask
    assert ids.shape == mask.shape == (2, 226)
    for row, row_mask in zip(ids, mask, strict=True):
        length = int(row_mask.sum())
        assert 1 < length < 226
        assert row[length - 1] == 1  # </s> closes the text
        assert (row[length:] == 0).all() and (row_mask[length:] == 0).all()
        assert (row[: length - 1] > 2).all()  # plain English: no special or unknown pieces
    # NFKC folds full-width letters and runs of spaces collapse, as in UMT5's normaliser.
    assert tokenizer.decode(ids[1], skip_special_tokens=True) == "A cat"

    long = tokenizer(" ".join(["fox"] * 1000), max_length=226, truncation=True).input_ids
    assert len(long) == 226 and long[-1] == 1


def test_unknown_family_or_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="wan-t2v"):
        init_model("qwen-image-xl", "tiny", tmp_path / "a")
    with pytest.raises(ValueError, match="tiny, small"):
        init_model("wan-t2v", "huge", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _preset_tables(writer_module: str) -> ModuleType:
    """A family's preset tables: the presets module beside its writer where it has one, else the writer's module."""
    presets = writer_module.rpartition(".")[0] + ".presets"
    return importlib.import_module(presets if importlib.util.find_spec(presets) else writer_module)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_every_family_sizes_every_preset(name: str) -> None:
    """The random presets every family has; presets a family declares for itself are its writer's own."""
    tables = _preset_tables(FAMILIES[name].load("writer").__module__)
    for table in (
        "TRANSFORMER_CONFIGS",
        "VAE_CONFIGS",
        "TEXT_ENCODER_CONFIGS",
        "TOKENIZER_CONFIGS",
        "DEFAULT_REQUESTS",
    ):
        assert tuple(getattr(tables, table)) == PRESETS, (name, table)


@pytest.mark.parametrize(
    ("fixture", "name"), [("tiny_model", "wan-t2v"), ("a14b_model", "wan2.2-a14b"), ("qwen_model", "qwen-image")]
)
def test_the_registry_recognises_each_written_family(fixture: str, name: str, request: pytest.FixtureRequest) -> None:
    checkpoint: Path = request.getfixturevalue(fixture)
    family = family_for_index(json.loads((checkpoint / "model_index.json").read_text()))
    assert family is FAMILIES[name]
    components = {"tokenizer", "text_encoder", "transformer", "vae", "scheduler"}
    if name == "wan2.2-a14b":
        components.add("transformer_2")
    assert {path.name for path in checkpoint.iterdir() if path.is_dir()} == components

    tables = _preset_tables(family.load("writer").__module__)
    defaults = json.loads((checkpoint / DEFAULTS_FILE).read_text())["default_request"]
    assert defaults == {**tables.DEFAULT_REQUESTS["tiny"], "fps": 16.0}


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_configs_build_and_fit_together(preset: str) -> None:
    transformer, vae, text = TRANSFORMER_CONFIGS[preset], VAE_CONFIGS[preset], TEXT_ENCODER_CONFIGS[preset]
    assert transformer["in_channels"] == transformer["out_channels"] == vae["z_dim"]
    assert transformer["text_dim"] == text["d_model"]
    assert transformer["num_attention_heads"] % 4 == 0
    request = DEFAULT_REQUESTS[preset]
    assert request["height"] % 16 == 0 and request["width"] % 16 == 0 and request["num_frames"] % 4 == 1

    # Building on the meta device checks every config is accepted without allocating weights.
    with torch.device("meta"):
        assert build_transformer(preset).config.num_layers == transformer["num_layers"]
        assert build_vae(preset, seed=0).config.z_dim == vae["z_dim"]
        vocab_size = TOKENIZER_CONFIGS[preset]["vocab_size"]
        assert build_text_encoder(preset, vocab_size).config.vocab_size == vocab_size


def test_a_family_declares_its_own_presets(tmp_path: Path) -> None:
    assert REAL_SIZE_PRESET in OWN_PRESETS and set(OWN_PRESETS) <= set(ALL_PRESETS)
    assert REAL_SIZE_PRESET in FAMILIES["wan-t2v"].own_presets
    for preset, other in (
        (REAL_SIZE_PRESET, "wan2.2-a14b"),
        (REAL_SIZE_PRESET, "qwen-image"),
        ("tiny-base", "wan-t2v"),
    ):
        with pytest.raises(ValueError, match=f"unknown preset '{preset}' for {other}; allowed: tiny, small"):
            init_model(other, preset, tmp_path / other)
        assert not (tmp_path / other).exists()


def _meta_real_size() -> dict[str, torch.nn.Module]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        return {
            "text_encoder": UMT5EncoderModel(UMT5Config(**REAL_TEXT_ENCODER_CONFIG)),
            "transformer": WanTransformer3DModel(**REAL_TRANSFORMER_CONFIG),
            "vae": AutoencoderKLWan(**REAL_VAE_CONFIG),
        }


def test_the_real_size_preset_has_the_published_sizes_and_shards() -> None:
    """Wan2.1-T2V-1.3B-Diffusers: 5.68B text encoder parameters in 5 shards, 1.42B transformer parameters in 2,
    a 127M VAE in one file (the published files are fp32 under a 5 GB limit; bf16 under half of it)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    published = {"text_encoder": (5_680_910_336, 5), "transformer": (1_418_996_800, 2), "vae": (126_892_531, 1)}
    for name, model in _meta_real_size().items():
        state = {key: tensor.to(torch.bfloat16) for key, tensor in model.state_dict().items()}
        state.pop("encoder.embed_tokens.weight", None)  # the shared embedding, saved once
        split = split_torch_state_dict_into_shards(state, max_shard_size=REAL_SIZE_SHARD_BYTES)
        parameters = sum(tensor.numel() for tensor in state.values())
        assert (parameters, len(split.filename_to_tensors)) == published[name], name
    transformer = REAL_TRANSFORMER_CONFIG
    assert transformer["num_attention_heads"] * transformer["attention_head_dim"] == 1536
    assert transformer["text_dim"] == REAL_TEXT_ENCODER_CONFIG["d_model"]
    assert transformer["in_channels"] == REAL_VAE_CONFIG["z_dim"] == len(REAL_VAE_CONFIG["latents_std"])


def test_random_bf16_fills_each_weight_once_from_the_seed() -> None:
    from transformers import UMT5Config, UMT5EncoderModel

    config = {**REAL_TEXT_ENCODER_CONFIG, "vocab_size": 500, "d_model": 64, "d_kv": 16, "d_ff": 128}
    config.update(num_layers=2, num_heads=4)

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            model = UMT5EncoderModel(UMT5Config(**config))
        return random_bf16(model, seed=3)

    first, second = build(), build()
    assert first.shared.weight is first.encoder.embed_tokens.weight  # tied again after materialising
    for (key, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert a.dtype == torch.bfloat16 and a.device.type == "cpu" and torch.equal(a, b), key
        if "layer_norm" in key:
            assert torch.all(a == 1), key
        else:
            assert 0.015 < a.float().std().item() < 0.025, key
