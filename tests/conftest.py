"""Shared fixtures: a tiny checkpoint and a local cluster from deploy/docker-compose.cpu.yml (the default)."""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from families.init_model import init_model
from services.auth import CLUSTER_SECRET_ENV, CLUSTER_SECRET_METADATA_KEY
from services.environment_options import options_module, parse_args
from services.stage_table import SERVE_TARGETS

# One thread per stage process: the machine has few cores and five processes share them.
THREADS_PER_STAGE = 1

# Every stage a test starts (through LocalCluster or directly) demands this secret, as a deployed cluster's
# stages demand theirs; tests that call a stage directly open their channel with `stage_channel`.
CLUSTER_SECRET = "test-cluster-secret"
os.environ[CLUSTER_SECRET_ENV] = CLUSTER_SECRET


class _ClusterSecret(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the cluster secret to every call of a blocking channel."""

    def _with_secret(self, details):
        metadata = [*(details.metadata or ()), (CLUSTER_SECRET_METADATA_KEY, CLUSTER_SECRET)]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_secret(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_secret(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_secret(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_secret(details), requests)


def stage_channel(endpoint: str) -> grpc.Channel:
    """A blocking channel to a stage service that sends the cluster secret with every call."""
    return grpc.intercept_channel(grpc.insecure_channel(endpoint), _ClusterSecret())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("wan-t2v", "tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def a14b_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Wan2.2 A14B checkpoint: two experts, `transformer_2` below boundary_ratio."""
    return init_model("wan2.2-a14b", "tiny", tmp_path_factory.mktemp("models") / "a14b-tiny", seed=0)


@pytest.fixture(scope="session")
def qwen_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen-image", "tiny", tmp_path_factory.mktemp("models") / "qwen-tiny", seed=0)


@pytest.fixture(scope="session")
def a14b_pipeline(a14b_model: Path):
    from diffusers import WanPipeline

    pipeline = WanPipeline.from_pretrained(a14b_model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="session")
def qwen_pipeline(qwen_model: Path):
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline.from_pretrained(qwen_model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="session")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The local cluster every end-to-end test shares (tests that kill stages start their own)."""
    from stagediff.local.supervisor import LocalCluster

    local = LocalCluster(
        tiny_model, threads_per_stage=THREADS_PER_STAGE, log_dir=tmp_path_factory.mktemp("cluster-logs")
    )
    local.start(timeout=300)
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="session")
def reference_pipeline(tiny_model: Path):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(tiny_model)


def reference_frames(pipeline, *, prompt, negative_prompt, height, width, num_frames, steps, guidance, seed):
    """WanPipeline's frames for the arguments, converted to uint8 [F, H, W, 3]."""
    output = pipeline(
        prompt=prompt,
        negative_prompt=negative_prompt,
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=steps,
        guidance_scale=guidance,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).frames[0]
    return (np.clip(output, 0, 1) * 255).round().astype(np.uint8)


def assert_status(error: grpc.RpcError, code: grpc.StatusCode, *words: str) -> None:
    """The call failed with `code` and a message that names each word."""
    assert error.code() == code, f"expected {code}, got {error.code()}: {error.details()}"
    for word in words:
        assert word in (error.details() or ""), f"'{word}' not named in: {error.details()}"


def parse_serve(argv: list[str]) -> argparse.Namespace:
    """`stagediff serve <stage> ...` parsed as its main() parses it: by the stage's own parser, over the STAGEDIFF_*
    environment (services/environment_options.py)."""
    assert argv and argv[0] in SERVE_TARGETS, f"not a serve target: {argv[:1]}"
    try:
        return parse_args(options_module(argv[0]).build_parser(), argv[1:])
    except SystemExit as error:
        pytest.fail(f"stagediff serve {shlex.join(argv)}: rejected by its parser (exit {error.code})")
