"""The HTTP `lora` field end to end: a cluster whose DiT serves a --lora-dir, its gateway called with the
official openai package's `extra_body={"lora": ...}` and with curl.

An image made over HTTP with an adapter is the PNG of the frame gRPC makes with the same adapter and scale, and
differs from the base model's; a video's job records the adapter and scale the body named. One-frame, one-step
64x64 requests keep it cheap.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from stagediff import Client
from stagediff.local.supervisor import LocalCluster
from tests.conftest import THREADS_PER_STAGE
from tests.lora_adapters import wan_adapter

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]

IMAGE = {"num_inference_steps": 1, "seed": 5}


@pytest.fixture(scope="module")
def lora_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lora_dir = tmp_path_factory.mktemp("loras")
    wan_adapter(tiny_model, lora_dir / "style.safetensors", seed=0, strength=1.0)
    cluster = LocalCluster(
        tiny_model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=tmp_path_factory.mktemp("http-lora-logs"),
        extra_args={"dit": ["--lora-dir", str(lora_dir)]},
    )
    cluster.start(timeout=300)
    try:
        yield cluster
    finally:
        cluster.stop()


def _pixels(png_b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png_b64))).convert("RGB"))


def _grpc_frame(cluster: LocalCluster, loras) -> np.ndarray:
    with Client(cluster.endpoint) as client:
        result = client.generate(
            "a red circle", height=64, width=64, num_frames=1, num_inference_steps=1, seed=5, loras=loras
        )
    return result.frames[0]


def test_the_lora_field_over_http_with_openai_and_curl(lora_cluster: LocalCluster) -> None:
    client = openai.OpenAI(api_key="unused", base_url=f"{lora_cluster.http_url}/v1", max_retries=0, timeout=120)
    base = client.images.generate(prompt="a red circle", size="64x64", extra_body=IMAGE)
    styled = client.images.generate(prompt="a red circle", size="64x64", extra_body={**IMAGE, "lora": "style:0.8"})
    expected = _grpc_frame(lora_cluster, [("style", 0.8)])
    assert np.array_equal(_pixels(styled.data[0].b64_json), expected)
    assert not np.array_equal(_pixels(base.data[0].b64_json), expected), "the adapter changed nothing"

    # curl, with the object form; the same frame.
    body = {"prompt": "a red circle", "size": "64x64", **IMAGE, "lora": [{"name": "style", "scale": 0.8}]}
    curl = subprocess.run(
        [shutil.which("curl") or "curl", "-sS", "--fail-with-body", "-H", "Content-Type: application/json"]
        + ["-d", json.dumps(body), f"{lora_cluster.http_url}/v1/images/generations"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert np.array_equal(_pixels(json.loads(curl.stdout)["data"][0]["b64_json"]), expected)

    # A video: its job runs with the adapter and scale named.
    video = client.videos.create(
        prompt="a red circle", size="64x64", extra_body={"num_frames": 5, **IMAGE, "lora": "style:0.5"}
    )
    with Client(lora_cluster.endpoint) as grpc_client:
        loras = grpc_client.get_job(video.id).request.loras
    assert [(lora.name, lora.scale) for lora in loras] == [("style", 0.5)]
    client.videos.delete(video.id)

    # An adapter the DiT does not serve: 404 naming it, over curl.
    refused = subprocess.run(
        ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "-H", "Content-Type: application/json"]
        + ["-d", json.dumps({"prompt": "x", "size": "64x64", **IMAGE, "lora": "missing"})]
        + [f"{lora_cluster.http_url}/v1/images/generations"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    answer, _, status = refused.stdout.rpartition("\n")
    assert status == "404" and "missing" in json.loads(answer)["error"]["message"], refused.stdout
