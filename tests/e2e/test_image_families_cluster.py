"""The image families beyond Qwen-Image through one running cluster, each equal to its diffusers pipeline within
one level, behind one orchestrator and one HTTP gateway (`stagediff up --model A --model B ...`): FLUX.1-dev's
kind (its DiT under Ulysses over two ranks) and FLUX.1-schnell's, sharing one text-encoder process (CLIP and T5);
Z-Image, whose VAE is FLUX.1's and so shares their VAE stage, which decodes every image in row bands over two
ranks (`--vae-patch-parallel-size 2`, vae_svc/band_kl.py); FLUX.2 klein's base kind with CFG; FLUX.1 Kontext
(editing: its reference image through its VAE process's Encode, over gRPC and HTTP), sharing the FLUX.1 text
encoder; Qwen-Image 2.1, with stages of its own. The FLUX.1-dev DiT serves adapters per request from its
--lora-dir: a kohya-format one, converted by FluxPipeline's own loader.

What each family does stage by stage, and every parallel layout and option on gloo, is in
tests/integration/test_family_flux.py, test_family_z_image.py, test_family_flux2_klein.py,
test_family_flux_kontext.py, test_family_qwen_image_21.py and test_family_features.py.
"""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest
import torch
from diffusers import (
    AutoencoderKLQwenImage21,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    FluxKontextPipeline,
    FluxPipeline,
    QwenImage21Pipeline,
    QwenImage21Transformer2DModel,
    ZImagePipeline,
)
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration

from families.qwen_image_21.encode import load_processor
from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.helpers.feature_mixins.base import tiny_checkpoint
from tests.helpers.image_to_video import encoded
from tests.helpers.lora_adapters import flux_community_adapter
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.wan_i2v import input_image

LONG_PROMPT = "a red fox running through fresh snow at dawn, " * 30


@pytest.fixture(scope="module")
def models(
    flux_model: Path,
    flux_schnell_model: Path,
    z_image_model: Path,
    klein_base_model: Path,
    flux_kontext_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Path]:
    """By the ids the cluster serves them under (their directories' names)."""
    root = tmp_path_factory.mktemp("image-models")
    given = {
        "flux-dev": flux_model,
        "flux-schnell": flux_schnell_model,
        "z-image": z_image_model,
        "klein-base": klein_base_model,
        "flux-kontext": flux_kontext_model,
        "qwen-image-2.1": tiny_checkpoint("qwen-image-2.1", tmp_path_factory),
    }
    return {name: Path(shutil.copytree(model, root / name)) for name, model in given.items()}


@pytest.fixture(scope="module")
def lora_dir(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The flux-dev DiT's adapters: "kohya", in kohya's sd-scripts format."""
    directory = tmp_path_factory.mktemp("flux-loras")
    flux_community_adapter(models["flux-dev"], directory / "kohya.safetensors", "kohya", seed=4)
    return directory


@pytest.fixture(scope="module")
def cluster(
    models: dict[str, Path], lora_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    local = LocalCluster(
        list(models.values()),
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=tmp_path_factory.mktemp("image-families-logs"),
        extra_args={
            "dit.flux-dev": ["--ulysses-degree", "2", "--lora-dir", str(lora_dir)],
            "vae.flux-dev": ["--vae-patch-parallel-size", "2"],
            "vae.flux-kontext": ["--vae-patch-parallel-size", "2"],
        },
    )
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


def _pipeline(model: Path) -> FluxPipeline:
    pipeline = FluxPipeline.from_pretrained(model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _reference(pipeline: Any, seed: int, **arguments) -> np.ndarray:
    images = pipeline(**arguments, generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images
    return (np.clip(images, 0, 1) * 255).round().astype(np.uint8)


def _replica(info: Any, stage: str, model: str) -> Any:
    """The StageInfo of the replica of `stage` that serves `model`."""
    return next(
        replica.info
        for each in info.stages
        if each.info.stage == stage
        for replica in each.replicas
        if model in replica.info.models
    )


def _assert_close(frames: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert frames.shape == expected.shape, (what, frames.shape, expected.shape)
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max()
    print(f"{what}: {difference} levels off its pipeline")
    assert difference <= 1 and expected.std() > 1.0, what


def test_flux_cluster_equals_pipeline(cluster: LocalCluster, models: dict[str, Path]) -> None:
    """FLUX.1-dev's kind with true CFG on top of its embedded guidance, over gRPC; then its default embedded
    guidance and another over HTTP with the official `openai` package; FLUX.1-schnell's with a prompt past T5's
    256 tokens, whose cut the result reports; the processes the two models share; the VAE's two row bands."""
    dev = _pipeline(models["flux-dev"])
    with Client(cluster.endpoint) as client:
        result = client.generate(
            "a red fox",
            model="flux-dev",
            negative_prompt="blurry",
            height=48,
            width=80,
            num_inference_steps=2,
            guidance_scale=3.0,
            embedded_guidance_scale=2.5,
            seed=3,
        )
        expected = _reference(
            dev, 3, prompt="a red fox", negative_prompt="blurry", true_cfg_scale=3.0, guidance_scale=2.5,
            height=48, width=80, num_inference_steps=2,
        )  # fmt: skip
        _assert_close(result.frames, expected, "flux-dev, true CFG 3 and embedded guidance 2.5")
        job = client.get_job(result.job_id)
        assert job.request.embedded_guidance_scale == 2.5

        schnell = _pipeline(models["flux-schnell"])
        result = client.generate(LONG_PROMPT, model="flux-schnell", height=32, width=64, seed=1)
        expected = _reference(
            schnell, 1, prompt=LONG_PROMPT, height=32, width=64, num_inference_steps=2, max_sequence_length=256
        )
        _assert_close(result.frames, expected, "flux-schnell, a prompt T5 cuts at 256 tokens")
        assert [(notice.field, notice.used) for notice in result.notices] == [("prompt", "256 tokens")]
        with pytest.raises(StageDiffError) as refused:
            client.generate("a fox", model="flux-schnell", embedded_guidance_scale=2.0)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "embedded_guidance_scale: this model has no guidance embedding" in str(refused.value)

        info = client.cluster_info()
    served = {
        stage.info.stage: sorted(tuple(replica.info.models) for replica in stage.replicas) for stage in info.stages
    }
    vae = _replica(info, "vae", "flux-dev")
    assert vae.parallel_config["vae_patch_parallel_size"] == "2" and vae.limits.min_height == 16
    assert served["text-encoder"] == [
        ("flux-dev", "flux-schnell", "flux-kontext"), ("klein-base",), ("qwen-image-2.1",), ("z-image",)
    ]  # fmt: skip
    assert served["vae"] == [
        ("flux-dev", "flux-schnell", "z-image"),
        ("flux-kontext",),
        ("klein-base",),
        ("qwen-image-2.1",),
    ]
    assert served["dit"] == [
        ("flux-dev",), ("flux-kontext",), ("flux-schnell",), ("klein-base",), ("qwen-image-2.1",), ("z-image",)
    ]  # fmt: skip

    http = openai.OpenAI(api_key="unused", base_url=f"{cluster.http_url}/v1", max_retries=0, timeout=120)
    models_listed = {model.id: model.model_dump() for model in http.models.list()}
    assert models_listed["flux-dev"]["limits"]["default_embedded_guidance_scale"] == 3.5
    assert models_listed["flux-schnell"]["limits"]["default_embedded_guidance_scale"] is None
    response = http.images.generate(
        model="flux-dev",
        prompt="a blue square",
        size="64x48",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "embedded_guidance_scale": 4.0, "seed": 5},
    )
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))))
    expected = _reference(
        dev, 5, prompt="a blue square", guidance_scale=4.0, height=48, width=64, num_inference_steps=2
    )
    _assert_close(image[None], expected, "flux-dev over HTTP, embedded guidance 4")


def test_z_image_cluster_equals_pipeline(cluster: LocalCluster, models: dict[str, Path]) -> None:
    """Z-Image with CFG (its Qwen3 embeddings of their own lengths, a mask each), decoded by the VAE process it
    shares with the FLUX.1 models."""
    pipeline = ZImagePipeline.from_pretrained(models["z-image"])
    pipeline.set_progress_bar_config(disable=True)
    arguments = dict(prompt="a red fox", negative_prompt="blurry", height=48, width=80, num_inference_steps=2)
    with Client(cluster.endpoint) as client:
        result = client.generate(model="z-image", guidance_scale=4.0, seed=2, **arguments)
    _assert_close(result.frames, _reference(pipeline, 2, guidance_scale=4.0, **arguments), "z-image, CFG 4")


def test_flux2_klein_cluster_equals_pipeline(cluster: LocalCluster, models: dict[str, Path]) -> None:
    """FLUX.2 klein's base kind with CFG (Flux2KleinPipeline's negative prompt is the empty text)."""
    pipeline = Flux2KleinPipeline.from_pretrained(models["klein-base"])
    pipeline.set_progress_bar_config(disable=True)
    arguments = dict(prompt="a red fox", height=48, width=80, num_inference_steps=2)
    with Client(cluster.endpoint) as client:
        result = client.generate(model="klein-base", guidance_scale=4.0, seed=4, **arguments)
    _assert_close(result.frames, _reference(pipeline, 4, guidance_scale=4.0, **arguments), "flux2-klein base, CFG 4")


def test_qwen_image_21_cluster_equals_pipeline(cluster: LocalCluster, models: dict[str, Path]) -> None:
    """Qwen-Image 2.1 with true CFG over gRPC equals QwenImage21Pipeline's image, its RGB channels (the results are
    RGB; the pipeline's alpha is dropped, as `.convert("RGB")` drops it)."""
    model = models["qwen-image-2.1"]
    pipeline = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model / "scheduler"),
        vae=AutoencoderKLQwenImage21.from_pretrained(model / "vae"),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(model / "text_encoder"),
        processor=load_processor(model / "processor"),
        transformer=QwenImage21Transformer2DModel.from_pretrained(model / "transformer"),
    )
    pipeline.set_progress_bar_config(disable=True)
    arguments = dict(prompt="a red fox", negative_prompt="blurry", height=64, width=96, num_inference_steps=2)
    with Client(cluster.endpoint) as client:
        result = client.generate(model="qwen-image-2.1", guidance_scale=4.0, seed=3, **arguments)
    expected = _reference(pipeline, 3, true_cfg_scale=4.0, **arguments)
    assert expected.shape[-1] == 4, "the pipeline's images are RGBA"
    _assert_close(result.frames, expected[..., :3], "qwen-image-2.1, true CFG 4")


def test_flux_kontext_cluster_edits_equal_pipeline(cluster: LocalCluster, models: dict[str, Path]) -> None:
    """FLUX.1 Kontext edits a 90x150 image with true CFG over gRPC, equal to FluxKontextPipeline (its output size
    the request's: max_area height x width), its VAE stage encoding the image and decoding in bands over two ranks;
    then with OpenAI's client over HTTP /v1/images/edits, whose PNG is
    the frame gRPC makes from the same image, prompt and seed."""
    with Client(cluster.endpoint) as client:
        vae = _replica(client.cluster_info(), "vae", "flux-kontext")
    assert vae.parallel_config["vae_patch_parallel_size"] == "2"
    pipeline = FluxKontextPipeline.from_pretrained(models["flux-kontext"])
    pipeline.set_progress_bar_config(disable=True)
    image = encoded(input_image(150, 90, seed=3), "PNG")
    with Client(cluster.endpoint) as client:
        result = client.generate(
            "a hat",
            model="flux-kontext",
            image=image,
            negative_prompt="blurry",
            height=128,
            width=192,
            num_inference_steps=2,
            guidance_scale=2.5,
            embedded_guidance_scale=2.0,
            seed=3,
        )
    expected = _reference(
        pipeline, 3, image=Image.open(io.BytesIO(image)).convert("RGB"), prompt="a hat", negative_prompt="blurry",
        true_cfg_scale=2.5, guidance_scale=2.0, height=128, width=192, max_area=128 * 192, num_inference_steps=2,
    )  # fmt: skip
    _assert_close(result.frames, expected, "flux-kontext, an edit with true CFG 2.5 and embedded guidance 2")

    http = openai.OpenAI(api_key="unused", base_url=f"{cluster.http_url}/v1", max_retries=0, timeout=120)
    response = http.images.edit(
        model="flux-kontext",
        image=("input.png", image, "image/png"),
        prompt="make it blue",
        size="192x128",
        extra_body={"num_inference_steps": 2, "seed": 9},
    )
    edited = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))))
    with Client(cluster.endpoint) as client:
        result = client.generate(
            "make it blue", model="flux-kontext", image=image, height=128, width=192, num_inference_steps=2, seed=9
        )
    assert np.array_equal(edited, result.frames[0])


def test_a_community_flux_lora_through_the_cluster_equals_diffusers(
    cluster: LocalCluster, models: dict[str, Path], lora_dir: Path
) -> None:
    """The kohya-format adapter at 0.8 on flux-dev (its DiT under Ulysses over two ranks): the frames of
    FluxPipeline with the same file loaded by `load_lora_weights` and set at 0.8, and unlike the base model's."""
    arguments = dict(prompt="a lighthouse at dusk", height=48, width=64, num_inference_steps=2, guidance_scale=4.0)
    with Client(cluster.endpoint) as client:
        listed = client.list_models()
        adapted = client.generate(
            arguments["prompt"],
            model="flux-dev",
            height=48,
            width=64,
            num_inference_steps=2,
            embedded_guidance_scale=4.0,
            seed=6,
            loras=[("kohya", 0.8)],
        )
        base = client.generate(
            arguments["prompt"], model="flux-dev", height=48, width=64, num_inference_steps=2,
            embedded_guidance_scale=4.0, seed=6,
        )  # fmt: skip
    assert [lora.name for lora in next(m for m in listed if m.id == "flux-dev").limits.loras] == ["kohya"]
    pipeline = _pipeline(models["flux-dev"])
    pipeline.load_lora_weights(str(lora_dir / "kohya.safetensors"), adapter_name="kohya")
    pipeline.set_adapters(["kohya"], [0.8])
    expected = _reference(pipeline, 6, **arguments)
    _assert_close(adapted.frames, expected, "flux-dev with the kohya adapter at 0.8")
    changed = np.abs(adapted.frames.astype(np.int16) - base.frames.astype(np.int16)).max()
    print(f"flux-dev with the kohya adapter: {changed} levels off the base model")
    assert changed > 8, "the adapter must change the image"
