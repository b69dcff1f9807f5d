"""A DiT group over two "nodes" on this machine: node 0 serves, node 1 follows over the control channel.

Both nodes are `stagediff serve dit` processes with the same flags and their own --node-rank, as two pods of a
StatefulSet would be; gloo carries the collectives between them as it would between machines.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.connection import Listener
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dit_svc.config import DitConfig
from families.wan.denoise import WanDenoiser
from services.auth import CLUSTER_SECRET_ENV
from services.rank_group import (
    ControlChannel,
    GroupFailure,
    GroupSettings,
    accept_nodes,
    connect_to_node0,
    group_authkey,
)
from services.torch_wire import encode_tensor, to_torch
from stagediff.local.launch import free_ports
from stagediff.tensor_codec import TensorAssembler
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from stagekit.denoise import DenoiseSpec
from tests.helpers.grpc_channels import CLUSTER_SECRET, stage_channel
from tests.helpers.serving import parse_serve

pytestmark = pytest.mark.e2e

# As tests/helpers/feature_mixins/parallel_layouts.py: a layout's latents equal one rank's within fp32 noise.
TOLERANCE = 1e-4
STARTUP_S = 120
# 48x80 with 5 frames: 2 x 3 x 5 = 30 tokens, not divisible by the 4 ranks.
SPEC = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=2, guidance_scale=4.0, seed=1)


def _dit_command(model: Path, node_rank: int, port: int, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "stagediff.cli", "serve", "dit", "--model", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--threads", "1", "--device", "cpu", "--node-rank", str(node_rank), *flags,
    ]  # fmt: skip


def _health(endpoint: str) -> str:
    """SERVING, NOT_SERVING, or UNREACHABLE."""
    with grpc.insecure_channel(endpoint) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _wait_for_health(endpoint: str, wanted: str, timeout: float, processes=()) -> None:
    deadline = time.monotonic() + timeout
    while (status := _health(endpoint)) != wanted:
        for process in processes:
            assert process.poll() is None, f"{process.args[-8:]} exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{endpoint} still {status} after {timeout:.0f} s"
        time.sleep(0.5)


def _stop(process: subprocess.Popen) -> None:
    """Ends a node and the ranks it started (a SIGKILLed node leaves them to notice on their own)."""
    ranks = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _embeds(text_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SPEC.seed)
    return torch.randn(1, 24, text_dim, generator=generator), torch.randn(1, 24, text_dim, generator=generator)


def _denoise_requests(spec: DenoiseSpec, prompt: torch.Tensor, negative: torch.Tensor):
    yield stages_pb2.DenoiseRequest(
        params=stages_pb2.DenoiseParams(
            height=spec.height, width=spec.width, num_frames=spec.num_frames,
            num_inference_steps=spec.num_inference_steps, guidance_scale=spec.guidance_scale, seed=spec.seed,
        )
    )  # fmt: skip
    for name, tensor in (("prompt_embeds", prompt), ("negative_prompt_embeds", negative)):
        for chunk in encode_tensor(name, tensor):
            yield stages_pb2.DenoiseRequest(tensor=chunk)


def _latents(responses) -> torch.Tensor:
    """The latent frames of a Denoise stream, joined along time."""
    assembler, frames = TensorAssembler(), []
    for response in responses:
        if response.HasField("tensor") and (tensor := assembler.feed(response.tensor)) is not None:
            frames.append(to_torch(tensor))
    return torch.cat(frames, dim=2)


@pytest.fixture(scope="module")
def two_nodes(tiny_model, tmp_path_factory) -> Iterator[dict]:
    """Node 1 started first (pods start in any order), then node 0; both SERVING."""
    logs = tmp_path_factory.mktemp("nodes")
    master_port, group_port, port0, port1 = free_ports(4, "127.0.0.1")
    flags = ["--ulysses-degree", "4", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(master_port), "--group-port", str(group_port)]  # fmt: skip
    env = {**os.environ, CLUSTER_SECRET_ENV: CLUSTER_SECRET}
    processes: list[subprocess.Popen] = []
    try:
        for rank, port in ((1, port1), (0, port0)):
            log = (logs / f"node{rank}.log").open("w")
            command = _dit_command(tiny_model, rank, port, *flags)
            # Each node in its own session: killing its process group is what losing its pod does.
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True))
        node1, node0 = processes
        _wait_for_health(f"127.0.0.1:{port0}", "SERVING", STARTUP_S, processes)
        yield {"node0": node0, "node1": node1, "endpoint0": f"127.0.0.1:{port0}",
               "endpoint1": f"127.0.0.1:{port1}", "logs": logs}  # fmt: skip
    finally:
        for process in processes:
            _stop(process)


def test_two_nodes_denoise_as_one_rank_does(two_nodes, tiny_model) -> None:
    reference = WanDenoiser(tiny_model, torch.device("cpu"), torch.float32)
    prompt, negative = _embeds(reference.text_dim)
    conditioning = {"prompt_embeds": prompt, "negative_prompt_embeds": negative}
    expected = reference.denoise(SPEC, conditioning, on_step=lambda s, t: None, cancelled=lambda: False)
    _wait_for_health(two_nodes["endpoint1"], "SERVING", 30)
    with stage_channel(two_nodes["endpoint0"]) as channel:
        denoise = channel.stream_stream(
            "/stagediff.v1.Denoiser/Denoise",
            request_serializer=stages_pb2.DenoiseRequest.SerializeToString,
            response_deserializer=stages_pb2.DenoiseResponse.FromString,
        )
        latents = _latents(denoise(_denoise_requests(SPEC, prompt, negative), timeout=120))
        info = stages_pb2_grpc.StageControlStub(channel).GetStageInfo(stages_pb2.GetStageInfoRequest(), timeout=10)
    assert latents.shape == expected.shape
    assert torch.allclose(latents, expected, atol=TOLERANCE, rtol=TOLERANCE), (latents - expected).abs().max()
    layout = info.parallel_config
    assert (layout["world_size"], layout["nnodes"], layout["ulysses_degree"]) == ("4", "2", "4")
    assert layout["devices"] == "2 nodes x (cpu x 2 processes)"
    # Node 1 answers health only: the stage's API is node 0's.
    with stage_channel(two_nodes["endpoint1"]) as channel, pytest.raises(grpc.RpcError) as refused:
        stages_pb2_grpc.StageControlStub(channel).GetStageInfo(stages_pb2.GetStageInfoRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_follower_node_told_to_stop_stays_for_node0s_call(two_nodes, tiny_model) -> None:
    """SIGTERM to node 1 (its pod being deleted) in the middle of node 0's call: node 1 says NOT_SERVING but
    keeps its ranks in the group until node 0 ends it or its --drain-grace runs out, so the call ends whole."""
    prompt, negative = _embeds(WanDenoiser(tiny_model, torch.device("cpu"), torch.float32).text_dim)
    spec = replace(SPEC, num_inference_steps=30)
    with stage_channel(two_nodes["endpoint0"]) as channel:
        denoise = channel.stream_stream(
            "/stagediff.v1.Denoiser/Denoise",
            request_serializer=stages_pb2.DenoiseRequest.SerializeToString,
            response_deserializer=stages_pb2.DenoiseResponse.FromString,
        )
        responses = []
        for response in denoise(_denoise_requests(spec, prompt, negative), timeout=120):
            responses.append(response)
            if response.HasField("progress") and response.progress.step == 2:
                two_nodes["node1"].send_signal(signal.SIGTERM)
    assert _latents(responses).shape[2] == 2  # 5 frames: 2 latent frames, all of them
    assert two_nodes["node1"].poll() is None, "node 1 left the group while node 0 still served"
    _wait_for_health(two_nodes["endpoint1"], "NOT_SERVING", 10)
    assert "draining" in (two_nodes["logs"] / "node1.log").read_text()


def test_a_lost_node_turns_node0_not_serving(two_nodes, tiny_model) -> None:
    """Runs last on the module's nodes: it kills node 1, ranks and all, in the middle of a request."""
    prompt, negative = _embeds(WanDenoiser(tiny_model, torch.device("cpu"), torch.float32).text_dim)
    long = DenoiseSpec(height=48, width=80, num_frames=5, num_inference_steps=500, guidance_scale=4.0, seed=1)
    with stage_channel(two_nodes["endpoint0"]) as channel:
        denoise = channel.stream_stream(
            "/stagediff.v1.Denoiser/Denoise",
            request_serializer=stages_pb2.DenoiseRequest.SerializeToString,
            response_deserializer=stages_pb2.DenoiseResponse.FromString,
        )
        responses = denoise(_denoise_requests(long, prompt, negative), timeout=60)
        with pytest.raises(grpc.RpcError) as failed:
            for response in responses:
                if response.HasField("progress") and response.progress.step == 2:
                    os.killpg(two_nodes["node1"].pid, signal.SIGKILL)  # the node and its ranks, as a pod dies
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert "dit" in failed.value.details()
        _wait_for_health(two_nodes["endpoint0"], "NOT_SERVING", 10)
        with pytest.raises(grpc.RpcError) as refused:
            _latents(denoise(_denoise_requests(SPEC, prompt, negative), timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "dit node 1 lost" in refused.value.details(), refused.value.details()
    assert "cannot serve any more" in (two_nodes["logs"] / "node0.log").read_text()


def test_a_follower_node_exits_when_node0_goes_away(tiny_model, tmp_path) -> None:
    """A stand-in node 0 welcomes node 1 and then closes the channel: node 1 must exit non-zero, to be
    restarted, rather than wait for a group that cannot come back."""
    master_port, group_port, port = free_ports(3, "127.0.0.1")
    authkey = group_authkey(CLUSTER_SECRET)
    flags = ["--ulysses-degree", "4", "--nnodes", "2", "--master-port", str(master_port),
             "--group-port", str(group_port)]  # fmt: skip
    log = tmp_path / "node1.log"
    with Listener(("127.0.0.1", group_port), authkey=authkey) as listener:
        node1 = subprocess.Popen(
            _dit_command(tiny_model, 1, port, *flags),
            env={**os.environ, CLUSTER_SECRET_ENV: CLUSTER_SECRET},
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        try:
            with listener.accept() as conn:
                assert pickle.loads(conn.recv_bytes()) == ("hello", 1, 4)
                conn.send_bytes(pickle.dumps(("welcome", None)))
                assert _health(f"127.0.0.1:{port}") == "NOT_SERVING"  # its ranks wait for node 0's rank 0
            assert node1.wait(timeout=60) != 0
        finally:
            _stop(node1)
    assert "exiting to be restarted" in log.read_text() or "lost the connection" in log.read_text()


REFUSED = {
    "nnodes-not-dividing": (["--nnodes", "3"], ["--nnodes 3", "does not divide the world size 4", "[1, 2, 4]"]),
    "node-rank-out-of-range": (["--nnodes", "2", "--node-rank", "2"], ["--node-rank 2", "allowed 0..1"]),
    "no-cluster-secret": (["--nnodes", "2"], ["--nnodes 2 needs the cluster secret", CLUSTER_SECRET_ENV]),
    "same-ports": (["--nnodes", "2", "--master-port", "29501"], ["--group-port 29501", "--master-port"]),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_impossible_node_flags_are_refused(tiny_model, monkeypatch, case) -> None:
    """The check `serve dit` runs before anything starts, as in tests/unit/test_families.py."""
    flags, words = REFUSED[case]
    if case == "no-cluster-secret":
        monkeypatch.delenv(CLUSTER_SECRET_ENV)
    with pytest.raises(SystemExit) as raised:
        DitConfig.from_args(parse_serve(["dit", "--model", str(tiny_model), "--ulysses-degree", "4", *flags]))
    for word in words:
        assert word in str(raised.value), str(raised.value)


def test_a_multinode_dit_without_a_cluster_secret_exits_at_startup(tiny_model) -> None:
    """An unauthenticated control channel would run whatever pickle reaches it: refused before anything starts."""
    completed = subprocess.run(
        _dit_command(tiny_model, 1, 0, "--ulysses-degree", "4", "--nnodes", "2"),
        env={**os.environ, CLUSTER_SECRET_ENV: ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode != 0
    assert "--nnodes 2 needs the cluster secret" in completed.stderr, completed.stderr[-2000:]


def test_the_control_channel_admits_only_the_cluster_and_the_same_layout() -> None:
    """Node 0's listener against three would-be node 1s: a wrong key, another world size, and the right one."""
    port = free_ports(1, "127.0.0.1")[0]
    node0 = GroupSettings("dit", world_size=4, device="cpu", threads=1, master_port=0, nnodes=2)
    channel = ControlChannel(port, group_authkey(CLUSTER_SECRET), bind_host="127.0.0.1")
    accepted: dict[int, object] = {}
    waiting = threading.Thread(target=lambda: accepted.update(accept_nodes(node0, channel, timeout=30)))
    waiting.start()
    try:
        node1 = replace(node0, node_rank=1)
        with pytest.raises(GroupFailure, match="same cluster secret"):
            connect_to_node0(node1, replace(channel, authkey=group_authkey("another secret")), timeout=10)
        with pytest.raises(GroupFailure, match="world size 2 differs from node 0's 4"):
            connect_to_node0(replace(node1, world_size=2, nnodes=2), channel, timeout=10)
        with connect_to_node0(node1, channel, timeout=10):
            waiting.join(timeout=10)
            assert list(accepted) == [1]
    finally:
        waiting.join(timeout=30)
        for conn in accepted.values():
            conn.close()
