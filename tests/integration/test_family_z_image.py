"""Z-Image: each stage of the family against ZImagePipeline on the tiny checkpoint.

The text encoder equals `encode_prompt` (template, padding, hidden layer, kept positions); the denoiser's
latents equal the pipeline's `output_type="latent"` ones with and without CFG (and with the pipeline's CFG
truncation and renormalization moved off their defaults), given the text encoder's tensors as the DiT stage
receives them (padded to the longer text, with masks); the decoder's frames equal the pipeline's
`output_type="np"` image within one level, a guidance scale of 1 guiding as the pipeline's does. Also: a long
prompt reports its cut, and the checkpoint reader tells Z-Image-Turbo by its scheduler.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ZImagePipeline

from families.flux.decode import FluxDecoder
from families.z_image.checkpoint import BASE_DEFAULTS, TURBO_DEFAULTS, read_geometry
from families.z_image.denoise import ZImageDenoiser
from families.z_image.encode import ZImagePromptEncoder
from stagekit.denoise import DenoiseSpec

CPU = torch.device("cpu")
PROMPT = "A red fox trots across a snowy field at dawn, its breath rising in small white clouds"
NEGATIVE = "blurry, low quality"
# Short, so that both texts fit and the encoder runs over few padded positions; the texts differ in length.
MAX_LENGTH = 48
# 48x80 pixels: 6x10 latents, 3x5 patches of 2x2, which the transformer pads to 32 tokens.
# As the DiT stage builds it: guidance above the family's cfg_threshold (0) runs CFG.
SPEC = DenoiseSpec(
    height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=3, cfg_threshold=0.0
)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def encoder(z_image_model: Path) -> ZImagePromptEncoder:
    return ZImagePromptEncoder(z_image_model, "z-image-tiny", CPU, torch.float32)


@pytest.fixture(scope="module")
def denoiser(z_image_model: Path) -> ZImageDenoiser:
    return ZImageDenoiser(z_image_model, CPU, torch.float32)


@pytest.fixture(scope="module")
def conditioning(encoder: ZImagePromptEncoder) -> dict[str, torch.Tensor]:
    """The text encoder's tensors for the prompt and the negative prompt, as the DiT stage receives them."""
    tensors, _ = encoder.encode([PROMPT, NEGATIVE], MAX_LENGTH)
    return {
        "prompt_embeds": tensors["embeds"][:1],
        "prompt_embeds_mask": tensors["embeds_mask"][:1],
        "negative_prompt_embeds": tensors["embeds"][1:],
        "negative_prompt_embeds_mask": tensors["embeds_mask"][1:],
    }


def _texts(conditioning: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each text's own rows, as ZImagePipeline.encode_prompt returns them."""
    prompt = conditioning["prompt_embeds"][0][conditioning["prompt_embeds_mask"][0].bool()]
    negative = conditioning["negative_prompt_embeds"][0][conditioning["negative_prompt_embeds_mask"][0].bool()]
    return prompt, negative


def _pipeline_latents(
    pipeline: ZImagePipeline, conditioning: dict[str, torch.Tensor], spec: DenoiseSpec, **options: float
) -> torch.Tensor:
    prompt, negative = _texts(conditioning)
    return pipeline(
        prompt_embeds=[prompt],
        negative_prompt_embeds=[negative],
        height=spec.height,
        width=spec.width,
        num_inference_steps=spec.num_inference_steps,
        guidance_scale=spec.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(spec.seed),
        output_type="latent",
        **options,
    ).images


def _denoise(denoiser: ZImageDenoiser, spec: DenoiseSpec, conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
    return denoiser.denoise(spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)


def test_encoder_equals_pipeline_encode_prompt(
    encoder: ZImagePromptEncoder, z_image_pipeline: ZImagePipeline, conditioning: dict[str, torch.Tensor]
) -> None:
    """Each text's embedding is the pipeline's exactly, with its own length; the batch pads the shorter one."""
    expected, expected_negative = z_image_pipeline.encode_prompt(
        PROMPT, CPU, do_classifier_free_guidance=True, negative_prompt=NEGATIVE, max_sequence_length=MAX_LENGTH
    )
    prompt, negative = _texts(conditioning)
    assert prompt.shape == expected[0].shape and negative.shape == expected_negative[0].shape
    assert prompt.shape[0] > negative.shape[0], "the texts have their own lengths"
    assert torch.equal(prompt, expected[0]) and torch.equal(negative, expected_negative[0])
    assert conditioning["negative_prompt_embeds_mask"][0, negative.shape[0] :].eq(0).all()


def test_long_prompt_reports_truncation(encoder: ZImagePromptEncoder, z_image_pipeline: ZImagePipeline) -> None:
    """A prompt longer than max_sequence_length tokens (template included) is cut there, as the pipeline cuts it."""
    long_prompt = " ".join([PROMPT] * 4)
    truncation = encoder.truncation(long_prompt, MAX_LENGTH)
    assert truncation is not None and truncation.kept == MAX_LENGTH and truncation.given > MAX_LENGTH
    assert encoder.truncation(NEGATIVE, MAX_LENGTH) is None
    embedding, _ = encoder.encode_one(long_prompt, MAX_LENGTH)
    (expected,), _ = z_image_pipeline.encode_prompt(
        long_prompt, CPU, do_classifier_free_guidance=False, max_sequence_length=MAX_LENGTH
    )
    assert embedding.shape[0] == MAX_LENGTH and torch.equal(embedding, expected)


@pytest.mark.parametrize(
    ("guidance_scale", "options"),
    [
        (4.0, {}),
        (0.0, {}),
        # ZImagePipeline guides any scale above 0: 1 is CFG too (the family's cfg_threshold is 0).
        (1.0, {}),
        # Off their defaults: the second step (normalised time 0.14) truncated to the positive branch, the first
        # step's guided norm capped at the positive one's.
        (4.0, {"cfg_truncation": 0.1, "cfg_normalization": 1.0}),
    ],
    ids=["cfg", "no-cfg", "cfg-at-1", "cfg-truncated-normalized"],
)
def test_denoiser_latents_equal_pipeline(
    denoiser: ZImageDenoiser,
    z_image_pipeline: ZImagePipeline,
    conditioning: dict[str, torch.Tensor],
    guidance_scale: float,
    options: dict[str, float],
) -> None:
    spec = DenoiseSpec(**{**SPEC.__dict__, "guidance_scale": guidance_scale})
    expected = _pipeline_latents(z_image_pipeline, conditioning, spec, **options)
    if options:
        assert not torch.equal(expected, _pipeline_latents(z_image_pipeline, conditioning, spec)), (
            "options had no effect"
        )
    denoiser.cfg_truncation = options.get("cfg_truncation", 1.0)
    denoiser.cfg_normalization = options.get("cfg_normalization", 0.0)
    try:
        latents = _denoise(denoiser, spec, conditioning)
    finally:
        denoiser.cfg_truncation, denoiser.cfg_normalization = 1.0, 0.0
    assert latents.shape == (1, 16, 1, 6, 10) and latents.dtype == torch.float32
    difference = (latents[:, :, 0] - expected).abs().max().item()
    print(f"guidance {guidance_scale} {options}: latents max abs diff {difference:.2e}")
    assert difference <= TOLERANCE


def test_decoder_frames_equal_pipeline(
    z_image_model: Path,
    denoiser: ZImageDenoiser,
    z_image_pipeline: ZImagePipeline,
    conditioning: dict[str, torch.Tensor],
) -> None:
    """FLUX.1's decoder is Z-Image's: the uint8 frame is the pipeline's `np` image within one level."""
    latents = _denoise(denoiser, SPEC, conditioning)
    prompt, negative = _texts(conditioning)
    expected = z_image_pipeline(
        prompt_embeds=[prompt],
        negative_prompt_embeds=[negative],
        height=SPEC.height,
        width=SPEC.width,
        num_inference_steps=SPEC.num_inference_steps,
        guidance_scale=SPEC.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(SPEC.seed),
        output_type="np",
    ).images[0]
    frames = FluxDecoder(z_image_model, CPU, torch.float32).session().decode_next(latents)
    assert frames.shape == (1, SPEC.height, SPEC.width, 3) and frames.dtype == torch.uint8
    levels = np.abs(frames[0].numpy().astype(np.int16) - np.round(expected * 255).astype(np.int16)).max()
    print(f"decoded frame: max level diff {levels}")
    assert levels <= 1


def test_checkpoint_reader_tells_turbo_by_its_scheduler(z_image_model: Path, tmp_path: Path) -> None:
    """The base model's scheduler gives ZImagePipeline's defaults, Z-Image-Turbo's shift its card's."""
    from families.z_image.init_model import build_scheduler

    configs = {name: json.loads((z_image_model / name / "config.json").read_text()) for name in ("vae", "transformer")}
    for kind, defaults in (("base", BASE_DEFAULTS), ("turbo", TURBO_DEFAULTS)):
        build_scheduler(kind).save_pretrained(tmp_path / kind)
        scheduler = json.loads((tmp_path / kind / "scheduler_config.json").read_text())
        geometry = read_geometry({**configs, "scheduler": scheduler})
        assert geometry["defaults"] == defaults, kind
    assert geometry["patch_size"] == (1, 2, 2) and geometry["vae_scale_spatial"] == 8
    # axes_lens[0] = 1024 positions: captions up to 992 tokens (a multiple of 32) leave one for the image.
    assert geometry["sequence_length_limit"] == 992
