"""Random-weight Wan image-to-video checkpoints load and run unchanged in diffusers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from families.base import DEFAULTS_FILE
from families.init_model import PRESETS, init_model
from families.registry import FAMILIES, family_for_index
from families.wan_i2v import init_model as tables

I2V_FAMILIES = ("wan-i2v", "wan2.2-i2v-a14b", "wan2.2-ti2v")
COMPONENTS = {
    "wan-i2v": {"tokenizer", "text_encoder", "transformer", "vae", "scheduler", "image_encoder", "image_processor"},
    "wan2.2-i2v-a14b": {"tokenizer", "text_encoder", "transformer", "transformer_2", "vae", "scheduler"},
    "wan2.2-ti2v": {"tokenizer", "text_encoder", "transformer", "vae", "scheduler"},
}
PROMPT = "A red fox runs through a snowy forest at dawn"


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """The tiny models run fastest on one thread (and stay fast on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("i2v-models")
    return {name: init_model(name, "tiny", root / name, seed=0) for name in I2V_FAMILIES}


def _index(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "model_index.json").read_text())


def _weight_files(checkpoint: Path) -> dict[str, bytes]:
    return {str(p.relative_to(checkpoint)): p.read_bytes() for p in sorted(checkpoint.rglob("*.safetensors"))}


def _input_image() -> Image.Image:
    """A 50x40 picture: another size and aspect than the 64x64 output, so both pipelines resize it."""
    pixels = np.random.default_rng(0).integers(0, 256, size=(40, 50, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _assert_video(frames: np.ndarray) -> None:
    assert frames.shape == (1, 9, 64, 64, 3)
    assert np.isfinite(frames).all()
    assert frames.min() >= 0.0 and frames.max() <= 1.0
    assert frames.std() > 1e-3


@pytest.mark.parametrize("name", I2V_FAMILIES)
def test_the_registry_recognises_each_written_family(name: str, checkpoints: dict[str, Path]) -> None:
    checkpoint = checkpoints[name]
    index = _index(checkpoint)
    assert family_for_index(index) is FAMILIES[name]
    assert {path.name for path in checkpoint.iterdir() if path.is_dir()} == COMPONENTS[name]
    for component in COMPONENTS[name]:
        assert index[component][1] is not None, component
    defaults = json.loads((checkpoint / DEFAULTS_FILE).read_text())["default_request"]
    assert defaults == {**tables.DEFAULT_REQUESTS["tiny"], "fps": FAMILIES[name].defaults.fps}


def test_model_index_is_as_published(checkpoints: dict[str, Path]) -> None:
    wan21 = _index(checkpoints["wan-i2v"])
    assert wan21["_class_name"] == "WanImageToVideoPipeline"
    assert wan21["image_encoder"] == ["transformers", "CLIPVisionModel"]
    assert wan21["image_processor"] == ["transformers", "CLIPImageProcessor"]
    assert (wan21["boundary_ratio"], wan21["expand_timesteps"]) == (None, False)
    assert "transformer_2" not in wan21

    a14b = _index(checkpoints["wan2.2-i2v-a14b"])
    assert a14b["_class_name"] == "WanImageToVideoPipeline"
    assert a14b["image_encoder"] == a14b["image_processor"] == [None, None]
    assert a14b["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert (a14b["boundary_ratio"], a14b["expand_timesteps"]) == (0.9, False)

    ti2v = _index(checkpoints["wan2.2-ti2v"])
    assert ti2v["_class_name"] == "WanPipeline"
    assert ti2v["transformer_2"] == [None, None]
    assert (ti2v["boundary_ratio"], ti2v["expand_timesteps"]) == (None, True)
    assert "image_encoder" not in ti2v


@pytest.mark.parametrize("name", I2V_FAMILIES)
def test_image_to_video_pipeline_loads_and_generates(name: str, checkpoints: dict[str, Path]) -> None:
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(checkpoints[name])
    pipe.set_progress_bar_config(disable=True)
    assert (pipe.transformer_2 is not None) == (name == "wan2.2-i2v-a14b")
    assert (pipe.image_encoder is not None) == (name == "wan-i2v")
    assert pipe.config.expand_timesteps == (name == "wan2.2-ti2v")
    assert pipe.vae_scale_factor_spatial == (16 if name == "wan2.2-ti2v" else 8)

    frames = pipe(
        image=_input_image(),
        prompt=PROMPT,
        negative_prompt="blurry, low quality",
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        **tables.DEFAULT_REQUESTS["tiny"],
    ).frames
    _assert_video(frames)


def test_ti2v_text_to_video_with_wan_pipeline(checkpoints: dict[str, Path]) -> None:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(checkpoints["wan2.2-ti2v"])
    pipe.set_progress_bar_config(disable=True)
    assert pipe.config.expand_timesteps and pipe.transformer_2 is None
    frames = pipe(
        prompt=PROMPT,
        negative_prompt="blurry, low quality",
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
        **tables.DEFAULT_REQUESTS["tiny"],
    ).frames
    _assert_video(frames)


def test_clip_image_processor_and_encoder(checkpoints: dict[str, Path]) -> None:
    from diffusers import WanImageToVideoPipeline

    checkpoint = checkpoints["wan-i2v"]
    saved = json.loads((checkpoint / "image_processor" / "preprocessor_config.json").read_text())
    side = tables.IMAGE_ENCODER_CONFIGS["tiny"]["image_size"]
    assert saved["image_processor_type"] == "CLIPImageProcessor"
    assert saved["size"] == {"shortest_edge": side}
    assert saved["crop_size"] == {"height": side, "width": side}
    assert saved["resample"] == 3 and saved["do_convert_rgb"]

    pipe = WanImageToVideoPipeline.from_pretrained(checkpoint)
    pixels = pipe.image_processor(images=_input_image(), return_tensors="pt")["pixel_values"]
    assert pixels.shape == (1, 3, side, side)
    # The image tokens the transformer cross-attends to: CLIP's penultimate hidden state.
    clip = tables.IMAGE_ENCODER_CONFIGS["tiny"]
    tokens = (clip["image_size"] // clip["patch_size"]) ** 2 + 1
    with torch.no_grad():
        embeds = pipe.encode_image(_input_image(), torch.device("cpu"))
    assert embeds.shape == (1, tokens, pipe.transformer.config.image_dim)


@pytest.mark.parametrize("name", I2V_FAMILIES)
def test_weights_are_deterministic_in_seed(name: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    reference = _weight_files(checkpoints[name])
    weighted = COMPONENTS[name] - {"tokenizer", "scheduler", "image_processor"}
    assert {Path(file).parent.name for file in reference} == weighted
    assert _weight_files(init_model(name, "tiny", tmp_path / "same", seed=0)) == reference
    if name == "wan2.2-i2v-a14b":
        experts = [
            reference[f"{expert}/diffusion_pytorch_model.safetensors"] for expert in ("transformer", "transformer_2")
        ]
        assert experts[0] != experts[1]
    other = _weight_files(init_model(name, "tiny", tmp_path / "other", seed=1))
    assert other.keys() == reference.keys()
    for file in reference:
        assert other[file] != reference[file], file


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_tables_fit_together(preset: str) -> None:
    for table in ("TRANSFORMER_CONFIGS", "VAE_CONFIGS", "TEXT_ENCODER_CONFIGS", "TOKENIZER_CONFIGS"):
        assert tuple(getattr(tables, table)) == PRESETS, table
    assert tuple(tables.IMAGE_ENCODER_CONFIGS) == PRESETS
    text_dim = tables.TEXT_ENCODER_CONFIGS[preset]["d_model"]
    clip = tables.IMAGE_ENCODER_CONFIGS[preset]
    assert clip["image_size"] % clip["patch_size"] == 0 and clip["hidden_size"] % clip["num_attention_heads"] == 0

    for name in I2V_FAMILIES:
        transformer = tables.TRANSFORMER_CONFIGS[preset][name]
        vae = tables.VAE_CONFIGS[preset][name]
        assert transformer["text_dim"] == text_dim
        assert transformer["num_attention_heads"] % 4 == 0
        assert transformer["out_channels"] == vae["z_dim"]
        if name == "wan2.2-ti2v":
            assert transformer["in_channels"] == vae["z_dim"] == 48
            assert vae["in_channels"] == vae["out_channels"] == 3 * vae["patch_size"] ** 2
        else:
            # noise latents, the frame mask (one channel per frame a latent frame covers), image latents
            assert transformer["in_channels"] == 2 * vae["z_dim"] + 4
    wan21 = tables.TRANSFORMER_CONFIGS[preset]["wan-i2v"]
    assert wan21["image_dim"] == clip["hidden_size"]
    assert wan21["added_kv_proj_dim"] == wan21["num_attention_heads"] * wan21["attention_head_dim"]
    for name in ("wan2.2-i2v-a14b", "wan2.2-ti2v"):
        transformer = tables.TRANSFORMER_CONFIGS[preset][name]
        assert transformer["image_dim"] is None and transformer["added_kv_proj_dim"] is None

    request = tables.DEFAULT_REQUESTS[preset]
    multiple = tables.WAN22_VAE_CONFIGS[preset]["scale_factor_spatial"] * 2  # x the transformer's 2x2 patch
    assert multiple == 32
    assert request["height"] % multiple == 0 and request["width"] % multiple == 0 and request["num_frames"] % 4 == 1
