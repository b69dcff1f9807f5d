"""A patch-parallel VAE with too few latent rows per rank is refused when the stage starts."""

from __future__ import annotations

import grpc
import pytest
import torch

from tests.helpers.grpc_channels import stage_channel

pytestmark = pytest.mark.e2e


def test_patch_parallel_vae_refuses_too_few_rows(tiny_model, tmp_path) -> None:
    """Three ranks need three latent rows: the stage says so, and reports its smallest height."""
    import socket
    import subprocess
    import sys

    from services.torch_wire import encode_tensor
    from stagediff.local.supervisor import wait_for_serving
    from stagediff.v1 import stages_pb2, stages_pb2_grpc

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "vae.log").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagediff.cli",
            "serve",
            "vae",
            "--model",
            str(tiny_model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            "1",
            "--vae-patch-parallel-size",
            "3",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for_serving(f"127.0.0.1:{port}", timeout=120)
        with stage_channel(f"127.0.0.1:{port}") as channel:
            info = stages_pb2_grpc.StageControlStub(channel).GetStageInfo(stages_pb2.GetStageInfoRequest())
            assert info.limits.min_height == 32  # 3 latent rows of 8 pixels, rounded up to a multiple of 16
            messages = [stages_pb2.DecodeRequest(params=stages_pb2.DecodeParams(num_latent_frames=1))]
            latent = torch.zeros(1, 16, 1, 2, 8)
            messages += [stages_pb2.DecodeRequest(tensor=chunk) for chunk in encode_tensor("latents", latent)]
            with pytest.raises(grpc.RpcError) as raised:
                list(stages_pb2_grpc.VaeDecoderStub(channel).Decode(iter(messages), timeout=60))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "h=2 rows cannot be split over 3" in raised.value.details()
            # The group is intact: a frame with enough rows decodes.
            latent = torch.zeros(1, 16, 1, 4, 8)
            messages = [stages_pb2.DecodeRequest(params=stages_pb2.DecodeParams(num_latent_frames=1))]
            messages += [stages_pb2.DecodeRequest(tensor=chunk) for chunk in encode_tensor("latents", latent)]
            responses = list(stages_pb2_grpc.VaeDecoderStub(channel).Decode(iter(messages), timeout=60))
            assert responses[0].tensor.header.shape == [1, 32, 64, 3]
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()
