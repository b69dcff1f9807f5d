"""LTX-2 image-to-video (`ltx-2-i2v`) against LTX2ImageToVideoPipeline, on tiny checkpoints in both published layouts
("tiny": LTX-2.3's, "tiny-2.0": LTX-2.0's), 2 steps at the pipeline's default guidance.

The VAE stage's Encode of the first frame (re-compressed as H.264 at the pipeline's default CRF, resized, encoded,
normalised) equals the latents the pipeline's `prepare_latents` puts at latent frame 0; the denoiser's video and
audio latents from those and the family's text encoder's tensors equal `LTX2ImageToVideoPipeline(output_type=
"latent")`'s from the same image, prompts and seed. The text encoder and the sound's decode are text-to-video's
(tests/integration/test_family_ltx2.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers.pipelines.ltx2.utils import resolve_default_image_crf
from PIL import Image

from families.base import DEFAULTS_FILE
from families.ltx2.decode import LTX2Decoder
from families.ltx2.denoise import LTX2Denoiser
from families.ltx2.family import LTX2, LTX2_I2V
from families.ltx2.init_model import DEFAULT_REQUESTS
from families.ltx2.vae_encode import LATENTS_NAME, LTX2ImageLatentEncoder
from families.registry import FAMILIES, family_for_index
from stagekit.denoise import DenoiseSpec
from stagekit.images import DecodedImage
from tests.helpers.ltx2 import (
    conditioning,
    reference_pipeline,
    run_pipeline,
    tiny_checkpoint,
)
from tests.helpers.wan_i2v import input_image

CPU = torch.device("cpu")
# 64x96 pixels: 2x3 latents; 17 frames: 3 latent frames, and at 24 fps 18 audio latent frames.
SPEC = DenoiseSpec(
    height=64, width=96, num_frames=17, num_inference_steps=2, guidance_scale=3.0, seed=7, image_roles=("first_frame",)
)
TOLERANCE = 1e-5


@dataclass
class Reference:
    """LTX2ImageToVideoPipeline's de-normalised (video, audio) latents (those its decoders received, what its
    output_type="latent" returns) and the normalised latents its `prepare_latents` put at latent frame 0
    [1, C, 1, h, w]."""

    video: torch.Tensor
    audio: torch.Tensor
    first_frame: torch.Tensor


@pytest.fixture(scope="module", params=["tiny", "tiny-2.0"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(str(request.param), tmp_path_factory, LTX2_I2V)


@pytest.fixture(scope="module")
def image() -> Image.Image:
    """A 100x70 first frame: the pipeline resizes it to 96x64 whatever its aspect ratio."""
    return input_image(100, 70, 3)


@pytest.fixture(scope="module")
def pipeline(model: Path) -> Any:
    return reference_pipeline(model, image_to_video=True)


@pytest.fixture(scope="module")
def reference(pipeline: Any, image: Image.Image) -> Reference:
    prepared: dict[str, torch.Tensor] = {}
    prepare_latents = pipeline.prepare_latents

    def recording(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        latents, mask = prepare_latents(*args, **kwargs)
        prepared["latents"] = latents.detach().clone()
        return latents, mask

    pipeline.prepare_latents = recording
    try:
        run = run_pipeline(pipeline, SPEC, image=image)
    finally:
        del pipeline.prepare_latents
    # Packed [1, T*h*w, C] with 1x1x1 patches: the first h*w tokens are latent frame 0.
    frame = SPEC.height // 32 * (SPEC.width // 32)
    first = prepared["latents"][:, :frame].transpose(1, 2)
    first_frame = first.reshape(1, -1, 1, SPEC.height // 32, SPEC.width // 32)
    return Reference(run.video_latents, run.audio_latents, first_frame)


@pytest.fixture(scope="module")
def image_latents(model: Path, image: Image.Image) -> torch.Tensor:
    """The VAE stage's Encode of the first frame."""
    encoder = LTX2ImageLatentEncoder(model)
    decoder = LTX2Decoder(model, CPU, torch.float32)
    images = [DecodedImage("first_frame", image, "")]
    return encoder(decoder, images, SPEC.height, SPEC.width, SPEC.num_frames)[LATENTS_NAME]


def test_encode_equals_the_pipelines_first_frame_latents(
    model: Path, pipeline: Any, image: Image.Image, image_latents: torch.Tensor, reference: Reference
) -> None:
    """The normalised latents of the image re-compressed at the pipeline's default CRF (33 for Gemma 3), as
    prepare_latents puts them at latent frame 0; without the re-compression they differ."""
    assert LTX2ImageLatentEncoder(model).crf == resolve_default_image_crf(pipeline.text_encoder) == 33
    assert image_latents.shape == reference.first_frame.shape == (1, 8, 1, 2, 3)
    assert image_latents.dtype == torch.float32
    difference = (image_latents - reference.first_frame).abs().max().item()
    print(f"image latents {tuple(image_latents.shape)}: max abs diff {difference:.2e} from the pipeline's")
    assert difference <= TOLERANCE and reference.first_frame.abs().max() > 0.1

    uncompressed = LTX2ImageLatentEncoder(model)
    uncompressed.crf = 0
    decoder = LTX2Decoder(model, CPU, torch.float32)
    plain = uncompressed(decoder, [DecodedImage("first_frame", image, "")], SPEC.height, SPEC.width, 17)
    assert (plain[LATENTS_NAME] - reference.first_frame).abs().max() > 1e-4


def test_denoiser_latents_equal_pipeline(
    model: Path, image_latents: torch.Tensor, reference: Reference, request: pytest.FixtureRequest
) -> None:
    """The video and audio latents from the Encode's first frame, the text encoder's tensors and the seed equal the
    pipeline's; the first latent frame is the image's, de-normalised."""
    denoiser = LTX2Denoiser(model, CPU, torch.float32)
    assert denoiser.image_tensor_shape(LATENTS_NAME, SPEC) == tuple(image_latents.shape)
    assert denoiser.image_tensor_shape(LATENTS_NAME, replace(SPEC, image_roles=())) is None
    assert denoiser.image_tensor_shape("image_embeds", SPEC) is None
    tensors = {**conditioning(model), LATENTS_NAME: image_latents}
    steps: list[tuple[int, int]] = []
    video, audio = denoiser.denoise_av(
        SPEC, tensors, on_step=lambda step, total: steps.append((step, total)), cancelled=lambda: False
    )
    assert steps == [(1, 2), (2, 2)]
    assert video.shape == reference.video.shape == (1, 8, 3, 2, 3) and video.dtype == torch.float32
    assert audio.shape == reference.audio.shape == (1, 4, 18, 4) and audio.dtype == torch.float32
    video_difference = (video - reference.video).abs().max().item()
    audio_difference = (audio - reference.audio).abs().max().item()
    print(
        f"{request.node.name}: video latents max abs diff {video_difference:.2e}, audio latents {audio_difference:.2e}"
    )
    assert video_difference <= TOLERANCE and audio_difference <= TOLERANCE
    assert reference.video.abs().max() > 0.1 and reference.audio.abs().max() > 0.1
    # Latent frame 0 is the image's latents, de-normalised as the pipeline ends (scaling factor 1 here).
    stats, scaling = denoiser.video_statistics, denoiser.scaling_factor
    first = image_latents * stats.std.view(1, -1, 1, 1, 1) / scaling + stats.mean.view(1, -1, 1, 1, 1)
    assert (video[:, :, :1] - first).abs().max() <= TOLERANCE

    with pytest.raises(ValueError, match="image_latents: shape"):
        denoiser.denoise_av(
            SPEC, {**tensors, LATENTS_NAME: image_latents[..., :2]}, lambda step, total: None, lambda: False
        )


def test_the_checkpoint_names_the_image_to_video_pipeline(model: Path) -> None:
    """init-model's checkpoint for `ltx-2-i2v` is text-to-video's weights under LTX2ImageToVideoPipeline, which
    the registry serves as the image-to-video family: the first frame required, its latents from the VAE stage."""
    index = json.loads((model / "model_index.json").read_text())
    assert index["_class_name"] == "LTX2ImageToVideoPipeline"
    assert family_for_index(index) is LTX2_I2V is FAMILIES["ltx-2-i2v"]
    assert family_for_index({**index, "_class_name": "LTX2Pipeline"}) is LTX2
    assert LTX2_I2V.images.roles == LTX2_I2V.images.required == ("first_frame",)
    assert LTX2_I2V.images.encoded_by == ("vae",) and LTX2_I2V.images.size_from is None
    (slot,) = [slot for slot in LTX2_I2V.conditioning if slot.image]
    assert (slot.name, slot.source, slot.needed) == (LATENTS_NAME, "vae", "always")
    assert LTX2_I2V.defaults == LTX2.defaults
    defaults = json.loads((model / DEFAULTS_FILE).read_text())["default_request"]
    assert defaults == {**DEFAULT_REQUESTS["tiny"], "fps": 24.0}
