"""Bad input gets the right status code and a message naming the field; every service keeps serving."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.torch_wire import encode_tensor
from stagediff.client import build_request
from stagediff.media import encode_image
from stagediff.v1 import generation_pb2_grpc, image_pb2, stages_pb2, stages_pb2_grpc, tensor_pb2
from tests.helpers.grpc_channels import assert_status, stage_channel

pytestmark = pytest.mark.e2e

STAGES = ("text-encoder", "dit", "vae", "interp")
GOOD = dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0, seed=0)


def _png() -> bytes:
    return encode_image(np.full((8, 8, 3), 128, dtype=np.uint8))


@pytest.fixture(scope="module")
def channels(cluster):
    opened = {"orchestrator": grpc.insecure_channel(cluster.endpoint)}
    for stage in STAGES:
        opened[stage] = stage_channel(cluster.services[stage].endpoint)
    yield opened
    for channel in opened.values():
        channel.close()


def assert_everything_serving(channels) -> None:
    for name, channel in channels.items():
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"{name} stopped serving"


@pytest.mark.parametrize(
    ("overrides", "code", "words"),
    [
        (dict(height=65), grpc.StatusCode.INVALID_ARGUMENT, ["height", "65", "multiple of 16"]),
        (dict(width=0), grpc.StatusCode.INVALID_ARGUMENT, ["width", "multiple of 16"]),
        (dict(width=4096), grpc.StatusCode.INVALID_ARGUMENT, ["width", "up to 1920"]),
        (dict(num_frames=10), grpc.StatusCode.INVALID_ARGUMENT, ["num_frames", "10", "4*k+1"]),
        (dict(num_frames=0), grpc.StatusCode.INVALID_ARGUMENT, ["num_frames"]),
        (dict(num_frames=1001), grpc.StatusCode.INVALID_ARGUMENT, ["num_frames", "up to 257"]),
        (dict(num_inference_steps=0), grpc.StatusCode.INVALID_ARGUMENT, ["num_inference_steps", "1 to 1000"]),
        (dict(num_inference_steps=-3), grpc.StatusCode.INVALID_ARGUMENT, ["num_inference_steps"]),
        (dict(num_inference_steps=10**9), grpc.StatusCode.INVALID_ARGUMENT, ["num_inference_steps", "1 to 1000"]),
        (dict(guidance_scale=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, ["guidance_scale"]),
        (dict(guidance_scale=-1.0), grpc.StatusCode.INVALID_ARGUMENT, ["guidance_scale", "0 to 100"]),
        (dict(seed=-1), grpc.StatusCode.INVALID_ARGUMENT, ["seed"]),
        (dict(fps=0.0), grpc.StatusCode.INVALID_ARGUMENT, ["fps"]),
        (dict(interp_exp=9), grpc.StatusCode.INVALID_ARGUMENT, ["interpolation.exp", "0 (off) to 4"]),
        (dict(interp_exp=1, interp_scale=0.3), grpc.StatusCode.INVALID_ARGUMENT, ["interpolation.scale", "0.25"]),
        (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, ["prompt", "empty"]),
        (dict(prompt="   \n"), grpc.StatusCode.INVALID_ARGUMENT, ["prompt", "empty"]),
        (dict(prompt="x" * 10_001), grpc.StatusCode.INVALID_ARGUMENT, ["prompt", "10001", "at most 10000"]),
        (dict(negative_prompt="x" * 20_000), grpc.StatusCode.INVALID_ARGUMENT, ["negative_prompt", "at most 10000"]),
        (dict(model="no-such-model"), grpc.StatusCode.NOT_FOUND, ["no-such-model", "available", "tiny"]),
        # A text-only model takes no input images.
        (dict(image=_png()), grpc.StatusCode.INVALID_ARGUMENT, ["images: 1 sent", "text only"]),
    ],
)
@pytest.mark.parametrize("rpc", ["Generate", "Submit"])
def test_orchestrator_refuses_bad_requests(channels, overrides, code, words, rpc) -> None:
    arguments = {**GOOD, "prompt": "a fox", **overrides}
    request = build_request(arguments.pop("prompt"), **arguments)
    stub = generation_pb2_grpc.GenerationStub(channels["orchestrator"])
    with pytest.raises(grpc.RpcError) as raised:
        response = getattr(stub, rpc)(request, timeout=30)
        if rpc == "Generate":
            list(response)
    assert_status(raised.value, code, *words)
    assert_everything_serving(channels)


def _call_stream(channel, method: str, messages, response_type):
    call = channel.stream_stream(
        method, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response_type.FromString
    )
    return list(call(iter(messages), timeout=30))


def _tensor(name, value, index=0):
    return list(encode_tensor(name, value, index=index))


def _raw_chunk(name="latents", datatype="FP32", shape=(1, 16, 1, 8, 8), data=b"", last=True, header=True):
    chunk = tensor_pb2.TensorChunk(data=data, last=last)
    if header:
        chunk.header.CopyFrom(tensor_pb2.TensorHeader(name=name, datatype=datatype, shape=list(shape)))
    return chunk


EMBED_DIM = 32  # text_dim of the tiny preset
DIT = "/stagediff.v1.Denoiser/Denoise"
VAE = "/stagediff.v1.VaeDecoder/Decode"
INTERP = "/stagediff.v1.Interpolator/Interpolate"


def _dit_params(**overrides):
    values = dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0, seed=0)
    values.update(overrides)
    return stages_pb2.DenoiseRequest(params=stages_pb2.DenoiseParams(**values))


def _dit_embeds(name="prompt_embeds", shape=(1, 16, EMBED_DIM), dtype=torch.float32):
    return [stages_pb2.DenoiseRequest(tensor=c) for c in _tensor(name, torch.zeros(shape, dtype=dtype))]


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        (lambda: _dit_embeds(), ["params", "first message"]),
        (lambda: [_dit_params(height=60), *_dit_embeds()], ["height", "multiple of 16"]),
        (lambda: [_dit_params(num_frames=8)], ["num_frames"]),
        (lambda: [_dit_params(num_inference_steps=0)], ["num_inference_steps"]),
        (lambda: [_dit_params(model="other")], ["model", "other"]),
        (lambda: [_dit_params(), _dit_params()], ["params", "twice"]),
        (lambda: [_dit_params(), *_dit_embeds()], ["negative_prompt_embeds", "guidance_scale > 1"]),
        (lambda: [_dit_params(), *_dit_embeds(shape=(1, 16, 7))], ["prompt_embeds", f"[1, L, {EMBED_DIM}]"]),
        (lambda: [_dit_params(), *_dit_embeds(shape=(16, EMBED_DIM))], ["prompt_embeds", "3 dimensions"]),
        (lambda: [_dit_params(), *_dit_embeds(dtype=torch.int64)], ["prompt_embeds", "INT64", "FP32"]),
        (lambda: [_dit_params(), *_dit_embeds(name="mystery")], ["mystery", "prompt_embeds"]),
        (lambda: [_dit_params()], ["prompt_embeds", "missing"]),
        (
            lambda: [_dit_params(), stages_pb2.DenoiseRequest(tensor=_raw_chunk(header=False, data=b"xx"))],
            ["header"],
        ),
        (
            lambda: [_dit_params(), stages_pb2.DenoiseRequest(tensor=_raw_chunk(datatype="FP4"))],
            ["FP4", "FP32"],
        ),
        (
            lambda: [_dit_params(), stages_pb2.DenoiseRequest(tensor=_raw_chunk(shape=(1, 2), data=b"\0" * 3))],
            ["marked last after 3 bytes"],
        ),
        (lambda: [stages_pb2.DenoiseRequest()], ["params or tensor"]),
    ],
)
def test_dit_refuses_malformed_input(channels, messages, words) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _call_stream(channels["dit"], DIT, messages(), stages_pb2.DenoiseResponse)
    assert_status(raised.value, grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert_everything_serving(channels)


def _vae_params(count=1, model=""):
    return stages_pb2.DecodeRequest(params=stages_pb2.DecodeParams(num_latent_frames=count, model=model))


def _latent(index=0, shape=(1, 16, 1, 8, 8), dtype=torch.float32):
    return [stages_pb2.DecodeRequest(tensor=c) for c in _tensor("latents", torch.zeros(shape, dtype=dtype), index)]


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        (lambda: _latent(), ["params", "first message"]),
        (lambda: [_vae_params(0)], ["num_latent_frames", "1 to"]),
        (lambda: [_vae_params(1, model="other")], ["model", "other"]),
        (lambda: [_vae_params(1), *_latent(shape=(1, 4, 1, 8, 8))], ["latents", "[1, 16, 1, h, w]"]),
        (lambda: [_vae_params(1), *_latent(shape=(1, 16, 2, 8, 8))], ["one latent frame per tensor"]),
        (lambda: [_vae_params(2), *_latent(0), *_latent(5)], ["index 5", "1 was expected"]),
        (lambda: [_vae_params(2), *_latent(0), *_latent(1, shape=(1, 16, 1, 8, 6))], ["same shape"]),
        (lambda: [_vae_params(3), *_latent(0)], ["1 of the 3 announced"]),
        (lambda: [_vae_params(1), *_latent(0), *_latent(1)], ["more than the 1 frames announced"]),
        (lambda: [_vae_params(1), *_latent(shape=(1, 16, 1, 8, 1000))], ["out of range"]),
    ],
)
def test_vae_refuses_malformed_input(channels, messages, words) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _call_stream(channels["vae"], VAE, messages(), stages_pb2.DecodeResponse)
    assert_status(raised.value, grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert_everything_serving(channels)


def _interp_params(exp=1, scale=0.0):
    return stages_pb2.InterpolateRequest(params=stages_pb2.InterpolateParams(exp=exp, scale=scale))


def _frames(shape=(2, 8, 8, 3), dtype=np.uint8):
    return [stages_pb2.InterpolateRequest(tensor=c) for c in _tensor("frames", np.zeros(shape, dtype))]


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        (lambda: _frames(), ["params", "first message"]),
        (lambda: [_interp_params(exp=9)], ["exp", "0 (pass through) to 4"]),
        (lambda: [_interp_params(scale=3.0)], ["scale", "[0.25, 0.5, 1.0, 2.0, 4.0]"]),
        (
            lambda: [
                stages_pb2.InterpolateRequest(params=stages_pb2.InterpolateParams(exp=1, model_path="/etc/passwd"))
            ],
            ["model_path", "/etc/passwd", "not served", "optical flow"],
        ),
        (lambda: [_interp_params(), *_frames(dtype=np.float32)], ["frames", "FP32", "UINT8"]),
        (lambda: [_interp_params(), *_frames(shape=(2, 8, 8, 4))], ["frames", "[n >= 1, H, W, 3]"]),
        (lambda: [_interp_params(), *_frames(), *_frames(shape=(1, 8, 6, 3))], ["frames of [8, 6, 3]"]),
    ],
)
def test_interp_refuses_malformed_input(channels, messages, words) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        _call_stream(channels["interp"], INTERP, messages(), stages_pb2.InterpolateResponse)
    assert_status(raised.value, grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert_everything_serving(channels)


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (stages_pb2.EncodeRequest(texts=[]), ["texts", "between 1 and"]),
        (stages_pb2.EncodeRequest(texts=["a"] * 9), ["texts", "9 given"]),
        (stages_pb2.EncodeRequest(texts=["a"], model="other"), ["model", "other"]),
        (stages_pb2.EncodeRequest(texts=["x" * 10_001]), ["texts[0]", "at most 10000"]),
        (stages_pb2.EncodeRequest(texts=["a"], max_sequence_length=100_000), ["max_sequence_length"]),
        (
            stages_pb2.EncodeRequest(texts=["a"], images=[image_pb2.InputImage(data=_png())]),
            ["images", "does not see input images"],
        ),
    ],
)
def test_text_encoder_refuses_bad_requests(channels, request_, words) -> None:
    stub = stages_pb2_grpc.TextEncoderStub(channels["text-encoder"])
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Encode(request_, timeout=30))
    assert_status(raised.value, grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert_everything_serving(channels)


def test_vae_encode_refuses_images_for_a_text_only_model(channels) -> None:
    stub = stages_pb2_grpc.VaeDecoderStub(channels["vae"])
    request = stages_pb2.VaeEncodeRequest(height=64, width=64, num_frames=5, images=[image_pb2.InputImage(data=_png())])
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Encode(request, timeout=30))
    assert_status(raised.value, grpc.StatusCode.INVALID_ARGUMENT, "images", "takes no input images")
    assert_everything_serving(channels)


@pytest.mark.parametrize(
    ("stage", "method", "kind"),
    [
        ("text-encoder", "/stagediff.v1.TextEncoder/Encode", "unary_stream"),
        ("dit", DIT, "stream_stream"),
        ("vae", VAE, "stream_stream"),
        ("interp", INTERP, "stream_stream"),
        ("orchestrator", "/stagediff.v1.Generation/Submit", "unary_unary"),
        ("orchestrator", "/stagediff.v1.Generation/Generate", "unary_stream"),
    ],
)
def test_garbage_bytes_do_not_hurt_a_service(channels, stage, method, kind) -> None:
    """Bytes that are not a protobuf message at all: INVALID_ARGUMENT, and the service keeps serving."""
    garbage = bytes(np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8))
    call = getattr(channels[stage], kind)(method, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as raised:
        if kind == "unary_unary":
            call(garbage, timeout=30)
        elif kind == "unary_stream":
            list(call(garbage, timeout=30))
        else:
            list(call(iter([garbage]), timeout=30))
    assert_status(raised.value, grpc.StatusCode.INVALID_ARGUMENT, "request", "not a valid message")
    assert_everything_serving(channels)
