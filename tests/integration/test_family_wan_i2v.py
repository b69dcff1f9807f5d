"""Wan image-to-video families, stage by stage against WanImageToVideoPipeline (and WanPipeline for TI2V's
text-to-video): the text encoder's CLIP embedding, the VAE's Encode and the DiT's latents on one rank. (The
parallel layouts, offload, quantization and loading are tests/integration/test_family_features.py's, from
the families' tester configs.)
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
from PIL import Image

from families.init_model import init_model
from families.wan.decode import WanStreamingDecoder
from families.wan_i2v.denoise import WanImageToVideoDenoiser
from families.wan_i2v.encode import WanImageConditionEncoder
from families.wan_i2v.vae_encode import WanImageLatentEncoder
from services.checkpoint import read_checkpoint
from stagekit.denoise import DenoiseSpec
from stagekit.images import DecodedImage
from tests.helpers.wan_i2v import input_image

TOLERANCE = 1e-4
CPU = torch.device("cpu")
FAMILY_NAMES = ("wan-i2v", "wan2.2-i2v-a14b", "wan2.2-ti2v")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wan-i2v-models")
    return {name: init_model(name, "tiny", root / name, seed=0) for name in FAMILY_NAMES}


def decoded(image: Image.Image, role: str) -> DecodedImage:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return DecodedImage(role, image.convert("RGB"), str(hash(buffer.getvalue())))


def stage_latents(model_dir: Path, spec: DenoiseSpec, prompt: str, negative: str, images: list[DecodedImage]):
    """What the cluster's stages compute, in process: conditioning, image latents, then the DiT's latents."""
    checkpoint = read_checkpoint(model_dir)
    encoder_class = checkpoint.traits.load("text_encoder")
    encoder = encoder_class(model_dir, "m", CPU, torch.float32)
    texts = [prompt, negative] if spec.do_classifier_free_guidance else [prompt]
    batched, _ = encoder.encode(texts, 512)
    conditioning = {"prompt_embeds": batched["embeds"][0:1]}
    if spec.do_classifier_free_guidance:
        conditioning["negative_prompt_embeds"] = batched["embeds"][1:2]
    if images and isinstance(encoder, WanImageConditionEncoder):
        conditioning["image_embeds"], _ = encoder.encode_images([item.image for item in images], ["d"])
    if images:
        decoder = WanStreamingDecoder(model_dir, CPU, torch.float32)
        conditioning.update(WanImageLatentEncoder(model_dir)(decoder, images, spec.height, spec.width, spec.num_frames))
    denoiser = WanImageToVideoDenoiser(model_dir, CPU, torch.float32)
    return denoiser.denoise(spec, conditioning, on_step=lambda s, t: None, cancelled=lambda: False)


def pipeline_latents(model_dir: Path, spec: DenoiseSpec, prompt: str, negative: str, image, last_image=None):
    common = dict(
        prompt=prompt,
        negative_prompt=negative,
        height=spec.height,
        width=spec.width,
        num_frames=spec.num_frames,
        num_inference_steps=spec.num_inference_steps,
        guidance_scale=spec.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(spec.seed),
        output_type="latent",
    )
    if image is None:
        return WanPipeline.from_pretrained(model_dir)(**common).frames
    pipeline = WanImageToVideoPipeline.from_pretrained(model_dir)
    return pipeline(image=image, last_image=last_image, **common).frames


# (family, spec, input image size (w, h), with a last frame)
CASES = [
    ("wan-i2v", DenoiseSpec(64, 64, 9, 2, 5.0, 0, ("first_frame",)), (50, 40), False),
    ("wan-i2v", DenoiseSpec(48, 80, 5, 3, 1.0, 3, ("first_frame",)), (80, 48), False),
    ("wan2.2-i2v-a14b", DenoiseSpec(64, 64, 9, 4, 5.0, 1, ("first_frame",)), (33, 61), False),
    ("wan2.2-i2v-a14b", DenoiseSpec(48, 64, 9, 2, 4.0, 2, ("first_frame", "last_frame")), (64, 48), True),
    ("wan2.2-ti2v", DenoiseSpec(64, 64, 9, 2, 5.0, 0, ("first_frame",)), (50, 70), False),
    ("wan2.2-ti2v", DenoiseSpec(64, 96, 5, 2, 1.0, 4, ()), None, False),
]


@pytest.mark.parametrize(("family", "spec", "size", "last"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_stage_latents_equal_pipeline(checkpoints, family, spec, size, last) -> None:
    first = input_image(*size, seed=spec.seed) if size is not None else None
    last_image = input_image(*size, seed=spec.seed + 100) if last else None
    images = [] if first is None else [decoded(first, "first_frame")]
    if last_image is not None:
        images.append(decoded(last_image, "last_frame"))
    prompt, negative = "a red fox runs", "blurry"
    ours = stage_latents(checkpoints[family], spec, prompt, negative, images)
    reference = pipeline_latents(checkpoints[family], spec, prompt, negative, first, last_image)
    assert ours.shape == reference.shape
    difference = (ours - reference).abs().max().item()
    assert difference <= TOLERANCE, f"{family}: max abs difference {difference:.2e}"


@pytest.fixture(scope="module")
def flf2v_checkpoint(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A first-last-frame Wan2.1 checkpoint (FLF2V): the image embedder has position embeddings for two images."""
    import shutil

    from diffusers import WanTransformer3DModel

    out = tmp_path_factory.mktemp("flf2v") / "flf2v"
    shutil.copytree(checkpoints["wan-i2v"], out)
    config = WanTransformer3DModel.load_config(out / "transformer")
    tokens = 2 * 17  # two CLIP embeddings of the tiny image encoder: (32 / 8)^2 + 1 tokens each
    torch.manual_seed(3)
    transformer = WanTransformer3DModel.from_config({**config, "pos_embed_seq_len": tokens})
    torch.nn.init.normal_(transformer.condition_embedder.image_embedder.pos_embed, std=0.5)
    transformer.save_pretrained(out / "transformer")
    return out


def test_first_last_frame_checkpoint_requires_both_frames_and_equals_pipeline(flf2v_checkpoint) -> None:
    checkpoint = read_checkpoint(flf2v_checkpoint)
    assert checkpoint.image_roles == checkpoint.required_image_roles == ("first_frame", "last_frame")
    spec = DenoiseSpec(64, 48, 9, 2, 5.0, 6, ("first_frame", "last_frame"))
    first, last = input_image(60, 40, seed=6), input_image(40, 60, seed=7)
    images = [decoded(first, "first_frame"), decoded(last, "last_frame")]
    ours = stage_latents(flf2v_checkpoint, spec, "a red fox runs", "blurry", images)
    reference = pipeline_latents(flf2v_checkpoint, spec, "a red fox runs", "blurry", first, last)
    difference = (ours - reference).abs().max().item()
    assert difference <= TOLERANCE, f"max abs difference {difference:.2e}"


@pytest.mark.parametrize("family", ["wan-i2v", "wan2.2-ti2v"])
def test_vae_encode_equals_latent_dist_mode(checkpoints, family) -> None:
    """The VAE's Encode is the mode of `vae.encode(...).latent_dist`, normalised, as the pipeline takes it."""
    model_dir = checkpoints[family]
    decoder = WanStreamingDecoder(model_dir, CPU, torch.float32)
    image = input_image(50, 40, seed=5)
    height, width, frames = 64, 64, 9
    ours = WanImageLatentEncoder(model_dir)(decoder, [decoded(image, "first_frame")], height, width, frames)
    pipeline = WanImageToVideoPipeline.from_pretrained(model_dir)
    pixels = pipeline.video_processor.preprocess(image, height=height, width=width).unsqueeze(2)
    if not pipeline.config.expand_timesteps:
        pixels = torch.cat([pixels, pixels.new_zeros(1, 3, frames - 1, height, width)], dim=2)
    mode = retrieve_latents(pipeline.vae.encode(pixels), sample_mode="argmax")
    assert torch.equal(mode, pipeline.vae.encode(pixels).latent_dist.mode())
    config = pipeline.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    expected = (mode - mean) * (1.0 / std)
    assert ours["image_latents"].shape == expected.shape
    assert (ours["image_latents"] - expected).abs().max().item() <= 1e-5
