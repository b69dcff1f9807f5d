"""Several models behind one orchestrator and one gateway (`stagediff up --model A --model B --model C`).

Wan2.1 text-to-video and Wan2.2 I2V A14B share their text encoder and VAE (the same files: the image-to-video
checkpoint is given the text-to-video one's), and Qwen-Image has its own. One text-encoder process serves both Wan
models, one VAE process (loaded from the image-to-video checkpoint, whose family also encodes input images, and
patch-parallel over two ranks) decodes both; each model's frames equal its diffusers pipeline's within one level.
A tenant allowed only the Wan models is refused Qwen-Image with PERMISSION_DENIED and sees only its models.

Scale from zero: t2v's DiT is stopped after a warm run; a job for t2v then waits (--cold-start-timeout) while the
other models' tests run, its DiT starts SCALED_TO_ZERO_S later, and the job makes the warm run's frames. How the
routing picks replicas, and a job failing past the cold-start timeout, are in tests/unit/test_model_routes.py and
tests/unit/test_cold_start.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from families.init_model import init_model
from families.qwen_image.init_model import DEFAULT_REQUESTS as QWEN_DEFAULT_REQUESTS
from services.orchestrator.stage_clients import REPLICA_WAIT_S
from services.orchestrator.tenants import hash_api_key, new_api_key
from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from stagediff.protocol import API_KEY_ENV
from stagediff.v1 import generation_pb2
from tests.helpers.image_to_video import PATCH_PARALLEL_VAE, check_cases, encoded
from tests.helpers.qwen_references import QWEN_CASES, qwen_reference
from tests.helpers.qwen_references import assert_close as assert_image_close
from tests.helpers.qwen_references import generate as generate_image
from tests.helpers.references import reference_frames
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.wan_i2v import input_image

SHARED = ("text_encoder", "tokenizer", "vae")  # the components the Wan models share
COLD_START_TIMEOUT_S = 300  # how long a job waits for a DiT that starts on demand
# How long t2v's DiT stays at zero with a job waiting for it: three times as long as a call waits for a replica
# without --cold-start-timeout.
SCALED_TO_ZERO_S = 3 * REPLICA_WAIT_S


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
        extra_args={
            "vae": PATCH_PARALLEL_VAE,
            "orchestrator": ["--tenants", str(tenants), "--cold-start-timeout", str(COLD_START_TIMEOUT_S)],
        },
    )
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


@dataclass
class Waiting:
    """A t2v job submitted while t2v's DiT was at zero, and the warm run's frames of the same request."""

    job_id: str
    warm: np.ndarray
    since: float  # time.monotonic() when it was submitted


T2V_CASE = dict(
    prompt="a red fox", negative_prompt="blurry", height=32, width=48, num_frames=5, steps=2, guidance=5.0, seed=3
)
T2V_REQUEST = dict(
    model="t2v",
    negative_prompt="blurry",
    height=32,
    width=48,
    num_frames=5,
    num_inference_steps=2,
    guidance_scale=5.0,
    seed=3,
)


@pytest.fixture(scope="module")
def t2v_waiting(cluster: LocalCluster, models, keys) -> Waiting:
    """t2v made warm (and equal to WanPipeline's), then its DiT stopped and a job submitted for it."""
    from diffusers import WanPipeline

    pipeline = WanPipeline.from_pretrained(models["t2v"])
    pipeline.set_progress_bar_config(disable=True)
    with Client(cluster.endpoint, api_key=keys["acme"]) as client:
        warm = client.generate(T2V_CASE["prompt"], **T2V_REQUEST)
        assert_image_close(warm.frames, reference_frames(pipeline, **T2V_CASE))
        cluster.kill("dit.t2v", signal.SIGTERM)
        _wait_for_status(client, "t2v", "scaled to zero at dit: starts on demand")
        job = client.submit(T2V_CASE["prompt"], **T2V_REQUEST)
    return Waiting(job.job_id, warm.frames, time.monotonic())


def _wait_for_status(client: Client, model: str, status: str) -> None:
    """Waits (bounded) until ListModels says `model`'s status begins with `status`."""
    give_up_at = time.monotonic() + 60
    while not any(m.id == model and m.status.startswith(status) for m in client.list_models()):
        assert time.monotonic() < give_up_at, f"{model} never became: {status}; {client.list_models()}"
        time.sleep(0.2)


def test_shared_stages_run_once_for_the_models_whose_files_they_hold(cluster: LocalCluster, keys) -> None:
    stages = sorted(name for name, service in cluster.compose.items() if service.stage_kind is not None)
    assert stages == [
        "dit.i2v", "dit.qwen", "dit.t2v", "interp", "text-encoder.qwen", "text-encoder.t2v", "vae.i2v", "vae.qwen"
    ]  # fmt: skip
    assert cluster.log_dir is not None
    log = (cluster.log_dir / "text-encoder.t2v.log").read_text()
    assert "one text-encoder for the models t2v, i2v: their text_encoder (sha256:" in log, log[-2000:]
    with Client(cluster.endpoint, api_key=keys["acme"]) as client:
        info = client.cluster_info()
        listed = client.list_models()
    # The shared text encoder says which models it serves; ListModels counts it for both.
    text_encoders = next(stage for stage in info.stages if stage.info.stage == "text-encoder").replicas
    assert sorted(tuple(replica.info.models) for replica in text_encoders) == [("qwen",), ("t2v", "i2v")]
    assert [(m.id, dict(m.serving_replicas), m.status) for m in listed] == [
        (model, {"text-encoder": 1, "dit": 1, "vae": 1, **({} if model == "qwen" else {"interp": 1})}, "serving")
        for model in ("t2v", "i2v", "qwen")
    ]


def test_a_job_for_a_model_at_zero_waits_for_its_dit(cluster: LocalCluster, keys, t2v_waiting: Waiting) -> None:
    """The job's text is encoded (a stage that is up), then it waits, running, at the DiT that is down."""
    with Client(cluster.endpoint, api_key=keys["acme"]) as client:
        give_up_at = time.monotonic() + 30
        job = client.get_job(t2v_waiting.job_id)
        while job.current_stage == "text-encoder" and time.monotonic() < give_up_at:
            time.sleep(0.1)
            job = client.get_job(t2v_waiting.job_id)
    assert job.state == generation_pb2.JOB_STATE_RUNNING and job.current_stage == "dit", job


def test_i2v_equals_its_pipeline_on_the_shared_text_encoder_and_vae(cluster: LocalCluster, models, keys) -> None:
    """Wan2.2 I2V A14B, its VAE patch-parallel: the Encode whole on rank 0, the decode in bands."""
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


@pytest.mark.parametrize("case", QWEN_CASES, ids=[f"{c['height']}x{c['width']}-cfg{c['guidance']}" for c in QWEN_CASES])
def test_qwen_cluster_equals_qwen_image_pipeline(cluster: LocalCluster, keys, qwen_pipeline, case) -> None:
    frames = generate_image(cluster.endpoint, case, model="qwen", api_key=keys["acme"])
    assert_image_close(frames, qwen_reference(qwen_pipeline, **case))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(num_frames=5), ["num_frames", "single images", "use 1"]),
        (dict(height=40), ["height", "multiple of 16"]),
        (dict(width=72), ["width", "multiple of 16"]),
        (dict(interp_exp=1), ["interpolation", "single images", "leave interpolation off"]),
    ],
)
def test_qwen_refuses_what_the_pipeline_cannot_make(cluster: LocalCluster, keys, overrides, words) -> None:
    arguments = dict(model="qwen", height=64, width=64, num_frames=1, num_inference_steps=2, guidance_scale=4.0, seed=0)
    with Client(cluster.endpoint, api_key=keys["acme"]) as client, pytest.raises(StageDiffError) as raised:
        client.generate("a fox", **{**arguments, **overrides})
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    for word in words:
        assert word in raised.value.message, raised.value.message


def test_qwen_defaults_and_cli_png(cluster: LocalCluster, keys, qwen_pipeline, tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "fox.png"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "stagediff.cli",
            "generate",
            "--endpoint",
            cluster.endpoint,
            "--model",
            "qwen",
            "--prompt",
            "a red fox",
            "--negative-prompt",
            "blurry",
            "--seed",
            "3",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, API_KEY_ENV: keys["acme"]},
    )
    assert completed.returncode == 0, completed.stderr
    image = np.asarray(Image.open(out).convert("RGB"))[None]
    defaults = QWEN_DEFAULT_REQUESTS["tiny"]
    expected = qwen_reference(
        qwen_pipeline,
        prompt="a red fox",
        negative_prompt="blurry",
        height=defaults["height"],
        width=defaults["width"],
        steps=defaults["num_inference_steps"],
        guidance=defaults["guidance_scale"],
        seed=3,
    )
    assert_image_close(image, expected)


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


def test_the_waiting_job_runs_once_its_dit_starts(cluster: LocalCluster, keys, t2v_waiting: Waiting) -> None:
    """Last: the other tests ran while the job waited; the DiT starts SCALED_TO_ZERO_S after the job came."""
    time.sleep(max(0.0, t2v_waiting.since + SCALED_TO_ZERO_S - time.monotonic()))
    cluster.restart("dit.t2v")
    with Client(cluster.endpoint, api_key=keys["acme"]) as client:
        cold = client.wait(t2v_waiting.job_id)
        assert [m.status for m in client.list_models()] == ["serving"] * 3
    assert np.array_equal(cold.frames, t2v_waiting.warm), "the job that waited for its DiT made the warm run's frames"
