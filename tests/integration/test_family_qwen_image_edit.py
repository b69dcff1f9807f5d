"""Qwen-Image-Edit and Qwen-Image-Edit-Plus, stage by stage against QwenImageEditPipeline and
QwenImageEditPlusPipeline: the output size from the input image, the text encoder's Qwen2.5-VL embeddings
with the images, the VAE's Encode, the DiT's latents on one rank, and what the orchestrator records of the
images. (The parallel layouts, offload, quantization and loading are tests/integration/test_family_features.py's,
from the families' tester configs.)
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from PIL import Image

from families.base import calculate_dimensions
from families.init_model import init_model
from families.qwen_image.decode import QwenImageDecoder
from families.qwen_image_edit.denoise import QwenImageEditDenoiser
from families.qwen_image_edit.encode import QwenImageEditPromptEncoder, load_processor
from families.qwen_image_edit.family import QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS
from families.qwen_image_edit.vae_encode import QwenImageEditLatentEncoder
from families.registry import FAMILIES
from services.input_images import image_roles
from stagekit.denoise import DenoiseSpec
from stagekit.errors import RequestError
from stagekit.images import DecodedImage
from tests.helpers.qwen_image_edit import EDIT, PLUS
from tests.helpers.wan_i2v import input_image

TOLERANCE = 1e-4
CPU = torch.device("cpu")
PIPELINES = {EDIT: QwenImageEditPipeline, PLUS: QwenImageEditPlusPipeline}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-edit-models")
    return {name: init_model(name, "tiny", root / name, seed=0) for name in (EDIT, PLUS)}


def pipeline(model_dir: Path):
    """The family's diffusers pipeline from the checkpoint; its processor as `from_pretrained` loads it where
    torchvision is installed (test_processor_loads_as_the_pipeline_loads_it)."""
    family = EDIT if "Plus" not in (model_dir / "model_index.json").read_text() else PLUS
    return PIPELINES[family].from_pretrained(model_dir, processor=load_processor(model_dir / "processor"))


def decoded(image: Image.Image) -> DecodedImage:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return DecodedImage("reference", image.convert("RGB"), hashlib.sha256(buffer.getvalue()).hexdigest())


def output_size(family: str, images: list[Image.Image]) -> tuple[int, int]:
    """(width, height) the family takes from the request's images when it leaves the size unset."""
    size_from = FAMILIES[family].images.size_from
    return size_from.size(*images[size_from.index].size)


def test_calculate_dimensions_is_the_pipelines() -> None:
    """The declared size rule (families/base.py, no torch) is the pipelines' `calculate_dimensions`."""
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (56, 40), (33, 61), (4096, 7), (7, 4096), (1920, 1080), (1000, 1001), (3, 2)]
    sizes += [tuple(int(v) for v in rng.integers(1, 4097, 2)) for _ in range(300)]
    for width, height in sizes:
        ratio = width / height
        assert (
            calculate_dimensions(1024 * 1024, width, height, 32)
            == pipeline_qwenimage_edit.calculate_dimensions(1024 * 1024, ratio)[:2]
        )
        for area in (1024 * 1024, 384 * 384):
            assert calculate_dimensions(area, width, height, 32) == pipeline_qwenimage_edit_plus.calculate_dimensions(
                area, ratio
            )
    # Edit sizes by the first image, Edit-Plus by the last, as their pipelines do.
    first, last = input_image(56, 40, 0), input_image(30, 70, 1)
    assert output_size(EDIT, [first]) == (1216, 864)
    assert output_size(PLUS, [first, last]) == (672, 1568)


def test_orchestrator_records_the_decoded_size_and_takes_the_output_size_from_it() -> None:
    """The job records each image's size as decoded (EXIF orientation applied), and the size rule sees that."""
    from services.orchestrator.request_images import complete_images, size_from_images, verify_images
    from stagediff.v1 import generation_pb2, stages_pb2

    exif = Image.Exif()
    exif[0x0112] = 6  # stored 56x40, shown (and decoded) 40x56
    buffer = io.BytesIO()
    input_image(56, 40, 0).save(buffer, format="JPEG", exif=exif)
    plain = io.BytesIO()
    input_image(70, 30, 1).save(plain, format="PNG")
    for family, data, expected in (
        (QWEN_IMAGE_EDIT, [buffer.getvalue()], (864, 1216)),
        # Edit-Plus: the last image's aspect ratio.
        (QWEN_IMAGE_EDIT_PLUS, [buffer.getvalue(), plain.getvalue()], (1568, 672)),
    ):
        limits = stages_pb2.ModelLimits(
            image_roles=family.images.roles,
            required_image_roles=family.images.required,
            max_images=len(family.images.roles),
            max_image_bytes=1 << 20,
            max_image_pixels=1 << 20,
        )
        request = generation_pb2.GenerateRequest(model="m")
        for item in data:
            request.images.add(data=item)
        complete_images(request, limits)
        assert (request.images[0].width, request.images[0].height) == (40, 56)
        index, image, size = size_from_images(request, limits, family.images)
        assert index == len(data) - 1 and image == request.images[-1]
        assert size == expected
        verify_images(request, limits)  # the whole decode gives the recorded sizes
    # A recorded size the decode does not give is refused.
    request.images[0].width, request.images[0].height = 56, 40
    with pytest.raises(RequestError, match=r"images\[0\].data: the image decodes to 40x56, not the 56x40"):
        verify_images(request, limits)


def test_reference_images_may_repeat_up_to_the_models_count() -> None:
    from stagediff.v1 import image_pb2

    roles = QWEN_IMAGE_EDIT_PLUS.images.roles
    reference = image_pb2.InputImage(role=image_pb2.IMAGE_ROLE_REFERENCE)
    unspecified = image_pb2.InputImage()
    assert image_roles([unspecified, reference, reference], roles, ("reference",), "m") == ["reference"] * 3
    with pytest.raises(RequestError, match=r"images\[3\].role: 4 reference images; model 'm' takes at most 3"):
        image_roles([reference] * 4, roles, ("reference",), "m")
    with pytest.raises(RequestError, match=r"images\[1\].role: a second reference image"):
        image_roles([reference] * 2, QWEN_IMAGE_EDIT.images.roles, ("reference",), "m")


def test_processor_loads_as_the_pipeline_loads_it(checkpoints) -> None:
    """The checkpoint's processor directory holds what Qwen2VLProcessor.from_pretrained reads. Where torchvision
    is missing transformers cannot build a Qwen2VLProcessor at all (its video processor needs torchvision), and
    the pipelines' text and image processing runs on the same class without that part."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.utils import is_torchvision_available

    directory = checkpoints[EDIT] / "processor"
    processor = load_processor(directory)
    assert isinstance(processor, Qwen2VLProcessor)
    if is_torchvision_available():
        assert type(processor) is Qwen2VLProcessor
        assert type(QwenImageEditPipeline.from_pretrained(checkpoints[EDIT]).processor) is Qwen2VLProcessor
    else:
        with pytest.raises(ImportError, match="Torchvision"):
            Qwen2VLProcessor.from_pretrained(directory)
    image_processor = AutoImageProcessor.from_pretrained(directory)
    assert image_processor.to_dict()["image_processor_type"] == "Qwen2VLImageProcessor"
    assert image_processor.size == processor.image_processor.size == {"shortest_edge": 3136, "longest_edge": 12544}
    tokenizer = AutoTokenizer.from_pretrained(checkpoints[EDIT] / "tokenizer")
    assert processor.tokenizer.get_vocab() == tokenizer.get_vocab()
    # Every other component loads unchanged.
    loaded = pipeline(checkpoints[EDIT])
    assert type(loaded.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(loaded.tokenizer).__name__ == "Qwen2Tokenizer"


@pytest.mark.parametrize("family", [EDIT, PLUS])
def test_prompt_embeds_equal_pipeline_encode_prompt(checkpoints, family) -> None:
    """Qwen2.5-VL with the images as encode_prompt runs it, for prompt and negative prompt; cached on the images."""
    model_dir = checkpoints[family]
    reference = pipeline(model_dir)
    images = [input_image(56, 40, 0)] if family == EDIT else [input_image(56, 40, 0), input_image(30, 90, 1)]
    items = [decoded(image) for image in images]
    if family == EDIT:
        # QwenImageEditPipeline: the image resized to the output's calculated size.
        width, height = output_size(EDIT, images)
        prompt_images = reference.image_processor.resize(images[0], height, width)
    else:
        prompt_images = [
            reference.image_processor.resize(image, *calculate_dimensions(384 * 384, *image.size, 32)[::-1])
            for image in images
        ]
    encoder = QwenImageEditPromptEncoder(model_dir, "m", CPU, torch.float32)
    texts = ["a red fox wearing a hat", "blurry"]
    batched, hit = encoder.encode(texts, 512, b"ns", [i.image for i in items], [i.sha256 for i in items])
    assert not hit
    vision_tokens = 0
    for row, text in enumerate(texts):
        embeds, mask = reference.encode_prompt(text, image=prompt_images, device=CPU)
        length = embeds.shape[1]
        assert mask is None  # a batch of one: all ones, dropped as the pipeline drops it
        assert torch.equal(batched["embeds_mask"][row, :length], torch.ones(length, dtype=torch.long))
        assert not batched["embeds_mask"][row, length:].any()
        assert torch.equal(batched["embeds"][row : row + 1, :length], embeds)
        vision_tokens = length
    # The images' tokens are in the embedding: far longer than the text alone.
    assert vision_tokens > len(encoder.tokenizer(texts[0])["input_ids"]) + 2 * len(images)
    again, hit = encoder.encode(texts, 512, b"ns", [i.image for i in items], [i.sha256 for i in items])
    assert hit and torch.equal(again["embeds"], batched["embeds"])
    # Other images (digests) or another namespace miss the cache.
    _, hit = encoder.encode(texts, 512, b"ns", [i.image for i in items], ["0" * 64] * len(items))
    assert not hit
    _, hit = encoder.encode(texts, 512, b"other", [i.image for i in items], [i.sha256 for i in items])
    assert not hit
    with pytest.raises(RequestError, match="images: the edit pipelines encode each prompt with the input image"):
        encoder.encode(texts, 512)


@pytest.mark.parametrize("family", [EDIT, PLUS])
def test_vae_encode_equals_latent_dist_mode(checkpoints, family) -> None:
    """The mode of `vae.encode(...).latent_dist` of each image at its calculated size, normalised as the
    pipeline normalises it, packed, the images one after another."""
    model_dir = checkpoints[family]
    images = [input_image(50, 40, 5)] if family == EDIT else [input_image(50, 40, 5), input_image(40, 64, 6)]
    decoder = QwenImageDecoder(model_dir, CPU, torch.float32)
    ours = QwenImageEditLatentEncoder(model_dir)(decoder, [decoded(image) for image in images], 64, 64, 1)
    reference = pipeline(model_dir)
    config = reference.vae.config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    expected = []
    for image in images:
        width, height = calculate_dimensions(1024 * 1024, *image.size, 32)
        pixels = reference.image_processor.preprocess(image, height, width).unsqueeze(2)
        mode = reference.vae.encode(pixels).latent_dist.mode()
        normalised = (mode - mean) / std
        expected.append(QwenImagePipeline._pack_latents(normalised, 1, 16, *normalised.shape[3:]))
    expected = torch.cat(expected, dim=1)
    assert ours["image_latents"].shape == expected.shape
    assert (ours["image_latents"] - expected).abs().max().item() <= 1e-5


def stage_latents(model_dir: Path, spec: DenoiseSpec, prompt: str, negative: str, images: list[DecodedImage]):
    """What the cluster's stages compute, in process: the conditioning with the images, the image latents, then
    the DiT's latents, each tensor as the stage sends it (texts padded to the longest, with their masks)."""
    encoder = QwenImageEditPromptEncoder(model_dir, "m", CPU, torch.float32)
    texts = [prompt, negative] if spec.do_classifier_free_guidance else [prompt]
    batched, _ = encoder.encode(texts, 512, b"", [i.image for i in images], [i.sha256 for i in images])
    conditioning = {}
    for row, role in enumerate(("prompt", "negative_prompt")[: len(texts)]):
        conditioning[f"{role}_embeds"] = batched["embeds"][row : row + 1]
        conditioning[f"{role}_embeds_mask"] = batched["embeds_mask"][row : row + 1]
    decoder = QwenImageDecoder(model_dir, CPU, torch.float32)
    conditioning.update(QwenImageEditLatentEncoder(model_dir)(decoder, images, spec.height, spec.width, 1))
    denoiser = QwenImageEditDenoiser(model_dir, CPU, torch.float32)
    assert tuple(conditioning["image_latents"].shape) == denoiser.image_tensor_shape("image_latents", spec)
    return denoiser.denoise(spec, conditioning, on_step=lambda s, t: None, cancelled=lambda: False)


def pipeline_latents(model_dir: Path, case: dict, images: list[Image.Image]) -> torch.Tensor:
    reference = pipeline(model_dir)
    cfg = case["guidance"] > 1
    output = reference(
        image=images[0] if len(images) == 1 and "Plus" not in type(reference).__name__ else images,
        prompt=case["prompt"],
        negative_prompt=case["negative_prompt"] if cfg else None,
        true_cfg_scale=case["guidance"],
        height=case.get("height"),
        width=case.get("width"),
        num_inference_steps=case["steps"],
        generator=torch.Generator("cpu").manual_seed(case["seed"]),
        output_type="latent",
    ).images
    width, height = output_size(case["family"], images)
    return QwenImagePipeline._unpack_latents(
        output, case.get("height") or height, case.get("width") or width, reference.vae_scale_factor
    )


# (input image sizes (w, h) and the request; a size left out is the one the pipeline calculates)
STAGE_CASES = [
    # The output's size from the image (1216x864): the pipeline's default.
    dict(family=EDIT, images=[(56, 40)], prompt="a red fox", negative_prompt="blurry", guidance=4.0, steps=2, seed=0),
    # A portrait image, another output size than the calculated 768x1376, no CFG, 3 steps.
    dict(family=EDIT, images=[(33, 61)], height=64, width=96, prompt="a boat", guidance=1.0, steps=3, seed=3),
    dict(
        family=EDIT,
        images=[(64, 64)],
        height=48,
        width=80,
        prompt="snow on the hills",
        negative_prompt="dark, grainy",
        guidance=2.5,
        steps=2,
        seed=7,
    ),
    # Edit-Plus at its most references: three.
    dict(
        family=PLUS,
        images=[(56, 40), (30, 70), (24, 36)],
        height=64,
        width=64,
        prompt="the fox from picture 1 in the forest of picture 2 under the sky of picture 3",
        negative_prompt="blurry",
        guidance=4.0,
        steps=2,
        seed=1,
    ),
    # Edit-Plus: the height given, the width the last image's calculated one (864 for 40x56 at 1024x1024).
    dict(family=PLUS, images=[(40, 56)], height=64, prompt="a cat", guidance=1.0, steps=2, seed=5),
]


@pytest.mark.parametrize("case", STAGE_CASES, ids=[f"{c['family']}-{i}" for i, c in enumerate(STAGE_CASES)])
def test_stage_latents_equal_pipeline(checkpoints, case) -> None:
    model_dir = checkpoints[case["family"]]
    images = [input_image(width, height, seed=case["seed"] + n) for n, (width, height) in enumerate(case["images"])]
    width, height = output_size(case["family"], images)
    spec = DenoiseSpec(
        case.get("height") or height,
        case.get("width") or width,
        1,
        case["steps"],
        case["guidance"],
        case["seed"],
        ("reference",) * len(images),
        tuple(image.size for image in images),
    )
    ours = stage_latents(model_dir, spec, case["prompt"], case.get("negative_prompt", ""), [decoded(i) for i in images])
    reference = pipeline_latents(model_dir, case, images)
    assert ours.shape == reference.shape == (1, 16, 1, spec.height // 8, spec.width // 8)
    difference = (ours - reference).abs().max().item()
    print(f"{case['family']} {spec.width}x{spec.height}: max abs difference {difference:.2e}")
    assert difference <= TOLERANCE, f"max abs difference {difference:.2e}"
    assert reference.std() > 0.1


def test_image_tensor_shape_follows_the_images_sizes(checkpoints) -> None:
    denoiser = QwenImageEditDenoiser(checkpoints[PLUS], CPU, torch.float32)
    spec = DenoiseSpec(64, 64, 1, 2, 4.0, 0, ("reference", "reference"), ((56, 40), (30, 70)))
    # 1216x864 and 672x1568 at 16 pixels a token.
    assert denoiser.image_tensor_shape("image_latents", spec) == (1, 76 * 54 + 42 * 98, 64)
    assert denoiser.image_tensor_shape("prompt_embeds", spec) is None
    # Without the sizes, or with an image no side of which the VAE can take, nothing fits.
    assert denoiser.image_tensor_shape("image_latents", DenoiseSpec(64, 64, 1, 2, 4.0, 0, ("reference",))) is None
    extreme = DenoiseSpec(64, 64, 1, 2, 4.0, 0, ("reference",), ((4096, 1),))
    assert denoiser.image_tensor_shape("image_latents", extreme) is None
