"""`embedded_guidance_scale`, the guidance a guidance-distilled transformer takes as an input (FLUX.1-dev's):
only a model whose limits carry a default takes it, within 0 to 100; the SDK and the HTTP gateway send it, and a
model without a guidance embedding (every fake-stage model here is Wan's kind) refuses it with 400 naming the
field. Its effect on the latents is in tests/integration/test_family_flux.py; through a cluster in
tests/e2e/test_image_families_cluster.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from services.validation import validate_sampling
from stagediff.request import build_request
from stagediff.v1 import stages_pb2
from stagekit.errors import RequestError
from tests.helpers.fake_orchestrator import LIMITS
from tests.helpers.http_gateway_fake import gateway


def _distilled() -> stages_pb2.ModelLimits:
    limits = stages_pb2.ModelLimits()
    limits.CopyFrom(LIMITS)
    limits.default_embedded_guidance_scale = 3.5
    return limits


def test_only_a_guidance_distilled_model_takes_it() -> None:
    validate_sampling(LIMITS, 2, 5.0)
    validate_sampling(_distilled(), 2, 1.0, 3.5)
    with pytest.raises(RequestError, match=r"^embedded_guidance_scale: this model has no guidance embedding"):
        validate_sampling(LIMITS, 2, 5.0, 3.5)


@pytest.mark.parametrize("value", [-0.5, 100.5, float("nan"), float("inf")])
def test_it_is_bounded(value: float) -> None:
    with pytest.raises(RequestError, match=r"^embedded_guidance_scale: .* is not allowed; use 0 to 100"):
        validate_sampling(_distilled(), 2, 1.0, value)


def test_the_sdk_sends_it_only_when_given() -> None:
    assert build_request("a fox", embedded_guidance_scale=2.5).embedded_guidance_scale == 2.5
    assert not build_request("a fox").HasField("embedded_guidance_scale")


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, dict[str, str]]]:
    with gateway(tmp_path_factory.mktemp("state")) as (client, key):
        yield client, {"Authorization": f"Bearer {key}"}


def test_over_http_a_model_without_the_embedding_refuses_it_naming_the_field(http) -> None:
    client, headers = http
    for value in (3.5, 101):
        body = {"prompt": "a fox", "embedded_guidance_scale": value}
        answer = client.post("/v1/images/generations", json=body, headers=headers)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "embedded_guidance_scale"
    models = client.get("/v1/models", headers=headers).json()["data"]
    assert all(model["limits"]["default_embedded_guidance_scale"] is None for model in models)


def test_a_familys_cfg_threshold_decides_whether_the_negative_prompt_is_needed() -> None:
    """Most families guide above 1 (`negative + scale * (positive - negative)`); Z-Image above 0 (ZImagePipeline's
    `positive + scale * (positive - negative)`): the orchestrator needs the negative prompt's embeddings then."""
    import grpc

    from families.registry import FAMILIES
    from services.orchestrator.stage_calls import check_sent
    from services.orchestrator.stage_clients import StageError
    from stagediff.v1 import generation_pb2, tensor_pb2

    def chunk(name: str) -> tensor_pb2.TensorChunk:
        return tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(name=name), last=True)

    sent = [chunk("prompt_embeds")]
    request = generation_pb2.GenerateRequest(prompt="a fox", guidance_scale=0.5)
    check_sent(FAMILIES["flux"], request, "text-encoder", "te:1", [*sent, chunk("prompt_pooled_embeds")])
    with pytest.raises(StageError) as refused:
        check_sent(FAMILIES["z-image"], request, "text-encoder", "te:1", sent)
    assert refused.value.code == grpc.StatusCode.INTERNAL and "negative_prompt_embeds" in str(refused.value)
    check_sent(FAMILIES["z-image"], request, "text-encoder", "te:1", [*sent, chunk("negative_prompt_embeds")])
