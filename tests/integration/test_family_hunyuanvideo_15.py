"""HunyuanVideo 1.5: each stage of the family against HunyuanVideo15Pipeline (and HunyuanVideo15ImageToVideoPipeline)
on the tiny checkpoints.

The text encoder equals `encode_prompt` on each encoder's real positions (Qwen2.5-VL's cropped template, ByT5's
glyph text, none without quotes); the denoiser's latents equal the pipeline's `output_type="latent"` ones with CFG,
with the guider's scale at 1 (one branch), and with the guider's start and stop and rescale moved off their
defaults; the checkpoint reader takes the default size from the transformer's target size and the guidance scale
from the guider. Image-to-video: SigLIP's embedding, the VAE's latents of the first frame and the latents from both
equal the image-to-video pipeline's. The streaming decode is tests/integration/test_hunyuanvideo_15_decode.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance
from PIL import Image

from families.base import crop_bucket
from families.hunyuanvideo_15.checkpoint import default_size, read_geometry
from families.hunyuanvideo_15.decode import HunyuanVideo15StreamingDecoder
from families.hunyuanvideo_15.denoise import HunyuanVideo15Denoiser
from families.hunyuanvideo_15.encode import (
    CROP_START,
    HunyuanVideo15ImageConditionEncoder,
    HunyuanVideo15PromptEncoder,
    glyph_text,
)
from families.hunyuanvideo_15.vae_encode import HunyuanVideo15ImageLatentEncoder
from stagekit.denoise import DenoiseSpec
from stagekit.images import DecodedImage
from tests.helpers.feature_mixins.base import tiny_checkpoint

CPU = torch.device("cpu")
PROMPT = 'A red fox holding a sign that says "hello world" trots across a snowy field at dawn'
NEGATIVE = "blurry, low quality"
# 48x80 pixels: 3x5 latents; 9 frames: 3 latent frames.
SPEC = DenoiseSpec(height=48, width=80, num_frames=9, num_inference_steps=3, guidance_scale=6.0, seed=3)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint("hunyuanvideo-1.5", tmp_path_factory)


@pytest.fixture(scope="module")
def pipeline(model: Path) -> HunyuanVideo15Pipeline:
    pipeline = HunyuanVideo15Pipeline.from_pretrained(model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def encoder(model: Path) -> HunyuanVideo15PromptEncoder:
    return HunyuanVideo15PromptEncoder(model, "hunyuanvideo-1.5-tiny", CPU, torch.float32)


@pytest.fixture(scope="module")
def denoiser(model: Path) -> HunyuanVideo15Denoiser:
    return HunyuanVideo15Denoiser(model, CPU, torch.float32)


@pytest.fixture(scope="module")
def conditioning(encoder: HunyuanVideo15PromptEncoder) -> dict[str, torch.Tensor]:
    """The text encoder's tensors for the prompt and the negative prompt, as the DiT stage receives them."""
    tensors, _ = encoder.encode([PROMPT, NEGATIVE], 1000)
    return {
        f"{role}_{name}": tensor[index : index + 1]
        for index, role in enumerate(("prompt", "negative_prompt"))
        for name, tensor in tensors.items()
    }


def _real(conditioning: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return conditioning[name][0][conditioning[f"{name}_mask"][0].bool()]


def test_encoder_equals_pipeline_encode_prompt(
    pipeline: HunyuanVideo15Pipeline, conditioning: dict[str, torch.Tensor]
) -> None:
    """Both encoders' real rows are the pipeline's (which pads to 1000 and 256 tokens and masks the padding); the
    negative prompt has no quoted text, so no glyph row is real, as the pipeline's all-masked zeros."""
    for role, text in (("prompt", PROMPT), ("negative_prompt", NEGATIVE)):
        embeds, mask, glyphs, glyph_mask = pipeline.encode_prompt(text, CPU, torch.float32)
        assert embeds.shape[1] == 1000 and glyphs.shape[1] == 256
        expected, expected_glyphs = embeds[0][mask[0].bool()], glyphs[0][glyph_mask[0].bool()]
        ours, our_glyphs = _real(conditioning, f"{role}_embeds"), _real(conditioning, f"{role}_glyph_embeds")
        assert ours.shape == expected.shape and our_glyphs.shape == expected_glyphs.shape, role
        assert (ours - expected).abs().max() <= 1e-6, role
        if expected_glyphs.numel():
            assert (our_glyphs - expected_glyphs).abs().max() <= 1e-5, role
    assert _real(conditioning, "prompt_glyph_embeds").shape[0] > 0
    assert _real(conditioning, "negative_prompt_glyph_embeds").shape[0] == 0
    # The batch pads the negative prompt's glyphs (none) to the prompt's length, masked.
    assert conditioning["negative_prompt_glyph_embeds"].shape == conditioning["prompt_glyph_embeds"].shape


def test_glyph_text_is_the_pipelines(encoder: HunyuanVideo15PromptEncoder) -> None:
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

    for text in (PROMPT, NEGATIVE, 'a "b" and “c” and "b"', '"only"', ""):
        assert glyph_text(text) == extract_glyph_texts(text), text


def test_long_prompt_reports_truncation(encoder: HunyuanVideo15PromptEncoder, pipeline: HunyuanVideo15Pipeline) -> None:
    """A prompt past `max_sequence_length` tokens after the template's 108 is cut there, as the pipeline cuts it at
    its 1000; a glyph text past ByT5's 256 bytes is reported when Qwen keeps the whole text."""
    long_prompt = " ".join([NEGATIVE] * 200)
    truncation = encoder.truncation(long_prompt, 1000)
    assert truncation is not None and truncation.kept == 1000 and truncation.given > 1000
    embedding, _ = encoder.encode_one(long_prompt, 1000)
    embeds, mask, _, _ = pipeline.encode_prompt(long_prompt, CPU, torch.float32)
    assert bool(mask.all()) and embedding["embeds"].shape[0] == 1000
    assert (embedding["embeds"] - embeds[0]).abs().max() <= 1e-5
    quoted = 'a sign "' + "x" * 300 + '"'
    glyphs = encoder.truncation(quoted, 1000)
    assert glyphs is not None and glyphs.encoder == "ByT5" and glyphs.kept == 256
    assert encoder.truncation(PROMPT, 1000) is None
    assert pipeline.prompt_template_encode_start_idx == CROP_START


def _pipeline_latents(
    pipeline: HunyuanVideo15Pipeline, conditioning: dict[str, torch.Tensor], spec: DenoiseSpec, **guider: float
) -> torch.Tensor:
    """The pipeline's latents from the tensors the DiT received (each text's real rows), its guider configured."""
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=spec.guidance_scale, **guider)

    def text(role: str) -> dict[str, torch.Tensor]:
        texts = {}
        for name, suffix in (("embeds", ""), ("glyph_embeds", "_2")):
            embeds = conditioning[f"{role}_{name}"]
            mask = conditioning[f"{role}_{name}_mask"]
            texts[f"prompt_embeds{suffix}"] = embeds
            texts[f"prompt_embeds_mask{suffix}"] = mask
        return texts

    positive, negative = text("prompt"), text("negative_prompt")
    return pipeline(
        **positive,
        **{f"negative_{name}": tensor for name, tensor in negative.items()},
        height=spec.height,
        width=spec.width,
        num_frames=spec.num_frames,
        num_inference_steps=spec.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(spec.seed),
        output_type="latent",
    ).frames


@pytest.mark.parametrize(
    ("guidance_scale", "guider", "branches"),
    [
        (6.0, {}, ["cfg"] * 3),
        # The guider runs one branch at scale 1.
        (1.0, {}, ["cond"] * 3),
        # CFG from the second step on, the guided prediction rescaled towards the positive one's spread.
        (4.0, {"start": 0.34, "guidance_rescale": 0.7}, ["cond", "cfg", "cfg"]),
    ],
    ids=["cfg", "one-branch", "start-and-rescale"],
)
def test_denoiser_latents_equal_pipeline(
    model: Path,
    pipeline: HunyuanVideo15Pipeline,
    conditioning: dict[str, torch.Tensor],
    guidance_scale: float,
    guider: dict[str, float],
    branches: list[str],
    tmp_path: Path,
) -> None:
    """The same checkpoint with its guider's config off its defaults (as a published checkpoint may ship it)."""
    spec = DenoiseSpec(**{**SPEC.__dict__, "guidance_scale": guidance_scale})
    expected = _pipeline_latents(pipeline, conditioning, spec, **guider)
    configured = Path(shutil.copytree(model, tmp_path / "model"))
    ClassifierFreeGuidance(guidance_scale=6.0, **guider).save_pretrained(configured / "guider")
    denoiser = HunyuanVideo15Denoiser(configured, CPU, torch.float32)
    ran: list[str] = []
    original = denoiser._predict

    def counting(*args: object) -> torch.Tensor:
        ran.append(str(args[-1]))
        return original(*args)

    denoiser._predict = counting  # type: ignore[method-assign]
    latents = denoiser.denoise(spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)
    assert latents.shape == (1, 8, 3, 3, 5) and latents.dtype == torch.float32
    # Each step runs the positive branch, and the negative one where the guider guides.
    assert ran.count("cond") == len(branches) and ran.count("uncond") == branches.count("cfg"), ran
    difference = (latents - expected).abs().max().item()
    print(f"guidance {guidance_scale} {guider}: latents max abs diff {difference:.2e}")
    assert difference <= TOLERANCE and expected.abs().max() > 0.1


def test_missing_negative_is_refused_when_the_guider_runs_cfg(
    denoiser: HunyuanVideo15Denoiser, conditioning: dict[str, torch.Tensor]
) -> None:
    positive = {name: tensor for name, tensor in conditioning.items() if name.startswith("prompt_")}
    with pytest.raises(ValueError, match="negative_prompt_embeds are required"):
        denoiser.denoise(SPEC, positive, on_step=lambda step, total: None, cancelled=lambda: False)


def test_checkpoint_reader_defaults(model: Path) -> None:
    """The tiny transformer's target size (64) and the guider's scale; the published 480p and 720p sizes."""
    configs = {
        "vae": json.loads((model / "vae" / "config.json").read_text()),
        "transformer": json.loads((model / "transformer" / "config.json").read_text()),
        "scheduler": json.loads((model / "scheduler" / "scheduler_config.json").read_text()),
        "guider": json.loads((model / "guider" / "guider_config.json").read_text()),
    }
    geometry = read_geometry(configs)
    defaults = geometry["defaults"]
    assert (defaults.height, defaults.width) == default_size(64, 16)
    assert defaults.guidance_scale == 6.0 and defaults.num_frames == 121 and defaults.fps == 24.0
    assert geometry["patch_size"] == (1, 1, 1) and geometry["vae_scale_spatial"] == 16
    assert geometry["vae_scale_temporal"] == 4 and geometry["latent_channels"] == 8
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    processor = HunyuanVideo15ImageProcessor(vae_scale_factor=16)
    for target in (64, 640, 960):
        assert default_size(target, 16) == processor.calculate_default_height_width(9, 16, target), target
    assert default_size(640, 16) == (480, 848) and default_size(960, 16) == (720, 1280)


# Image-to-video: a 100x70 first frame, whose crop bucket of the tiny model's 64^2 pixels is 64x48.
@pytest.fixture(scope="module")
def i2v_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint("hunyuanvideo-1.5-i2v", tmp_path_factory)


@pytest.fixture(scope="module")
def first_frame() -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 255, (70, 100, 3), dtype=np.uint8))


def test_image_to_video_stages_equal_pipeline(i2v_model: Path, first_frame: Image.Image) -> None:
    """SigLIP's embedding of the frame cropped to the output size, the VAE's latents of it, and the denoiser's
    latents from both beside the texts, each the image-to-video pipeline's; the size is the pipeline's bucket."""
    pipeline = HunyuanVideo15ImageToVideoPipeline.from_pretrained(i2v_model)
    pipeline.set_progress_bar_config(disable=True)
    width, height = crop_bucket(first_frame.width, first_frame.height, 64, 16)
    assert (height, width) == pipeline.video_processor.calculate_default_height_width(70, 100, 64) == (48, 64)
    encoder = HunyuanVideo15ImageConditionEncoder(i2v_model, "hunyuanvideo-1.5-i2v-tiny", CPU, torch.float32)
    cropped = pipeline.video_processor.resize(first_frame, height=height, width=width, resize_mode="crop")
    image_embeds = encoder.embed_images_uncached([first_frame])
    assert torch.equal(image_embeds, pipeline.encode_image(cropped, 1, CPU, torch.float32))
    decoder = HunyuanVideo15StreamingDecoder(i2v_model, CPU, torch.float32)
    images = [DecodedImage("first_frame", first_frame, "unused")]
    image_latents = HunyuanVideo15ImageLatentEncoder(i2v_model)(decoder, images, height, width, 9)["image_latents"]
    expected = pipeline._get_image_latents(pipeline.vae, pipeline.video_processor, cropped, height, width, CPU)
    assert image_latents.shape == (1, 8, 1, 3, 4) and torch.equal(image_latents, expected)

    tensors, _ = encoder.encode([PROMPT, NEGATIVE], 1000)
    conditioning = {
        f"{role}_{name}": tensor[index : index + 1]
        for index, role in enumerate(("prompt", "negative_prompt"))
        for name, tensor in tensors.items()
    }
    conditioning.update(image_embeds=image_embeds, image_latents=image_latents)
    spec = DenoiseSpec(height, width, 9, 2, 6.0, 3, image_roles=("first_frame",))
    denoiser = HunyuanVideo15Denoiser(i2v_model, CPU, torch.float32)
    assert denoiser.image_tensor_shape("image_latents", spec) == (1, 8, 1, 3, 4)
    assert denoiser.image_tensor_shape("image_embeds", spec) == (1, None, 16)
    latents = denoiser.denoise(spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=6.0)
    reference = pipeline(
        image=first_frame,
        prompt=PROMPT,
        negative_prompt=NEGATIVE,
        num_frames=9,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(3),
        output_type="latent",
    ).frames
    difference = (latents - reference).abs().max().item()
    print(f"image-to-video latents max abs diff {difference:.2e}")
    assert difference <= TOLERANCE and reference.abs().max() > 0.1
    # The image conditions the result: without it (text-to-video's zeros) the latents differ.
    text_only = {name: tensor for name, tensor in conditioning.items() if not name.startswith("image_")}
    plain = denoiser.denoise(
        DenoiseSpec(height, width, 9, 2, 6.0, 3), text_only, on_step=lambda step, total: None, cancelled=lambda: False
    )
    assert (plain - latents).abs().max() > 0.01
