"""Random-weight checkpoints load and run unchanged in diffusers and transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stagediff.init_model import (
    DEFAULT_REQUESTS,
    FAMILIES,
    PRESETS,
    TEXT_ENCODER_CONFIGS,
    TOKENIZER_CONFIGS,
    TRANSFORMER_CONFIGS,
    VAE_CONFIGS,
    build_text_encoder,
    build_transformer,
    build_vae,
    init_model,
)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("wan-t2v", "tiny", tmp_path_factory.mktemp("tiny"), seed=0)


def _weight_files(checkpoint: Path) -> dict[str, bytes]:
    return {str(p.relative_to(checkpoint)): p.read_bytes() for p in sorted(checkpoint.rglob("*.safetensors"))}


def test_wan_pipeline_loads_and_generates(tiny_checkpoint: Path) -> None:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_checkpoint)
    pipe.set_progress_bar_config(disable=True)
    index = json.loads((tiny_checkpoint / "model_index.json").read_text())
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


def test_weights_are_deterministic_in_seed(tiny_checkpoint: Path, tmp_path: Path) -> None:
    reference = _weight_files(tiny_checkpoint)
    assert {Path(name).parent.name for name in reference} == {"transformer", "vae", "text_encoder"}

    assert _weight_files(init_model("wan-t2v", "tiny", tmp_path / "same", seed=0)) == reference

    other = _weight_files(init_model("wan-t2v", "tiny", tmp_path / "other", seed=1))
    assert other.keys() == reference.keys()
    for name in reference:
        assert other[name] != reference[name], name


def test_tokenizer_behaves_like_umt5(tiny_checkpoint: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint / "tokenizer")
    index = json.loads((tiny_checkpoint / "model_index.json").read_text())
    assert type(tokenizer).__name__ == index["tokenizer"][1]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    text_encoder_config = AutoConfig.from_pretrained(tiny_checkpoint / "text_encoder")
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


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_configs_build_and_fit_together(preset: str) -> None:
    assert FAMILIES == ("wan-t2v", "wan2.2-a14b", "qwen-image")
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
