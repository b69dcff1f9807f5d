"""Qwen-Image 2.1, stage by stage against QwenImage21Pipeline on the tiny checkpoint.

The text encoder's embeddings equal the pipeline's encode_prompt (a prompt, and the empty one, which both encode
as " "); the text encoder's prompt and negative prompt, as the stage sends them (padded to the longer, with
masks), through the DiT's loop equal the pipeline's `output_type="latent"` latents with and without true CFG
(the pipeline's KV cache of the text on, as by default); the VAE stage's RGB frames equal the pipeline's
`output_type="np"` RGBA image's colour channels within one level (StageDiff's results are RGB: the alpha is
dropped, as PIL's `.convert("RGB")` drops it). The DiT's features (offload, CFG-parallel) are checked by
QwenImage21TesterConfig (tests/integration/test_family_features.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLQwenImage21,
    FlowMatchEulerDiscreteScheduler,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
)
from transformers import Qwen3VLForConditionalGeneration

from families.qwen_image_21.checkpoint import read_geometry
from families.qwen_image_21.decode import QwenImage21Decoder
from families.qwen_image_21.denoise import QwenImage21Denoiser
from families.qwen_image_21.encode import Qwen21PromptEncoder, load_processor
from families.registry import family_for_index
from stagekit.denoise import DenoiseSpec
from tests.helpers.feature_mixins.base import tiny_checkpoint

CPU = torch.device("cpu")
PROMPT = "A red fox trots across a snowy field at dawn, cinematic lighting"
NEGATIVE = "blurry"
# 64x96: 4 x 6 latent tokens, 6 image slots of the text encoder's sequence.
SPEC = DenoiseSpec(height=64, width=96, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=5)
# The frames' request: smaller, as the VAE's convolutions at full resolution dominate the module's time.
FRAMES_SPEC = dataclasses.replace(SPEC, height=32, width=64)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint("qwen-image-2.1", tmp_path_factory)


@pytest.fixture(scope="module")
def pipeline(model_dir: Path) -> QwenImage21Pipeline:
    """QwenImage21Pipeline from the checkpoint's components (the processor made without torchvision)."""
    pipeline = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler"),
        vae=AutoencoderKLQwenImage21.from_pretrained(model_dir / "vae"),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(model_dir / "text_encoder"),
        processor=load_processor(model_dir / "processor"),
        transformer=QwenImage21Transformer2DModel.from_pretrained(model_dir / "transformer"),
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> Qwen21PromptEncoder:
    return Qwen21PromptEncoder(model_dir, "qwen21", CPU, torch.float32)


def conditioning(encoder: Qwen21PromptEncoder, spec: DenoiseSpec) -> dict[str, torch.Tensor]:
    """What the DiT stage receives: the prompt (and the negative prompt with guidance) padded to the longer."""
    texts = [PROMPT, NEGATIVE] if spec.do_classifier_free_guidance else [PROMPT]
    batch = encoder.encode(texts, 1024)[0]
    names = ("prompt_embeds", "negative_prompt_embeds")
    sent = {}
    for index, name in enumerate(names[: len(texts)]):
        sent[name] = batch["embeds"][index : index + 1]
        sent[f"{name}_mask"] = batch["embeds_mask"][index : index + 1]
    return sent


def pipeline_output(pipeline: QwenImage21Pipeline, spec: DenoiseSpec, output_type: str) -> Any:
    guided = spec.do_classifier_free_guidance
    return pipeline(
        prompt=PROMPT,
        negative_prompt=NEGATIVE if guided else None,
        true_cfg_scale=spec.guidance_scale,
        height=spec.height,
        width=spec.width,
        num_inference_steps=spec.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(spec.seed),
        output_type=output_type,
    ).images


def test_qwen21_checkpoint_is_recognised_and_read(model_dir: Path) -> None:
    index = json.loads((model_dir / "model_index.json").read_text())
    family = family_for_index(index)
    assert family is not None and family.name == "qwen-image-2.1"
    configs = {name: json.loads((model_dir / name / "config.json").read_text()) for name in ("vae", "transformer")}
    geometry = read_geometry(configs)
    assert geometry["vae_scale_spatial"] == 16 and geometry["patch_size"] == (1, 2, 2)
    assert geometry["latent_channels"] == configs["transformer"]["in_channels"]


def test_qwen21_encoder_equals_encode_prompt(encoder: Qwen21PromptEncoder, pipeline: QwenImage21Pipeline) -> None:
    assert encoder.drop_idx == pipeline._drop_idx
    for text in (PROMPT, ""):
        ours = encoder.embed_uncached(text, 1024)
        theirs, mask, image_pad_mask = pipeline.encode_prompt(text, device=CPU)
        assert mask is None and not image_pad_mask.any()
        assert ours.shape == theirs[0].shape, (ours.shape, theirs.shape)
        difference = (ours - theirs[0]).abs().max().item()
        print(f"encoder {text!r}: {tuple(ours.shape)} max abs diff {difference:.2e}")
        assert difference == 0.0
    batch = encoder.encode([PROMPT, ""], 1024)[0]
    lengths = batch["embeds_mask"].sum(dim=1).tolist()
    assert lengths == [encoder.embed_uncached(PROMPT, 1024).shape[0], encoder.embed_uncached("", 1024).shape[0]]


@pytest.mark.parametrize("spec", [SPEC, dataclasses.replace(SPEC, guidance_scale=1.0, seed=2)], ids=["cfg", "no-cfg"])
def test_qwen21_latents_equal_pipeline(
    model_dir: Path, encoder: Qwen21PromptEncoder, pipeline: QwenImage21Pipeline, spec: DenoiseSpec
) -> None:
    denoiser = QwenImage21Denoiser(model_dir, CPU, torch.float32)
    steps: list[int] = []
    ours = denoiser.denoise(spec, conditioning(encoder, spec), lambda step, total: steps.append(step), lambda: False)
    theirs = pipeline_output(pipeline, spec, "latent")
    height, width = denoiser.latent_size(spec)
    theirs = QwenImage21Pipeline._unpack_latents(theirs, spec.height, spec.width, pipeline.vae_scale_factor)
    assert ours.shape == theirs.shape == (1, denoiser.latent_channels, 1, height, width)
    assert steps == [1, 2]
    difference = (ours - theirs).abs().max().item()
    print(f"latents {spec.guidance_scale}: max abs diff {difference:.2e} (std {theirs.std().item():.3f})")
    assert theirs.std() > 0.1 and difference <= TOLERANCE


def test_qwen21_frames_equal_pipeline(
    model_dir: Path, encoder: Qwen21PromptEncoder, pipeline: QwenImage21Pipeline
) -> None:
    spec = FRAMES_SPEC
    latents = QwenImage21Denoiser(model_dir, CPU, torch.float32).denoise(
        spec, conditioning(encoder, spec), lambda step, total: None, lambda: False
    )
    frames = QwenImage21Decoder(model_dir, CPU, torch.float32).session().decode_next(latents)
    image = pipeline_output(pipeline, spec, "np")
    assert image.shape == (1, spec.height, spec.width, 4), "the pipeline's images are RGBA"
    expected = np.round(image[..., :3] * 255).astype(np.int16)
    assert frames.shape == (1, spec.height, spec.width, 3) == expected.shape
    difference = int(np.abs(frames.numpy().astype(np.int16) - expected).max())
    print(f"frames: max level diff {difference}")
    assert difference <= 1 and frames.float().std() > 5
