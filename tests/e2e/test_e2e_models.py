"""Several models behind one orchestrator and one gateway (`stagediff up --model A --model B --model C`).

Wan2.1 text-to-video and Wan2.2 I2V A14B share their text encoder and VAE (the same files: the image-to-video
checkpoint is given the text-to-video one's), and Qwen-Image has its own. One text-encoder process serves both Wan
models, one VAE process (loaded from the image-to-video checkpoint, whose family also encodes input images, and
patch-parallel over two ranks) decodes both; each model's frames equal its diffusers pipeline's within one level.
A tenant allowed only the Wan models is refused Qwen-Image with PERMISSION_DENIED and sees only its models.
How the routing picks replicas, case by case, is in tests/unit/test_model_routes.py.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from families.init_model import init_model
from services.orchestrator.tenants import hash_api_key, new_api_key
from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.helpers.image_to_video import PATCH_PARALLEL_VAE, check_cases, encoded
from tests.helpers.qwen_references import QWEN_CASES, qwen_reference
from tests.helpers.qwen_references import assert_close as assert_image_close
from tests.helpers.qwen_references import generate as generate_image
from tests.helpers.references import reference_frames
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.wan_i2v import input_image

SHARED = ("text_encoder", "tokenizer", "vae")  # the components the Wan models share


@pytest.fixture(scope="module")
def models(tiny_model: Path, qwen_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """t2v (the tiny Wan2.1 text-to-video), i2v (the tiny Wan2.2 I2V A14B, given t2v's text encoder and VAE) and
    qwen (the tiny Qwen-Image), by the ids the cluster serves them under (their directories' names)."""
    root = tmp_path_factory.mktemp("models")
    t2v = Path(shutil.copytree(tiny_model, root / "t2v"))
    i2v = init_model("wan2.2-i2v-a14b", "tiny", root / "i2v", seed=0)
    for component in SHARED:
        shutil.rmtree(i2v / component)
        shutil.copytree(t2v / component, i2v / component)
    return {"t2v": t2v, "i2v": i2v, "qwen": Path(shutil.copytree(qwen_model, root / "qwen"))}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"acme": new_api_key(), "wan-only": new_api_key()}


@pytest.fixture(scope="module")
def cluster(models, keys, tmp_path_factory) -> Iterator[LocalCluster]:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text(
        json.dumps(
            {
                "tenants": [
                    {"name": "acme", "api_keys": [hash_api_key(keys["acme"])], "admin": True},
                    {"name": "wan-only", "api_keys": [hash_api_key(keys["wan-only"])], "models": ["t2v", "i2v"]},
                ]
            }
        )
    )
    local = LocalCluster(
        [models["t2v"], models["i2v"], models["qwen"]],
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=tmp_path_factory.mktemp("models-logs"),
        extra_args={"vae": PATCH_PARALLEL_VAE, "orchestrator": ["--tenants", str(tenants)]},
    )
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


def test_shared_stages_run_once_for_the_models_whose_files_they_hold(cluster: LocalCluster) -> None:
    stages = sorted(name for name, service in cluster.compose.items() if service.stage_kind is not None)
    assert stages == [
        "dit.i2v", "dit.qwen", "dit.t2v", "interp", "text-encoder.qwen", "text-encoder.t2v", "vae.i2v", "vae.qwen"
    ]  # fmt: skip
    assert cluster.log_dir is not None
    log = (cluster.log_dir / "text-encoder.t2v.log").read_text()
    assert "one text-encoder for the models t2v, i2v: their text_encoder (sha256:" in log, log[-2000:]


def test_each_model_equals_its_pipeline(cluster: LocalCluster, models, keys, qwen_pipeline) -> None:
    endpoint = cluster.endpoint
    with Client(endpoint, api_key=keys["acme"]) as client:
        info = client.cluster_info()
        models_listed = client.list_models()
    # The shared text encoder says which models it serves; ListModels counts it for both.
    text_encoders = next(stage for stage in info.stages if stage.info.stage == "text-encoder").replicas
    assert sorted(tuple(replica.info.models) for replica in text_encoders) == [("qwen",), ("t2v", "i2v")]
    assert [(m.id, dict(m.serving_replicas)) for m in models_listed] == [
        (model, {"text-encoder": 1, "dit": 1, "vae": 1, **({} if model == "qwen" else {"interp": 1})})
        for model in ("t2v", "i2v", "qwen")
    ]

    t2v_case = dict(
        prompt="a red fox", negative_prompt="blurry", height=32, width=48, num_frames=5, steps=2, guidance=5.0, seed=3
    )
    from diffusers import WanPipeline

    t2v_pipeline = WanPipeline.from_pretrained(models["t2v"])
    t2v_pipeline.set_progress_bar_config(disable=True)
    with Client(endpoint, api_key=keys["acme"]) as client:
        result = client.generate(
            t2v_case["prompt"],
            model="t2v",
            negative_prompt=t2v_case["negative_prompt"],
            height=t2v_case["height"],
            width=t2v_case["width"],
            num_frames=t2v_case["num_frames"],
            num_inference_steps=t2v_case["steps"],
            guidance_scale=t2v_case["guidance"],
            seed=t2v_case["seed"],
        )
    assert_image_close(result.frames, reference_frames(t2v_pipeline, **t2v_case))

    # Wan2.2 I2V A14B, its VAE patch-parallel: the Encode whole on rank 0, the decode in bands.
    i2v_cases = [
        dict(
            prompt="a red fox runs",
            negative_prompt="blurry",
            height=64,
            width=64,
            num_frames=9,
            steps=4,
            guidance=5.0,
            seed=1,
            images={"first": encoded(input_image(33, 61, 3), "PNG")},
        ),
        dict(
            prompt="a boat at sea",
            height=48,
            width=64,
            num_frames=9,
            steps=2,
            guidance=4.0,
            seed=2,
            images={"first": encoded(input_image(64, 48, 4), "PNG"), "last": encoded(input_image(70, 40, 5), "PNG")},
        ),
    ]
    check_cases(cluster, models["i2v"], i2v_cases, model="i2v", api_key=keys["acme"])

    case = QWEN_CASES[0]
    frames = generate_image(endpoint, case, model="qwen", api_key=keys["acme"])
    assert_image_close(frames, qwen_reference(qwen_pipeline, **case))


def test_a_tenant_allowed_some_models_is_refused_the_others(cluster: LocalCluster, keys) -> None:
    with Client(cluster.endpoint, api_key=keys["wan-only"]) as client:
        assert [model.id for model in client.list_models()] == ["t2v", "i2v"]
        with pytest.raises(StageDiffError) as raised:
            client.generate("a fox", model="qwen", num_inference_steps=1)
    assert raised.value.code == grpc.StatusCode.PERMISSION_DENIED, raised.value
    assert "tenant 'wan-only' may not use model 'qwen'" in raised.value.message
    # The gateway is the same door: its /v1/models lists what each key may use.
    assert cluster.http_url is not None
    for tenant, expected in (("acme", ["t2v", "i2v", "qwen"]), ("wan-only", ["t2v", "i2v"])):
        request = urllib.request.Request(
            f"{cluster.http_url}/v1/models", headers={"Authorization": f"Bearer {keys[tenant]}"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            listed = json.load(response)["data"]
        assert [model["id"] for model in listed] == expected
