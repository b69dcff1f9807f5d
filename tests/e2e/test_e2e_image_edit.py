"""Image editing through the running cluster: the images equal QwenImageEditPipeline's and
QwenImageEditPlusPipeline's within one level, the input sent as PNG, JPEG or WebP bytes and the reference
fed `diffusers.utils.load_image` of the same bytes; a size the request leaves unset is the one the
pipeline calculates from the image, and the job records it; requests the family cannot serve are refused
at the door with INVALID_ARGUMENT naming the field. Both run through one-rank clusters: every parallel layout of
their DiT and VAE, Ring and tensor parallelism included, is proven against one rank in
tests/integration/test_family_features.py (the ParallelLayouts classes), and a parallel Qwen-Image cluster runs
end to end in tests/e2e/test_families_cluster.py.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.utils import load_image
from PIL import Image

from families.init_model import init_model
from families.qwen_image_edit.encode import load_processor
from stagediff import Client
from stagediff.local.supervisor import LocalCluster
from stagediff.v1 import generation_pb2, generation_pb2_grpc, image_pb2
from tests.helpers.image_to_video import assert_close, encoded
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.wan_i2v import input_image


def _cluster(model: Path, log_dir: Path, extra_args: dict[str, list[str]] | None = None) -> Iterator[LocalCluster]:
    local = LocalCluster(model, threads_per_stage=THREADS_PER_STAGE, log_dir=log_dir, extra_args=extra_args or {})
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-edit-models")
    return {name: init_model(name, "tiny", root / name, seed=0) for name in ("qwen-image-edit", "qwen-image-edit-plus")}


@pytest.fixture(scope="module")
def edit_cluster(models, tmp_path_factory) -> Iterator[LocalCluster]:
    yield from _cluster(models["qwen-image-edit"], tmp_path_factory.mktemp("qwen-edit-logs"))


def reference(model_dir: Path, case: dict, plus: bool) -> np.ndarray:
    """The diffusers pipeline's image for a case, from the images as load_image reads the same bytes, uint8."""
    images = [load_image(Image.open(io.BytesIO(data))) for data in case["images"]]
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipeline = pipeline_class.from_pretrained(model_dir, processor=load_processor(model_dir / "processor"))
    output = pipeline(
        image=images if plus else images[0],
        prompt=case["prompt"],
        negative_prompt=case.get("negative_prompt") if case["guidance"] > 1 else None,
        true_cfg_scale=case["guidance"],
        height=case.get("height"),
        width=case.get("width"),
        num_inference_steps=case["steps"],
        generator=torch.Generator("cpu").manual_seed(case["seed"]),
        output_type="np",
    )
    return (np.clip(output.images, 0, 1) * 255).round().astype(np.uint8)


def check_case(cluster: LocalCluster, model_dir: Path, case: dict, plus: bool = False) -> None:
    first, *others = case["images"]
    with Client(cluster.endpoint) as client:
        result = client.generate(
            case["prompt"],
            negative_prompt=case.get("negative_prompt", ""),
            height=case.get("height"),
            width=case.get("width"),
            num_inference_steps=case["steps"],
            guidance_scale=case["guidance"],
            seed=case["seed"],
            image=first,
            reference_images=others,
        )
        job = client.get_job(result.job_id)
    expected = reference(model_dir, case, plus)
    difference = np.abs(result.frames.astype(np.int16) - expected.astype(np.int16)).max()
    timings = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in job.timings.items())
    print(f"{job.request.width}x{job.request.height}: max difference {difference} levels; {timings}")
    assert_close(result.frames, expected)
    # The job records the size it made (the calculated one where the request left it unset) and each image's
    # digest and decoded size, not its bytes.
    assert (job.request.height, job.request.width) == case["size"] == expected.shape[1:3]
    assert [(image.width, image.height) for image in job.request.images] == case["image_sizes"]
    assert all(image.sha256 and not image.data for image in job.request.images)
    assert job.timings["vae-encode"] > 0


def _exif_turned(image: Image.Image) -> bytes:
    """A JPEG stored as `image`, whose EXIF orientation 6 shows (and decodes) it turned a quarter."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(image, "JPEG", quality=92, exif=exif)


EDIT_CASES = [
    # A JPEG stored 56x40 whose EXIF orientation decodes it 40x56, another size than the calculated 864x1216,
    # without CFG. (The size calculated from the decoded image is tests/integration/test_family_qwen_image_edit.py's
    # first stage case; a width calculated end to end is Edit-Plus's case below.)
    dict(
        prompt="a boat at sea",
        height=48,
        width=80,
        guidance=1.0,
        steps=3,
        seed=3,
        images=[_exif_turned(input_image(56, 40, 0))],
        size=(48, 80),
        image_sizes=[(40, 56)],
    ),
    # A PNG, CFG.
    dict(
        prompt="a red fox wearing a hat",
        negative_prompt="blurry",
        height=64,
        width=64,
        guidance=4.0,
        steps=2,
        seed=0,
        images=[encoded(input_image(33, 61, 1), "PNG")],
        size=(64, 64),
        image_sizes=[(33, 61)],
    ),
    # A wide output from a portrait image, CFG with another scale, WebP.
    dict(
        prompt="snow on the roof",
        negative_prompt="dark",
        height=32,
        width=96,
        guidance=2.5,
        steps=2,
        seed=5,
        images=[encoded(input_image(40, 72, 4), "WEBP", lossless=True)],
        size=(32, 96),
        image_sizes=[(40, 72)],
    ),
]


def test_qwen_image_edit_images_equal_pipeline(edit_cluster, models) -> None:
    for case in EDIT_CASES:
        check_case(edit_cluster, models["qwen-image-edit"], case)


# Two references, PNG and WebP, with CFG, the height given and the width the last image's calculated one (a request
# without CFG and JPEG input run through the Edit cases above, on the same DiT and VAE code). More references take
# the same path image by image: their count is checked at the door (four are refused below), and their latents
# against the pipeline's in tests/integration/test_family_qwen_image_edit.py.
PLUS_CASES = [
    # The height given, the width the last image's calculated one (672 for a 30x70 image).
    dict(
        prompt="the fox from picture 1 in the forest of picture 2",
        negative_prompt="blurry",
        height=64,
        guidance=4.0,
        steps=2,
        seed=1,
        images=[encoded(input_image(56, 40, 2), "PNG"), encoded(input_image(30, 70, 3), "WEBP", lossless=True)],
        size=(64, 672),
        image_sizes=[(56, 40), (30, 70)],
    ),
]


def test_qwen_image_edit_plus_images_equal_pipeline(models, tmp_path) -> None:
    """Through a one-rank cluster: the parallel layouts of the Edit-Plus DiT and VAE are proven equal on gloo
    (TestQwenImageEditPlusParallelLayouts), and a parallel Qwen-Image cluster end to end in test_families_cluster.py."""
    model_dir = models["qwen-image-edit-plus"]
    for cluster in _cluster(model_dir, tmp_path):
        for case in PLUS_CASES:
            check_case(cluster, model_dir, case, plus=True)
        with grpc.insecure_channel(cluster.endpoint) as channel:
            limits = generation_pb2_grpc.GenerationStub(channel).ListModels(
                generation_pb2.ListModelsRequest(), timeout=30
            )
        assert list(limits.models[0].limits.image_roles) == ["reference"] * 3
        images = [image_pb2.InputImage(data=PLUS_CASES[0]["images"][0])] * 4
        _assert_refused(cluster, images, "images", "at most 3")


def _assert_refused(cluster: LocalCluster, images: list, field: str, allowed: str) -> None:
    with grpc.insecure_channel(cluster.endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt="a fox", num_inference_steps=1, images=images)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Submit(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert raised.value.details().startswith(field + ":"), raised.value.details()
    assert allowed in raised.value.details(), raised.value.details()


@pytest.mark.parametrize(
    ("images", "field", "allowed"),
    [
        ([], "images", "requires a reference image"),
        # 2000x2 at 1024x1024 pixels is 32384x32: wider than the model takes.
        ([image_pb2.InputImage(data=encoded(input_image(2000, 2, 0), "PNG"))], "images[0]", "send height and width"),
        ([image_pb2.InputImage(data=encoded(input_image(8, 8, 0), "PNG"))] * 2, "images", "at most 1"),
    ],
    ids=["missing", "extreme-aspect", "two-images"],
)
def test_edit_requests_it_cannot_serve_are_refused(edit_cluster, images, field, allowed) -> None:
    _assert_refused(edit_cluster, images, field, allowed)


def test_openai_images_edit_through_the_http_gateway(edit_cluster) -> None:
    """OpenAI's client edits an image through the gateway: the PNG it returns is the frame the gRPC API makes
    from the same image, prompt and seed."""
    image = encoded(input_image(64, 64, seed=3), "PNG")
    client = openai.OpenAI(api_key="unused", base_url=f"{edit_cluster.http_url}/v1", max_retries=0, timeout=300)
    response = client.images.edit(
        image=("input.png", image, "image/png"),
        prompt="make it blue",
        size="64x64",
        extra_body={"num_inference_steps": 2, "guidance_scale": 1.0, "seed": 9},
    )
    edited = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))))
    with Client(edit_cluster.endpoint) as grpc_client:
        result = grpc_client.generate(
            "make it blue", image=image, height=64, width=64, num_inference_steps=2, guidance_scale=1.0, seed=9
        )
    assert np.array_equal(edited, result.frames[0])
