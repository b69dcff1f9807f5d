"""FLUX.1 stage by stage against FluxPipeline: the text encoder's T5 sequence and CLIP pooled vector, the
denoiser's latents (FLUX.1-dev's kind with its embedded guidance and true CFG on top; FLUX.1-schnell's without
either), the VAE's frames, and the prompts each tokenizer cuts. The parallel layouts, offload, quantization,
loading and the step cache are in tests/integration/test_family_features.py (the TestFlux classes); the cluster
in tests/e2e/test_image_families_cluster.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline

from families.flux.decode import FluxDecoder
from families.flux.denoise import FluxDenoiser
from families.flux.encode import FluxPromptEncoder
from services.checkpoint import read_checkpoint
from stagekit.denoise import DenoiseSpec

CPU = torch.device("cpu")
PROMPT, NEGATIVE = "a red fox running through fresh snow at dawn", "blurry, low quality"


@pytest.fixture(scope="module", params=["dev", "schnell"])
def variant(request: pytest.FixtureRequest) -> tuple[str, Path, FluxPipeline]:
    model = request.getfixturevalue("flux_model" if request.param == "dev" else "flux_schnell_model")
    pipeline = FluxPipeline.from_pretrained(model)
    pipeline.set_progress_bar_config(disable=True)
    return request.param, model, pipeline


def _conditioning(model: Path, texts: list[str], length: int) -> dict[str, torch.Tensor]:
    encoded, _ = FluxPromptEncoder(model, "flux", CPU, torch.float32).encode(texts, length)
    roles = ("prompt", "negative_prompt")
    return {
        f"{role}_{name}": tensor[i : i + 1]
        for i, role in enumerate(roles[: len(texts)])
        for name, tensor in encoded.items()
    }


def test_the_checkpoint_tells_dev_from_schnell(flux_model: Path, flux_schnell_model: Path) -> None:
    dev, schnell = read_checkpoint(flux_model), read_checkpoint(flux_schnell_model)
    assert dev.embedded_guidance and dev.limits().default_embedded_guidance_scale == 3.5
    assert not schnell.embedded_guidance and not schnell.limits().HasField("default_embedded_guidance_scale")
    assert (dev.max_sequence_length, schnell.max_sequence_length) == (512, 256)
    assert dev.height_multiple == dev.width_multiple == 16 and dev.max_frames == 1


def test_encoder_equals_encode_prompt(variant) -> None:
    _, model, pipeline = variant
    conditioning = _conditioning(model, [PROMPT, NEGATIVE], 64)
    for role, text in (("prompt", PROMPT), ("negative_prompt", NEGATIVE)):
        embeds, pooled, text_ids = pipeline.encode_prompt(text, None, max_sequence_length=64)
        assert conditioning[f"{role}_embeds"].shape == embeds.shape == (1, 64, 32)
        torch.testing.assert_close(conditioning[f"{role}_embeds"], embeds, rtol=0, atol=1e-5)
        torch.testing.assert_close(conditioning[f"{role}_pooled_embeds"], pooled, rtol=0, atol=0)
        assert not text_ids.any()


@pytest.mark.parametrize("true_cfg", [1.0, 3.0])
def test_denoiser_and_decoder_equal_the_pipeline(variant, true_cfg: float) -> None:
    """The latents exactly, the image within one level: 48x80 (3x5 packed tokens), three steps."""
    name, model, pipeline = variant
    embedded = 2.5 if name == "dev" else None
    spec = DenoiseSpec(
        height=48,
        width=80,
        num_frames=1,
        num_inference_steps=3,
        guidance_scale=true_cfg,
        seed=4,
        embedded_guidance_scale=embedded,
    )
    texts = [PROMPT, NEGATIVE] if true_cfg > 1 else [PROMPT]
    latents = FluxDenoiser(model, CPU, torch.float32).denoise(
        spec, _conditioning(model, texts, 64), lambda *a: None, bool
    )
    arguments = dict(
        prompt=PROMPT,
        negative_prompt=NEGATIVE if true_cfg > 1 else None,
        true_cfg_scale=true_cfg,
        height=48,
        width=80,
        num_inference_steps=3,
        max_sequence_length=64,
        **({"guidance_scale": embedded} if embedded is not None else {}),
    )
    packed = pipeline(**arguments, generator=torch.Generator("cpu").manual_seed(4), output_type="latent").images
    expected = FluxPipeline._unpack_latents(packed, 48, 80, pipeline.vae_scale_factor).unsqueeze(2)
    assert latents.shape == (1, 16, 1, 6, 10)
    torch.testing.assert_close(latents, expected, rtol=0, atol=1e-5)

    frames = FluxDecoder(model, CPU, torch.float32).session().decode_next(latents)
    image = pipeline(**arguments, generator=torch.Generator("cpu").manual_seed(4), output_type="np").images
    reference = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
    difference = np.abs(frames.numpy().astype(np.int16) - reference.astype(np.int16)).max()
    print(f"{name}, true CFG {true_cfg}: {difference} levels off FluxPipeline")
    assert frames.shape == (1, 48, 80, 3) and difference <= 1 and reference.std() > 1.0


def test_embedded_guidance_changes_dev_and_is_required(flux_model: Path) -> None:
    denoiser = FluxDenoiser(flux_model, CPU, torch.float32)
    conditioning = _conditioning(flux_model, [PROMPT], 32)
    spec = DenoiseSpec(height=32, width=32, num_frames=1, num_inference_steps=2, guidance_scale=1.0, seed=0)
    with pytest.raises(ValueError, match="embedded_guidance_scale is required"):
        denoiser.denoise(spec, conditioning, lambda *a: None, bool)
    runs = [
        denoiser.denoise(
            DenoiseSpec(**{**spec.__dict__, "embedded_guidance_scale": scale}), conditioning, lambda *a: None, bool
        )
        for scale in (1.0, 6.0)
    ]
    assert not torch.equal(*runs)


def test_long_prompts_report_the_cut_each_tokenizer_makes(flux_model: Path) -> None:
    encoder = FluxPromptEncoder(flux_model, "flux", CPU, torch.float32)
    assert encoder.truncation(PROMPT, 64) is None
    long = "a red fox running through fresh snow " * 40
    cut = encoder.truncation(long, 64)
    assert cut is not None and cut.kept == 64 and cut.given > 64 and cut.encoder == ""
    # Past CLIP's 77 tokens but within T5's 512: CLIP's cut is the one reported.
    clip_only = "a red fox running through fresh snow " * 8
    cut = encoder.truncation(clip_only, 512)
    assert cut is not None and (cut.kept, cut.encoder) == (77, "CLIP") and cut.given > 77
