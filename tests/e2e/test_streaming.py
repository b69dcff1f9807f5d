"""Streaming at the stage level: the VAE answers each latent frame before the next one is sent."""

from __future__ import annotations

import queue

import pytest
import torch

from services.torch_wire import encode_tensor
from stagediff.tensor_codec import TensorAssembler
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from tests.helpers.grpc_channels import stage_channel

pytestmark = pytest.mark.e2e


def test_vae_streams_frames_in_lockstep_with_latent_frames(cluster) -> None:
    """Latent frame t+1 is only sent after frame t's video frames came back, so a VAE that
    waited for all its input before answering would never answer (the test would time out)."""
    num_latent = 4
    outbox: queue.Queue = queue.Queue()
    with stage_channel(cluster.services["vae"].endpoint) as channel:
        stub = stages_pb2_grpc.VaeDecoderStub(channel)

        def requests():
            while (message := outbox.get()) is not None:
                yield message

        outbox.put(stages_pb2.DecodeRequest(params=stages_pb2.DecodeParams(num_latent_frames=num_latent)))
        responses = stub.Decode(requests(), timeout=60)
        assembler = TensorAssembler()
        received = []
        generator = torch.Generator().manual_seed(0)
        for t in range(num_latent):
            latent = torch.randn(1, 16, 1, 8, 8, generator=generator)
            for chunk in encode_tensor("latents", latent, index=t):
                outbox.put(stages_pb2.DecodeRequest(tensor=chunk))
            frames = None
            while frames is None:
                frames = assembler.feed(next(responses).tensor)
            received.append((frames.index, frames.shape))
        outbox.put(None)
        assert list(responses) == []
    assert received == [(0, (1, 64, 64, 3)), (1, (4, 64, 64, 3)), (5, (4, 64, 64, 3)), (9, (4, 64, 64, 3))]


def test_interpolator_emits_frames_as_their_right_neighbour_arrives(cluster) -> None:
    outbox: queue.Queue = queue.Queue()
    with stage_channel(cluster.services["interp"].endpoint) as channel:
        stub = stages_pb2_grpc.InterpolatorStub(channel)

        def requests():
            while (message := outbox.get()) is not None:
                yield message

        outbox.put(stages_pb2.InterpolateRequest(params=stages_pb2.InterpolateParams(exp=1)))
        responses = stub.Interpolate(requests(), timeout=60)
        assembler = TensorAssembler()
        received = []
        for i in range(3):
            frame = torch.full((1, 32, 32, 3), 40 * i, dtype=torch.uint8)
            for chunk in encode_tensor("frames", frame, index=i):
                outbox.put(stages_pb2.InterpolateRequest(tensor=chunk))
            frames = None
            while frames is None:
                frames = assembler.feed(next(responses).tensor)
            received.append((frames.index, frames.shape[0]))
        outbox.put(None)
        assert list(responses) == []
    # frame 0 alone, then (midpoint, frame 1), then (midpoint, frame 2)
    assert received == [(0, 1), (1, 2), (3, 2)]
