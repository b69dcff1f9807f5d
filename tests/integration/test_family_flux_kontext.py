"""FLUX.1 Kontext, stage by stage against FluxKontextPipeline: the reference image's size (the pipeline's
`_auto_resize` to its preferred resolutions), the VAE's Encode of the image, the DiT's latents and the VAE's
frames for an input image (the output's size left unset, then given with true CFG) and without one, and the
refusals of images the family cannot take, each naming the field. (The parallel layouts and offload are
tests/integration/test_family_features.py's, from the family's tester config.)
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux import pipeline_flux_kontext
from PIL import Image

from families.flux.decode import FluxDecoder
from families.flux.encode import FluxPromptEncoder
from families.flux_kontext.denoise import FluxKontextDenoiser
from families.flux_kontext.family import FLUX_KONTEXT, PREFERRED_KONTEXT_RESOLUTIONS, REFERENCE_SIZE
from families.flux_kontext.vae_encode import FluxKontextLatentEncoder
from stagekit.denoise import DenoiseSpec
from stagekit.errors import RequestError
from stagekit.images import DecodedImage
from tests.helpers.wan_i2v import input_image

TOLERANCE = 1e-4
CPU = torch.device("cpu")


def decoded(image: Image.Image) -> DecodedImage:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return DecodedImage("reference", image.convert("RGB"), hashlib.sha256(buffer.getvalue()).hexdigest())


def test_reference_size_is_the_pipelines_auto_resize() -> None:
    """The declared rule (families/base.py, no torch) picks what the pipeline's `_auto_resize` picks, from its
    own table, each side floored to the model's multiple: 16 for FLUX.1's VAE, 64 for the tiny 32x one."""
    assert tuple(pipeline_flux_kontext.PREFERRED_KONTEXT_RESOLUTIONS) == PREFERRED_KONTEXT_RESOLUTIONS
    assert FLUX_KONTEXT.images.size_from is REFERENCE_SIZE
    assert REFERENCE_SIZE.size(1920, 1080, 16) == (1392, 752)
    assert REFERENCE_SIZE.size(1080, 1920, 16) == (752, 1392)
    assert REFERENCE_SIZE.size(500, 500, 16) == (1024, 1024)
    assert REFERENCE_SIZE.size(256, 192, 64) == (1152, 832)  # 1184x880 floored to 64
    assert REFERENCE_SIZE.size(200, 120, 64) == (1536, 640)  # 192x64 first: (1568, 672)
    # Sides under the multiple have no aspect ratio: the pipeline divides by a height of 0.
    assert REFERENCE_SIZE.size(200, 15, 16) == (0, 0) and REFERENCE_SIZE.size(15, 200, 16) == (0, 0)
    with pytest.raises(ZeroDivisionError):
        FluxKontextPipeline.__call__(_SizeOnly(), image=input_image(200, 15, 0), prompt="x")


class _SizeOnly:
    """Just enough of a FluxKontextPipeline for `__call__` to reach its image resize (8x VAE)."""

    vae_scale_factor = 8
    default_sample_size = 128
    latent_channels = 16
    _execution_device = CPU
    joint_attention_kwargs = None
    image_processor = pipeline_flux_kontext.VaeImageProcessor(vae_scale_factor=16)

    def check_inputs(self, *args: Any, **kwargs: Any) -> None:
        pass

    def encode_prompt(self, **kwargs: Any) -> tuple[None, None, None]:
        return None, None, None


def stage_outputs(
    model_dir: Path, spec: DenoiseSpec, prompt: str, negative: str, image: Image.Image | None, decode: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """What the cluster's stages compute, in process: the text encoder's tensors, the VAE's Encode of the
    image, the DiT's latents and (with `decode`) the VAE's frames."""
    encoder = FluxPromptEncoder(model_dir, "m", CPU, torch.float32)
    texts = [prompt, negative] if spec.do_classifier_free_guidance else [prompt]
    batched, _ = encoder.encode(texts, 512, b"")
    conditioning = {}
    for row, role in enumerate(("prompt", "negative_prompt")[: len(texts)]):
        conditioning[f"{role}_embeds"] = batched["embeds"][row : row + 1]
        conditioning[f"{role}_pooled_embeds"] = batched["pooled_embeds"][row : row + 1]
    decoder = FluxDecoder(model_dir, CPU, torch.float32)
    denoiser = FluxKontextDenoiser(model_dir, CPU, torch.float32)
    if image is not None:
        conditioning.update(FluxKontextLatentEncoder(model_dir)(decoder, [decoded(image)], spec.height, spec.width, 1))
        assert tuple(conditioning["image_latents"].shape) == denoiser.image_tensor_shape("image_latents", spec)
    latents = denoiser.denoise(spec, conditioning, on_step=lambda step, total: None, cancelled=lambda: False)
    return conditioning, latents, decoder.session().decode_next(latents) if decode else None


def pipeline_outputs(
    pipeline: FluxKontextPipeline, spec: DenoiseSpec, prompt: str, negative: str, image: Any, decode: bool
) -> tuple[dict[str, torch.Tensor], torch.Tensor, np.ndarray | None]:
    """The pipeline's image latents, final latents (unpacked) and uint8 frames for the request: its height and
    width, `max_area` their product (so that the output is the request's size), true CFG with the negative
    prompt where the request guides, its `guidance_scale` the request's embedded guidance."""
    seen: dict[str, torch.Tensor] = {}
    prepare = pipeline.prepare_latents

    def recording_prepare(*args: Any, **kwargs: Any) -> Any:
        outputs = prepare(*args, **kwargs)
        seen["image_latents"], seen["image_ids"] = outputs[1], outputs[3]
        return outputs

    def last_latents(pipe: Any, step: int, timestep: Any, tensors: dict[str, torch.Tensor]) -> dict:
        seen["latents"] = tensors["latents"]
        return {}

    pipeline.prepare_latents = recording_prepare
    try:
        images = pipeline(
            image=image,
            prompt=prompt,
            negative_prompt=negative if spec.do_classifier_free_guidance else None,
            true_cfg_scale=spec.guidance_scale,
            guidance_scale=spec.embedded_guidance_scale,
            height=spec.height,
            width=spec.width,
            max_area=spec.height * spec.width,
            num_inference_steps=spec.num_inference_steps,
            generator=torch.Generator("cpu").manual_seed(spec.seed),
            callback_on_step_end=last_latents,
            output_type="np" if decode else "latent",
        ).images
    finally:
        del pipeline.prepare_latents
    latents = FluxKontextPipeline._unpack_latents(seen["latents"], spec.height, spec.width, pipeline.vae_scale_factor)
    frames = (np.clip(images, 0, 1) * 255).round().astype(np.uint8) if decode else None
    return seen, latents.unsqueeze(2), frames


# (the reference image's size (w, h) or None, and the request; no height and width: the image's resized size)
CASES = [
    # The output's size from the 256x192 image: 1152x832 (1184x880 floored to the tiny VAE's 64); latents only
    # (the decode is FLUX.1's, whose frames the other cases compare at a cheaper size).
    dict(image=(256, 192), prompt="make the fox red", guidance=1.0, embedded=3.5, seed=0, decode=False),
    # A portrait image, the output's size given, true CFG on top of another embedded guidance.
    dict(image=(90, 150), height=128, width=192, prompt="a hat", negative="blurry", guidance=2.5, embedded=2.0, seed=3),
    # No image: the pipeline generates from the text alone.
    dict(image=None, height=192, width=128, prompt="a boat on a lake", guidance=1.0, embedded=3.5, seed=5),
]


@pytest.mark.parametrize("case", CASES, ids=["size-from-image", "true-cfg", "no-image"])
def test_stage_outputs_equal_pipeline(
    flux_kontext_model: Path, flux_kontext_pipeline: FluxKontextPipeline, case: dict
) -> None:
    image = input_image(case["image"][0], case["image"][1], case["seed"]) if case["image"] else None
    if image is not None and "height" not in case:
        # The orchestrator's fill-in (services/orchestrator/request_images.py) with the tiny model's multiple.
        width, height = FLUX_KONTEXT.images.size_from.size(*image.size, 64)  # type: ignore[union-attr]
    else:
        width, height = case["width"], case["height"]
    spec = DenoiseSpec(
        height,
        width,
        1,
        2,
        case["guidance"],
        case["seed"],
        ("reference",) if image is not None else (),
        (image.size,) if image is not None else (),
        embedded_guidance_scale=case["embedded"],
    )
    negative = case.get("negative", "")
    decode = case.get("decode", True)
    conditioning, latents, frames = stage_outputs(flux_kontext_model, spec, case["prompt"], negative, image, decode)
    seen, expected_latents, expected_frames = pipeline_outputs(
        flux_kontext_pipeline, spec, case["prompt"], negative, image, decode
    )
    if image is not None:
        image_difference = (conditioning["image_latents"] - seen["image_latents"]).abs().max().item()
        print(f"image latents {tuple(seen['image_latents'].shape)}: max abs difference {image_difference:.2e}")
        assert image_difference <= 1e-5
        denoiser_ids = seen["image_ids"]
        assert (denoiser_ids[:, 0] == 1).all() and denoiser_ids.shape[0] == conditioning["image_latents"].shape[1]
    else:
        assert seen["image_latents"] is None
    assert latents.shape == expected_latents.shape == (1, 16, 1, height // 32, width // 32)
    difference = (latents - expected_latents).abs().max().item()
    print(f"{width}x{height}: latents max abs difference {difference:.2e}")
    assert difference <= TOLERANCE and expected_latents.std() > 0.1
    assert (frames is None) == (expected_frames is None) == (not decode)
    if frames is not None and expected_frames is not None:
        levels = np.abs(frames.numpy().astype(np.int16) - expected_frames.astype(np.int16)).max()
        print(f"{width}x{height}: frames {levels} levels off")
        assert frames.shape == expected_frames.shape == (1, height, width, 3) and levels <= 1


def test_images_the_family_cannot_take_are_refused_naming_the_field(flux_kontext_model: Path) -> None:
    """An image less than a multiple high or wide (the tiny VAE's 64 pixels) is refused by the VAE's Encode, has
    no latents' shape in the DiT, and gives no output size at the orchestrator; a second image is refused."""
    from services.input_images import image_roles
    from services.orchestrator.request_images import size_from_images
    from stagediff.v1 import generation_pb2, image_pb2, stages_pb2

    flat = input_image(200, 40, 0)
    decoder = FluxDecoder(flux_kontext_model, CPU, torch.float32)
    with pytest.raises(RequestError, match=r"images\[0\]: a 200x40 image has a side under 64 pixels"):
        FluxKontextLatentEncoder(flux_kontext_model)(decoder, [decoded(flat)], 128, 128, 1)
    denoiser = FluxKontextDenoiser(flux_kontext_model, CPU, torch.float32)
    spec = DenoiseSpec(128, 128, 1, 2, 1.0, 0, ("reference",), (flat.size,), embedded_guidance_scale=3.5)
    assert denoiser.image_tensor_shape("image_latents", spec) is None
    with pytest.raises(ValueError, match=r"image_latents \[1, 4, 64\] do not fit the request's image"):
        denoiser.denoise(spec, {"image_latents": torch.zeros(1, 4, 64)}, lambda s, t: None, lambda: False)

    limits = stages_pb2.ModelLimits(image_roles=FLUX_KONTEXT.images.roles, height_multiple=64, width_multiple=64)
    request = generation_pb2.GenerateRequest(model="m")
    request.images.add(width=200, height=40, role=image_pb2.IMAGE_ROLE_REFERENCE)
    assert size_from_images(request, limits, FLUX_KONTEXT.images) == (0, request.images[0], (0, 0))
    request.images[0].width, request.images[0].height = 256, 192
    assert size_from_images(request, limits, FLUX_KONTEXT.images) == (0, request.images[0], (1152, 832))
    reference = image_pb2.InputImage(role=image_pb2.IMAGE_ROLE_REFERENCE)
    with pytest.raises(RequestError, match=r"images\[1\].role: a second reference image"):
        image_roles([reference] * 2, FLUX_KONTEXT.images.roles, (), "m")
    assert image_roles([], FLUX_KONTEXT.images.roles, (), "m") == []  # the image is optional
