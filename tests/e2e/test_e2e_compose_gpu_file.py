"""`stagediff up -f deploy/docker-compose.yml`: the GPU topology, as shipped, run as local processes.

Everything the file says takes effect: the DiT group's Ulysses degree and the
VAE's patch-parallel size come from the env files, the cluster secret and the
tenants file from the secrets directory, and each stage sees its GPU
reservation as CUDA_VISIBLE_DEVICES (this machine has no GPU, so the groups
run on CPU ranks with gloo, from the same code). The frames still equal
WanPipeline's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.orchestrator.tenants import hash_api_key, new_api_key
from stagediff import Client, StageDiffError
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from tests.helpers.references import reference_frames

pytestmark = pytest.mark.e2e

REPOSITORY = Path(__file__).resolve().parents[2]
GPU_COMPOSE_FILE = REPOSITORY / "deploy" / "docker-compose.yml"
STARTUP_TIMEOUT = 300
CASE = dict(
    prompt="a red fox running through snow",
    negative_prompt="blurry, low quality",
    height=64,
    width=64,
    num_frames=9,
    steps=2,
    guidance=5.0,
    seed=0,
)


@pytest.fixture(scope="module")
def gpu_file_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`stagediff up -f deploy/docker-compose.yml` in its own process, with a secrets directory of our own."""
    secrets_dir = tmp_path_factory.mktemp("secrets")
    api_key = new_api_key()
    (secrets_dir / "cluster_secret").write_text("compose-file-cluster-secret\n")
    # The operator's tenant: GetClusterInfo (which this test reads) answers admin tenants only.
    tenants = f"tenants:\n  - name: studio\n    admin: true\n    api_keys: ['{hash_api_key(api_key)}']\n"
    (secrets_dir / "tenants.yaml").write_text(tenants)
    log_dir = tmp_path_factory.mktemp("gpu-file-logs")
    state_dir = tmp_path_factory.mktemp("gpu-file-state")
    environment = {**os.environ, "STAGEDIFF_SECRETS_DIR": str(secrets_dir)}
    up = subprocess.Popen(
        [sys.executable, "-m", "stagediff.cli", "up", "-f", str(GPU_COMPOSE_FILE), "--model", str(tiny_model),
         "--port", "0", "--http-port", "0", "--threads-per-stage", "1", "--log-dir", str(log_dir),
         "--state-dir", str(state_dir), "--startup-timeout", str(STARTUP_TIMEOUT)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
        cwd=tmp_path_factory.getbasetemp(),
    )  # fmt: skip
    lines: list[str] = []
    started: dict[str, str] = {}
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT + 60
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line)
            if line.startswith("started "):  # started NAME pid=N endpoint=HOST:PORT
                name, *fields = line.split()[1:]
                started[name] = dict(field.split("=", 1) for field in fields)["endpoint"]
            if line.startswith("ready ") or time.monotonic() > deadline:
                break
        assert lines and lines[-1].startswith("ready "), "stagediff up did not get ready:\n" + "".join(lines[-40:])
        yield {"endpoint": lines[-1].split()[1], "api_key": api_key, "log_dir": str(log_dir), **started}
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def test_frames_equal_wan_pipeline_through_the_gpu_topology(gpu_file_cluster, reference_pipeline) -> None:
    with Client(gpu_file_cluster["endpoint"], api_key=gpu_file_cluster["api_key"]) as client:
        result = client.generate(
            CASE["prompt"], negative_prompt=CASE["negative_prompt"], height=CASE["height"], width=CASE["width"],
            num_frames=CASE["num_frames"], num_inference_steps=CASE["steps"], guidance_scale=CASE["guidance"],
            seed=CASE["seed"],
        )  # fmt: skip
        stages = {stage.info.stage: stage.info for stage in client.cluster_info().stages}
    expected = reference_frames(reference_pipeline, **CASE)
    difference = np.abs(result.frames.astype(np.int16) - expected.astype(np.int16)).max()
    assert difference <= 1, f"max difference {difference} levels"
    # The env files' layouts took effect: 4 DiT ranks with Ulysses 4, 2 VAE ranks.
    assert stages["dit"].parallel_config["world_size"] == "4"
    assert stages["dit"].parallel_config["ulysses_degree"] == "4"
    assert stages["vae"].parallel_config["vae_patch_parallel_size"] == "2"


def test_the_secrets_are_enforced(gpu_file_cluster) -> None:
    with Client(gpu_file_cluster["endpoint"], api_key="sd-not-a-key") as client, pytest.raises(StageDiffError) as error:
        client.cluster_info()
    assert error.value.code == grpc.StatusCode.UNAUTHENTICATED
    # A stage answers health to anyone, and everything else only to callers holding the cluster secret.
    with grpc.insecure_channel(gpu_file_cluster["dit"]) as channel:
        stub = stages_pb2_grpc.StageControlStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetStageInfo(stages_pb2.GetStageInfoRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        secret = [("x-stagediff-cluster-secret", "compose-file-cluster-secret")]
        info = stub.GetStageInfo(stages_pb2.GetStageInfoRequest(), metadata=secret, timeout=10)
    assert info.stage == "dit"


def test_each_stage_saw_its_gpu_reservation(gpu_file_cluster) -> None:
    """The processes' environments, read from /proc: CUDA_VISIBLE_DEVICES is the service's device_ids."""
    expected = {"text-encoder": "6", "dit": "0,1,2,3", "vae": "4,5", "interp": "7"}
    seen = {}
    for name in expected:
        port = gpu_file_cluster[name].rsplit(":", 1)[1]
        pid = _listening_pid(int(port))
        variables = dict(
            item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
        )
        seen[name] = variables.get("CUDA_VISIBLE_DEVICES")
    assert seen == expected


def _listening_pid(port: int) -> int:
    """The pid of the process listening on 127.0.0.1:`port` (from /proc/net/tcp and the fds of our children)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").rstrip("]") in inodes:
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process listens on port {port}")
