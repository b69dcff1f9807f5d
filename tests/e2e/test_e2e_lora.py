"""LoRA adapters through the running cluster: frames within one level of the diffusers pipelines with
load_lora_weights and set_adapters, the base model's frames exactly without adapters, tenants allowed only
their adapters (refused before any stage runs), a bad adapter failing only its job, the HTTP `lora` field (the
official openai package and curl) giving gRPC's frames, and an adapter fused at startup served as its own model.

Adapters per family, under parallel layouts, with caches and in batches are proven in
tests/integration/test_lora.py; the demo model's adapter runs through the cluster in
tests/e2e/test_demo_model_cluster.py.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
from diffusers import WanPipeline
from PIL import Image

from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.helpers.lora_adapters import wan_adapter
from tests.helpers.references import reference_frames
from tests.helpers.serving import THREADS_PER_STAGE
from tests.helpers.tenant_keys import tenants_file

pytestmark = pytest.mark.e2e

CASE = dict(prompt="a lantern in fog", negative_prompt="blurry", height=48, width=64, num_frames=5, steps=3, seed=3)
TENANTS = {"acme": ["a", "b", "broken"], "globex": ["b"]}


def _start(model: Path, log_dir: Path, dit: list[str], orchestrator: list[str] = ()) -> LocalCluster:
    cluster = LocalCluster(
        model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=log_dir,
        extra_args={"dit": dit, "orchestrator": list(orchestrator)},
    )
    cluster.start(timeout=300)
    return cluster


class LoraCluster:
    def __init__(self, cluster: LocalCluster, keys: dict[str, str], lora_dir: Path) -> None:
        self.cluster, self.keys, self.lora_dir = cluster, keys, lora_dir

    def client(self, tenant: str) -> Client:
        return Client(self.cluster.endpoint, api_key=self.keys[tenant])

    def generate(self, tenant: str, loras=(), **overrides) -> np.ndarray:
        case = {**CASE, **overrides}
        with self.client(tenant) as client:
            return client.generate(
                case["prompt"],
                negative_prompt=case["negative_prompt"],
                height=case["height"],
                width=case["width"],
                num_frames=case["num_frames"],
                num_inference_steps=case["steps"],
                seed=case["seed"],
                loras=loras,
            ).frames


@pytest.fixture(scope="module")
def lora_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraCluster]:
    lora_dir = tmp_path_factory.mktemp("loras")
    wan_adapter(tiny_model, lora_dir / "a.safetensors", seed=0)
    wan_adapter(tiny_model, lora_dir / "b.safetensors", seed=1)
    wan_adapter(tiny_model, lora_dir / "acme" / "own.safetensors", seed=2)
    (lora_dir / "broken.safetensors").write_bytes((lora_dir / "a.safetensors").read_bytes()[:200])
    tenants, keys = tenants_file(tmp_path_factory.mktemp("tenants"), TENANTS)
    log_dir = tmp_path_factory.mktemp("lora-cluster-logs")
    cluster = _start(tiny_model, log_dir, ["--lora-dir", str(lora_dir)], ["--tenants", str(tenants)])
    try:
        yield LoraCluster(cluster, keys, lora_dir)
    finally:
        cluster.stop()


def _pipeline_with_adapters(pipeline_class, model: Path, lora_dir: Path, names: list[str]):
    pipe = pipeline_class.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    for name in names:
        pipe.load_lora_weights(str(lora_dir / f"{name}.safetensors"), adapter_name=name)
    return pipe


def _within_one_level(frames: np.ndarray, expected: np.ndarray) -> None:
    assert frames.shape == expected.shape, (frames.shape, expected.shape)
    difference = np.abs(frames.astype(np.int16) - expected.astype(np.int16)).max()
    assert difference <= 1, f"max difference {difference} levels"
    assert expected.std() > 1.0, "the reference is flat: the comparison would prove little"


# First: its own cluster starts and stops before the module's cluster starts.
def test_fused_adapter_is_served_as_its_own_model(tiny_model: Path, tmp_path: Path) -> None:
    """--lora a:0.7: ListModels names the fused model, whose frames are the pipeline's with the adapter at 0.7;
    the text encoder and the VAE go on serving the checkpoint."""
    lora_dir = tmp_path / "loras"
    wan_adapter(tiny_model, lora_dir / "a.safetensors", seed=0)
    flags = ["--lora-dir", str(lora_dir), "--lora", "a:0.7", "--max-loras-per-request", "0"]
    cluster = _start(tiny_model, tmp_path / "logs", flags)
    try:
        with Client(cluster.endpoint) as client:
            model = client.list_models()[0]
            assert model.id == f"{tiny_model.name}+a:0.7"
            assert [(lora.name, lora.scale) for lora in model.limits.fused_loras] == [("a", 0.7)]
            assert model.limits.max_loras == 0 and not model.limits.loras
            frames = client.generate(
                CASE["prompt"],
                model=model.id,
                negative_prompt=CASE["negative_prompt"],
                height=CASE["height"],
                width=CASE["width"],
                num_frames=CASE["num_frames"],
                num_inference_steps=CASE["steps"],
                seed=CASE["seed"],
            ).frames
            with pytest.raises(StageDiffError) as error:
                client.submit("x", loras=[("a", 1.0)])
            assert error.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        cluster.stop()
    pipe = _pipeline_with_adapters(WanPipeline, tiny_model, lora_dir, ["a"])
    pipe.set_adapters(["a"], [0.7])
    _within_one_level(frames, reference_frames(pipe, **dict(CASE, guidance=5.0)))


def test_cluster_adapters_equal_diffusers_frames(lora_cluster: LoraCluster, tiny_model: Path) -> None:
    """One adapter, two at different scales, scale 0: as WanPipeline with load_lora_weights and set_adapters;
    scale 0 and a request without adapters right after some give the base model's frames exactly."""
    base = lora_cluster.generate("acme")
    one = lora_cluster.generate("acme", [("a", 1.0)])
    two = lora_cluster.generate("acme", {"a": 0.7, "b": -0.5})
    zero = lora_cluster.generate("acme", [("a", 0.0)])
    after = lora_cluster.generate("acme")
    assert np.array_equal(zero, base) and np.array_equal(after, base)
    assert np.abs(one.astype(np.int16) - base).max() > 8, "the adapter must change the frames"
    pipe = _pipeline_with_adapters(WanPipeline, tiny_model, lora_cluster.lora_dir, ["a", "b"])
    arguments = dict(CASE, guidance=5.0)
    for frames, loras in ((one, {"a": 1.0}), (two, {"a": 0.7, "b": -0.5})):
        pipe.set_adapters(list(loras), list(loras.values()))
        _within_one_level(frames, reference_frames(pipe, **arguments))
    pipe.disable_lora()
    _within_one_level(base, reference_frames(pipe, **arguments))


def test_tenants_use_only_their_adapters_and_refusals_come_before_any_stage(lora_cluster: LoraCluster) -> None:
    """ListModels shows each tenant its adapters; another's, one not allowed or absent, too many or malformed
    are refused at Submit (no job is made); the tenant's private adapter works for it alone."""
    with lora_cluster.client("acme") as acme, lora_cluster.client("globex") as globex:
        assert sorted(info.name for info in acme.list_models()[0].limits.loras) == ["a", "acme/own", "b", "broken"]
        assert [info.name for info in globex.list_models()[0].limits.loras] == ["b"]
        jobs_before = len(globex.list_jobs())
        for loras, code, words in (
            ([("a", 1.0)], grpc.StatusCode.PERMISSION_DENIED, "'a'"),
            ([("acme/own", 1.0)], grpc.StatusCode.NOT_FOUND, "'acme/own'"),
            ([("missing", 1.0)], grpc.StatusCode.NOT_FOUND, "'missing'"),
            ([("b", 20.0)], grpc.StatusCode.INVALID_ARGUMENT, "loras[0].scale"),
            ([("../b", 1.0)], grpc.StatusCode.INVALID_ARGUMENT, "loras[0].name"),
            ([(f"b{i}", 1.0) for i in range(5)], grpc.StatusCode.INVALID_ARGUMENT, "at most 4"),
        ):
            with pytest.raises(StageDiffError) as error:
                globex.submit(CASE["prompt"], height=48, width=64, num_frames=5, loras=loras)
            assert error.value.code == code and words in error.value.message, error.value
        assert len(globex.list_jobs()) == jobs_before, "a refused request makes no job"
    own = lora_cluster.generate("acme", [("acme/own", 1.0)])
    assert not np.array_equal(own, lora_cluster.generate("acme"))
    # The CLI shows a tenant the same listing.
    command = [sys.executable, "-m", "stagediff.cli", "models", "--endpoint", lora_cluster.cluster.endpoint]
    listed = subprocess.run(
        [*command, "--api-key", lora_cluster.keys["globex"]], capture_output=True, text=True, timeout=60, check=True
    )
    assert [lora["name"] for lora in json.loads(listed.stdout)[0]["limits"]["loras"]] == ["b"]


def test_a_bad_adapter_fails_its_job_and_the_dit_keeps_serving(lora_cluster: LoraCluster) -> None:
    with pytest.raises(StageDiffError) as error:
        lora_cluster.generate("acme", [("broken", 1.0)])
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT, error.value
    assert "lora 'broken'" in error.value.message and "safetensors" in error.value.message
    assert lora_cluster.generate("acme", [("b", 1.0)]).std() > 1.0


IMAGE = {"num_inference_steps": 1, "seed": 5}


def _pixels(png_b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png_b64))).convert("RGB"))


@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_the_lora_field_over_http_with_openai_and_curl(lora_cluster: LoraCluster) -> None:
    """An image made over HTTP with an adapter is the PNG of the frame gRPC makes with the same adapter and scale,
    and differs from the base model's; a video's job records the adapter and scale the body named. One-frame,
    one-step 64x64 requests keep it cheap."""
    key, http_url = lora_cluster.keys["acme"], lora_cluster.cluster.http_url
    client = openai.OpenAI(api_key=key, base_url=f"{http_url}/v1", max_retries=0, timeout=120)
    base = client.images.generate(prompt="a red circle", size="64x64", extra_body=IMAGE)
    styled = client.images.generate(prompt="a red circle", size="64x64", extra_body={**IMAGE, "lora": "a:0.8"})
    with lora_cluster.client("acme") as grpc_client:
        expected = grpc_client.generate(
            "a red circle", height=64, width=64, num_frames=1, num_inference_steps=1, seed=5, loras=[("a", 0.8)]
        ).frames[0]
    assert np.array_equal(_pixels(styled.data[0].b64_json), expected)
    assert not np.array_equal(_pixels(base.data[0].b64_json), expected), "the adapter changed nothing"

    # curl, with the object form; the same frame.
    headers = ["-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {key}"]
    body = {"prompt": "a red circle", "size": "64x64", **IMAGE, "lora": [{"name": "a", "scale": 0.8}]}
    curl = subprocess.run(
        [shutil.which("curl") or "curl", "-sS", "--fail-with-body", *headers]
        + ["-d", json.dumps(body), f"{http_url}/v1/images/generations"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert np.array_equal(_pixels(json.loads(curl.stdout)["data"][0]["b64_json"]), expected)

    # A video: its job runs with the adapter and scale named.
    video = client.videos.create(
        prompt="a red circle", size="64x64", extra_body={"num_frames": 5, **IMAGE, "lora": "a:0.5"}
    )
    with lora_cluster.client("acme") as grpc_client:
        loras = grpc_client.get_job(video.id).request.loras
    assert [(lora.name, lora.scale) for lora in loras] == [("a", 0.5)]
    client.videos.delete(video.id)

    # An adapter the DiT does not serve: 404 naming it, over curl.
    refused = subprocess.run(
        ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", *headers]
        + ["-d", json.dumps({"prompt": "x", "size": "64x64", **IMAGE, "lora": "missing"})]
        + [f"{http_url}/v1/images/generations"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer, _, status = refused.stdout.rpartition("\n")
    assert status == "404" and "missing" in json.loads(answer)["error"]["message"], refused.stdout
