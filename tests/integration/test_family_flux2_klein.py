"""FLUX.2 klein, stage by stage against Flux2KleinPipeline on the tiny checkpoints of both kinds.

The text encoder's embeddings equal the pipeline's encode_prompt; its embeddings through the DiT's loop equal the
pipeline's `output_type="latent"` latents (the step-distilled kind, which ignores guidance as the pipeline does,
and the base kind with CFG against the empty negative prompt the pipeline uses); the VAE stage's frames equal the
pipeline's `output_type="np"` image within one level; a prompt longer than the sequence is reported cut where
the pipeline cuts it. The DiT's features (offload, quantization, parallel layouts, MagCache) are checked by
Flux2KleinTesterConfig (tests/integration/test_family_features.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from families.flux2_klein.checkpoint import BASE_DEFAULTS, DISTILLED_DEFAULTS, read_geometry
from families.flux2_klein.decode import Flux2KleinDecoder
from families.flux2_klein.denoise import Flux2KleinDenoiser
from families.flux2_klein.encode import Flux2KleinPromptEncoder
from families.registry import family_for_index
from stagekit.denoise import DenoiseSpec
from stagekit.weights import load_stats
from tests.helpers.feature_mixins import assert_same_tensors

CPU = torch.device("cpu")
PROMPT = "A red fox trots across a snowy field at dawn, cinematic lighting"
# Flux2KleinPipeline's max_sequence_length default, which every text is padded to; the loops run a shorter one
# (the pipeline's argument), which keeps the tiny transformer's attention small.
SEQUENCE = 512
LOOP_SEQUENCE = 64
# 48x80: 3 x 5 packed image tokens.
SPEC = DenoiseSpec(height=48, width=80, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=5)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def checkpoints(klein_model: Path, klein_base_model: Path) -> dict[str, Path]:
    return {"distilled": klein_model, "base": klein_base_model}


@pytest.fixture(scope="module")
def pipelines(klein_pipeline, klein_base_pipeline) -> dict[str, object]:
    return {"distilled": klein_pipeline, "base": klein_base_pipeline}


def pipeline_output(pipeline, spec: DenoiseSpec, output_type: str):
    return pipeline(
        prompt=PROMPT,
        height=spec.height,
        width=spec.width,
        num_inference_steps=spec.num_inference_steps,
        guidance_scale=spec.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(spec.seed),
        output_type=output_type,
        max_sequence_length=LOOP_SEQUENCE,
    ).images


_LATENTS: dict[tuple[str, DenoiseSpec], torch.Tensor] = {}


def our_latents(model_dir: Path, spec: DenoiseSpec) -> torch.Tensor:
    """The text encoder's prompt and empty negative prompt (the pipeline's) through the DiT's loop, in the DiT's
    layout; once per checkpoint and request in this module."""
    key = (str(model_dir), spec)
    if key not in _LATENTS:
        encoder = Flux2KleinPromptEncoder(model_dir, "klein", CPU, torch.float32)
        embeds = encoder.encode([PROMPT, ""], LOOP_SEQUENCE)[0]["embeds"]
        conditioning = {"prompt_embeds": embeds[:1], "negative_prompt_embeds": embeds[1:]}
        denoiser = Flux2KleinDenoiser(model_dir, CPU, torch.float32)
        _LATENTS[key] = denoiser.denoise(spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)
    return _LATENTS[key]


def test_klein_checkpoints_are_recognised_with_their_kind(checkpoints: dict[str, Path]) -> None:
    """Both kinds are the flux2-klein family; model_index.json's is_distilled chooses the defaults, and the
    geometry is the transformer's: 2x2 patchified latents, 16 pixels per latent row."""
    for kind, model_dir in checkpoints.items():
        index = json.loads((model_dir / "model_index.json").read_text())
        family = family_for_index(index)
        assert family is not None and family.name == "flux2-klein"
        configs = {name: json.loads((model_dir / name / "config.json").read_text()) for name in ("vae", "transformer")}
        geometry = read_geometry({**configs, "model_index": index})
        transformer = configs["transformer"]
        assert geometry["latent_channels"] == transformer["in_channels"] and geometry["vae_scale_spatial"] == 16
        assert geometry["defaults"] == (DISTILLED_DEFAULTS if kind == "distilled" else BASE_DEFAULTS), kind


def test_klein_encoder_equals_pipeline_encode_prompt(klein_model: Path, klein_pipeline) -> None:
    encoder = Flux2KleinPromptEncoder(klein_model, "klein", CPU, torch.float32)
    tensors, cached = encoder.encode([PROMPT, ""], SEQUENCE)
    assert not cached and tensors["embeds"].shape == (
        2,
        SEQUENCE,
        klein_pipeline.transformer.config.joint_attention_dim,
    )
    for row, text in enumerate([PROMPT, ""]):
        expected, text_ids = klein_pipeline.encode_prompt(text, device=CPU)
        assert torch.equal(tensors["embeds"][row], expected[0]), text
        assert text_ids[0, :, 3].tolist() == list(range(SEQUENCE))
    assert encoder.encode([PROMPT], SEQUENCE)[1], "the second request is the cache's"


@pytest.mark.parametrize("kind", ["distilled", "base"])
def test_klein_latents_equal_pipeline(checkpoints: dict[str, Path], pipelines: dict[str, object], kind: str) -> None:
    """The DiT's latents, de-normalised and unpatchified by the VAE stage, equal the pipeline's within 1e-5; the
    distilled kind ignores guidance (as the pipeline does), the base kind runs CFG."""
    model_dir = checkpoints[kind]
    latents = our_latents(model_dir, SPEC)
    expected = pipeline_output(pipelines[kind], SPEC, "latent")
    ours = Flux2KleinDecoder(model_dir, CPU, torch.float32).vae_latents(latents[:, :, 0])
    difference = (ours - expected).abs().max().item()
    print(f"{kind}: latents {tuple(latents.shape)}, pipeline {tuple(expected.shape)}, max abs diff {difference:.2e}")
    assert ours.shape == expected.shape == (1, 8, 6, 10) and expected.std() > 0.1
    assert difference <= TOLERANCE

    unguided = our_latents(model_dir, dataclasses.replace(SPEC, guidance_scale=1.0))
    assert torch.equal(unguided, latents) == (kind == "distilled"), kind


def test_klein_decoder_frames_equal_pipeline_image(klein_base_model: Path, klein_base_pipeline) -> None:
    latents = our_latents(klein_base_model, SPEC)
    frames = Flux2KleinDecoder(klein_base_model, CPU, torch.float32).session().decode_next(latents)
    image = pipeline_output(klein_base_pipeline, SPEC, "np")
    expected = torch.from_numpy(np.round(image[0] * 255).astype(np.int16))
    levels = (frames[0].to(torch.int16) - expected).abs().max().item()
    print(f"frames {tuple(frames.shape)}: max difference {levels} levels")
    assert frames.shape == (1, SPEC.height, SPEC.width, 3) and frames.dtype == torch.uint8
    assert levels <= 1 and frames.float().std() > 1


def test_klein_long_prompt_reports_truncation(klein_model: Path, klein_pipeline) -> None:
    """The chat-rendered prompt's tokens beyond max_sequence_length are reported, and the embedding kept is the
    pipeline's, which cuts there too; a short prompt is not reported."""
    encoder = Flux2KleinPromptEncoder(klein_model, "klein", CPU, torch.float32)
    long_prompt = ", ".join([PROMPT] * 60)
    truncation = encoder.truncation(long_prompt, SEQUENCE)
    assert truncation is not None and truncation.kept == SEQUENCE and truncation.given > SEQUENCE
    assert truncation.given == len(encoder.tokenizer(encoder.chat(long_prompt)).input_ids)
    assert encoder.truncation(PROMPT, SEQUENCE) is None
    expected, _ = klein_pipeline.encode_prompt(long_prompt, device=CPU)
    assert torch.equal(encoder.encode_one(long_prompt, SEQUENCE)[0], expected[0])


def test_klein_stages_read_weights_with_their_load_threads(klein_model: Path, klein_pipeline) -> None:
    """The text-encoder and VAE stages read their component with the stage's thread count and hold the
    pipeline's weights (the DiT's: TestFlux2KleinLoading)."""
    encoder = Flux2KleinPromptEncoder(klein_model, "klein", CPU, torch.float32, load_threads=3)
    decoder = Flux2KleinDecoder(klein_model, CPU, torch.float32, load_threads=2)
    for name, model, threads in (("text_encoder", encoder.text_encoder, 3), ("vae", decoder.vae, 2)):
        assert load_stats(model).threads == threads, name
        assert_same_tensors(model, getattr(klein_pipeline, name), name)
    assert decoder.latent_channels == klein_pipeline.transformer.config.in_channels


@pytest.mark.parametrize(
    ("stage", "flags", "feature"),
    [
        ("vae", ["--vae-use-tiling"], "vae_tiling"),
    ],
)
def test_klein_stages_refuse_what_the_family_does_not_run(
    klein_base_model: Path, stage: str, flags: list[str], feature: str
) -> None:
    """Each refused flag names the family's reason; the layouts and options it claims pass the same checks."""
    from dit_svc.config import DitConfig
    from families.registry import FAMILIES
    from tests.helpers.serving import parse_serve
    from vae_svc.config import VaeConfig

    config = DitConfig if stage == "dit" else VaeConfig
    with pytest.raises(SystemExit) as refused:
        config.from_args(parse_serve([stage, "--model", str(klein_base_model), *flags]))
    message = str(refused.value)
    assert "the flux2-klein family does not support" in message, message
    assert FAMILIES["flux2-klein"].support(feature).reason in message, message
    claimed = (
        ["--ulysses-degree", "2", "--ring-degree", "2"],
        ["--cfg-parallel-size", "2", "--use-hsdp", "--hsdp-shard-size", "2"],
        ["--enable-layerwise-offload", "--quantization", "fp8"],
        ["--tensor-parallel-size", "2", "--ulysses-degree", "2"],
    )
    for accepted in claimed:
        DitConfig.from_args(parse_serve(["dit", "--model", str(klein_base_model), *accepted]))
