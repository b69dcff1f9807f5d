"""LoRA adapters through the running cluster: frames within one level of the diffusers pipelines with
load_lora_weights and set_adapters, the base model's frames exactly without adapters, tenants allowed only
their adapters (refused before any stage runs), a bad adapter failing only its job, an adapter fused at startup
served as its own model, and the demo model's colour-swapping adapter for one tenant among interleaved requests."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from diffusers import QwenImagePipeline, WanPipeline

from services.orchestrator.tenants import hash_api_key, new_api_key
from shapeworld.demo_model import CHECKPOINT
from shapeworld.score import ATTRIBUTES, read_video, score
from shapeworld.world import parse_prompt
from stagediff import Client, StageDiffError
from stagediff.local.supervisor import LocalCluster
from tests.conftest import THREADS_PER_STAGE, reference_frames
from tests.lora_adapters import qwen_adapter, wan_adapter
from tests.test_families import QWEN_CASES, qwen_reference

pytestmark = pytest.mark.e2e

CASE = dict(prompt="a lantern in fog", negative_prompt="blurry", height=48, width=64, num_frames=5, steps=3, seed=3)
TENANTS = {"acme": ["a", "b", "broken"], "globex": ["b"]}


def _tenants_file(directory: Path, allowed: dict[str, list[str]]) -> tuple[Path, dict[str, str]]:
    keys = {name: new_api_key() for name in allowed}
    path = directory / "tenants.yaml"
    tenants = [
        {"name": name, "api_keys": [hash_api_key(keys[name])], "loras": loras} for name, loras in allowed.items()
    ]
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path, keys


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
    tenants, keys = _tenants_file(tmp_path_factory.mktemp("tenants"), TENANTS)
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


def test_qwen_cluster_adapters_equal_diffusers_images(qwen_model: Path, tmp_path: Path) -> None:
    """Qwen-Image with two adapters at different scales, then none: as QwenImagePipeline's images."""
    lora_dir = tmp_path / "loras"
    # Stronger than the Wan adapters: the tiny Qwen-Image's VAE turns small latent changes into a level or two.
    qwen_adapter(qwen_model, lora_dir / "a.safetensors", seed=0, strength=3.0)
    qwen_adapter(qwen_model, lora_dir / "b.safetensors", seed=1, strength=3.0)
    case = QWEN_CASES[0]
    cluster = _start(qwen_model, tmp_path / "logs", ["--lora-dir", str(lora_dir)])
    try:
        with Client(cluster.endpoint) as client:
            images = [
                client.generate(
                    case["prompt"],
                    negative_prompt=case["negative_prompt"],
                    height=case["height"],
                    width=case["width"],
                    num_frames=1,
                    num_inference_steps=case["steps"],
                    guidance_scale=case["guidance"],
                    seed=case["seed"],
                    loras=loras,
                ).frames
                for loras in ({"a": 1.0, "b": 0.5}, {})
            ]
    finally:
        cluster.stop()
    pipe = _pipeline_with_adapters(QwenImagePipeline, qwen_model, lora_dir, ["a", "b"])
    pipe.set_adapters(["a", "b"], [1.0, 0.5])
    _within_one_level(images[0], qwen_reference(pipe, **case))
    pipe.disable_lora()
    _within_one_level(images[1], qwen_reference(pipe, **case))
    assert np.abs(images[0].astype(np.int16) - images[1]).max() > 8


DEMO_PROMPT = "a red circle moving right on a dark background"


def test_demo_adapter_swaps_a_colour_for_its_tenant_only(tmp_path: Path) -> None:
    """The demo model's red_to_blue adapter (shapeworld/red_to_blue.py), allowed to acme only: in requests of
    acme (with it) and globex (without it) submitted interleaved, acme's red circles read blue and globex's red,
    shape, motion and background as asked, globex's frames exactly those of its request run alone; globex may not
    name the adapter."""
    lora_dir = tmp_path / "loras"
    lora_dir.mkdir()
    (lora_dir / "red_to_blue.safetensors").write_bytes(
        (Path(__file__).resolve().parent.parent / "shapeworld" / "adapters" / "red_to_blue.safetensors").read_bytes()
    )
    tenants, keys = _tenants_file(tmp_path, {"acme": ["red_to_blue"], "globex": []})
    cluster = _start(CHECKPOINT, tmp_path / "logs", ["--lora-dir", str(lora_dir)], ["--tenants", str(tenants)])
    results: dict[tuple[str, int], np.ndarray] = {}

    def run(tenant: str, seed: int) -> None:
        loras = {"red_to_blue": 1.0} if tenant == "acme" else {}
        with Client(cluster.endpoint, api_key=keys[tenant]) as client:
            results[tenant, seed] = client.generate(DEMO_PROMPT, seed=seed, loras=loras).frames

    try:
        run("globex", 1)
        alone = results.pop(("globex", 1))
        threads = [
            threading.Thread(target=run, args=(tenant, seed)) for seed in (1, 2) for tenant in ("acme", "globex")
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        with Client(cluster.endpoint, api_key=keys["globex"]) as globex, pytest.raises(StageDiffError) as error:
            globex.submit(DEMO_PROMPT, loras={"red_to_blue": 1.0})
        assert error.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        cluster.stop()
    assert np.array_equal(results["globex", 1], alone), "acme's adapter must not touch globex's frames"
    asked = parse_prompt(DEMO_PROMPT)
    swapped = dataclasses.replace(asked, colour="blue")
    assert len(results) == 4
    for (tenant, seed), frames in results.items():
        # The demo's quality check: every attribute as the prompt says, the colour swapped for acme.
        right = score(read_video(frames), swapped if tenant == "acme" else asked)
        assert right == {name: True for name in ATTRIBUTES}, (tenant, seed, right)
