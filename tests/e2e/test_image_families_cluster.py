"""The image families beyond Qwen-Image through one running cluster, each equal to its diffusers pipeline within
one level: FLUX.1-dev's kind (its DiT under Ulysses over two ranks) and FLUX.1-schnell's behind one orchestrator
and one HTTP gateway, sharing one text-encoder process (CLIP and T5) and one VAE process, whose files are the
same (`stagediff up --model A --model B`). The FLUX.1-dev DiT serves adapters per request from its --lora-dir:
a kohya-format one, converted by FluxPipeline's own loader.

What each family does stage by stage, and every parallel layout and option on gloo, is in
tests/integration/test_family_flux.py and tests/integration/test_family_features.py.
"""

from __future__ import annotations

import base64
import io
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import torch
from diffusers import FluxPipeline
from PIL import Image

from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.helpers.lora_adapters import flux_community_adapter
from tests.helpers.serving import THREADS_PER_STAGE

LONG_PROMPT = "a red fox running through fresh snow at dawn, " * 30


@pytest.fixture(scope="module")
def models(flux_model: Path, flux_schnell_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image-models")
    return {
        "flux-dev": Path(shutil.copytree(flux_model, root / "flux-dev")),
        "flux-schnell": Path(shutil.copytree(flux_schnell_model, root / "flux-schnell")),
    }


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
        extra_args={"dit.flux-dev": ["--ulysses-degree", "2", "--lora-dir", str(lora_dir)]},
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


def _reference(pipeline: FluxPipeline, seed: int, **arguments) -> np.ndarray:
    images = pipeline(**arguments, generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images
    return (np.clip(images, 0, 1) * 255).round().astype(np.uint8)


def _assert_close(frames: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert frames.shape == expected.shape, (what, frames.shape, expected.shape)
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max()
    print(f"{what}: {difference} levels off FluxPipeline")
    assert difference <= 1 and expected.std() > 1.0, what


def test_flux_cluster_equals_pipeline(cluster: LocalCluster, models: dict[str, Path]) -> None:
    """FLUX.1-dev's kind with true CFG on top of its embedded guidance, over gRPC; then its default embedded
    guidance and another over HTTP with the official `openai` package; FLUX.1-schnell's with a prompt past T5's
    256 tokens, whose cut the result reports; the processes the two models share."""
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
    served = {stage.info.stage: [tuple(replica.info.models) for replica in stage.replicas] for stage in info.stages}
    assert served["text-encoder"] == [("flux-dev", "flux-schnell")] and served["vae"] == [("flux-dev", "flux-schnell")]
    assert sorted(served["dit"]) == [("flux-dev",), ("flux-schnell",)]

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
