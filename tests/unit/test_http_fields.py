"""Out-of-range fields and hostile headers over HTTP: each is answered 400, 401, 413 or 431 naming the field,
never 500 nor a tenant's 429.

Integers beyond the GenerateRequest's int32/int64 fields, non-finite and huge floats, and strings beyond their
bounds are refused by the gateway's schemas (400, `param` the field); an Authorization header that could not
carry a key (not printable ASCII, or kilobytes long) is refused before the body is read (401, 431); grpc's
own size limits are not quotas (413, 431). The gateway runs in process in front of a real GenerationServicer
with fake stages (tests/helpers/http_gateway_fake.py). On the gRPC side, metadata that is not UTF-8 is refused
UNAUTHENTICATED without grpc's traceback in the log; adapter names are whole strings.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from services.gateway.errors import from_stagediff_error
from services.orchestrator.tenants import TenantRegistry, hash_api_key, new_api_key
from services.validation import LORA_NAME, resolve_loras
from stagediff.errors import error_for_status
from stagediff.v1 import stages_pb2
from stagekit.errors import RequestError
from tests.helpers.fake_orchestrator import Orchestrator
from tests.helpers.http_gateway_fake import gateway

INT32 = 2**31
INT64 = 2**63


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str]]:
    with gateway(tmp_path_factory.mktemp("state")) as served:
        yield served


def _post(http, path: str, body: bytes | dict, headers: dict | None = None):
    client, key = http
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
    return client.post(path, content=content, headers=headers)


def _refused(answer, status: int, param: str, *words: str) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


# Each was a 500 with a traceback: a protobuf overflow, or round() of a non-finite frame count.
@pytest.mark.parametrize(
    ("fields", "param", "allowed"),
    [
        ({"width": INT32}, "width", "2147483647"),
        ({"height": 2**40}, "height", "2147483647"),
        ({"num_frames": INT32}, "num_frames", "2147483647"),
        ({"num_inference_steps": INT32}, "num_inference_steps", "2147483647"),
        ({"seed": INT64}, "seed", str(INT64 - 1)),
        ({"seed": 2**64}, "seed", str(INT64 - 1)),
        ({"output_quality": INT32}, "output_quality", "100"),
        ({"enable_frame_interpolation": True, "frame_interpolation_exp": INT32}, "frame_interpolation_exp", "4"),
        ({"seconds": 2, "fps": 1e308}, "fps", "240"),
        ({"seconds": 2, "fps": float("inf")}, "fps", "finite"),
        ({"seconds": 2, "fps": float("nan")}, "fps", "finite"),
    ],
)
def test_out_of_range_video_fields_are_400_naming_the_field(http, fields, param, allowed) -> None:
    _refused(_post(http, "/v1/videos", {"prompt": "a fox", **fields}), 400, param, allowed)


@pytest.mark.parametrize("lora", ["a", "a:0.5", {"name": "a", "scale": 0.5}, ["a:1", {"name": "acme/b"}]])
def test_the_lora_field_reaches_the_orchestrator(http, lora) -> None:
    """It was a 500 each time (the gateway built a message the proto does not have); the fake stages serve no
    adapter, so the orchestrator's answer is 404 naming it. The adapters applied: tests/e2e/test_e2e_lora.py."""
    answer = _post(http, "/v1/videos", {"prompt": "a fox", "lora": lora})
    assert answer.status_code == 404, answer.text
    assert "loras[0].name" in answer.json()["error"]["message"]


def test_nan_written_as_json_is_refused_naming_the_field(http) -> None:
    answer = _post(http, "/v1/videos", b'{"prompt": "a fox", "seconds": 2, "fps": NaN}')
    _refused(answer, 400, "fps", "finite")


@pytest.mark.parametrize(
    ("fields", "param", "allowed"),
    [
        ({"width": 2**40}, "width", "2147483647"),
        ({"seed": INT64 - 1, "n": 2}, "seed", str(INT64 - 2)),  # the second image's seed would be 2**63
        ({"lora": {"name": "a", "scale": 1e308}}, "lora.scale", "10"),
        ({"lora": ["a", "b:inf"]}, "lora", "-10 to 10"),
    ],
)
def test_out_of_range_image_fields_are_400_naming_the_field(http, fields, param, allowed) -> None:
    _refused(_post(http, "/v1/images/generations", {"prompt": "a fox", **fields}), 400, param, allowed)


def test_a_query_parameter_that_is_no_number_is_400_naming_it(http) -> None:
    client, key = http
    answer = client.get("/v1/videos?limit=many", headers={"Authorization": f"Bearer {key}"})
    _refused(answer, 400, "limit", "integer")


# ------------------------------------------------------------------- headers --


@pytest.mark.parametrize(
    ("value", "status"),
    [(b"Bearer caf\xe9", 401), (b"Bearer a\x01b", 401), (b"Bearer \x7f", 401), (b"Bearer " + b"k" * 15_000, 431)],
)
def test_an_authorization_header_that_cannot_be_a_key_is_refused_first(http, value: bytes, status: int) -> None:
    client, _ = http
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/videos"), ("GET", "/v1/videos/x")):
        # Not even a body: a route reading it would answer 415 or 400.
        answer = client.request(method, path, headers={"Authorization": value})
        _refused(answer, status, "Authorization", "Authorization")
        assert "Traceback" not in answer.text


def test_a_request_larger_than_the_orchestrator_takes_is_413_not_a_quota(http) -> None:
    """20 MiB of input_reference without a key: over the orchestrator's message limit (its input images and
    1 MiB), which grpc refuses with RESOURCE_EXHAUSTED before any handler. No Retry-After helps: 413 (or 401
    where the key is checked first), never 429."""
    client, _ = http
    files = {"input_reference": ("big.png", b"\x89PNG" + bytes(20 << 20), "image/png")}
    answer = client.post("/v1/videos", data={"prompt": "a fox"}, files=files)
    assert answer.status_code in (401, 413), answer.text
    assert "Retry-After" not in answer.headers


def test_grpc_size_limits_are_not_quotas() -> None:
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    received = error_for_status(exhausted, "Received message larger than max (65011712 vs. 17825792)")
    sent = error_for_status(exhausted, "Sent message larger than max (70000000 vs. 67108864)")
    metadata = error_for_status(exhausted, "received metadata size exceeds soft limit (15592 vs. 8192); ...")
    quota = error_for_status(exhausted, "tenant 'a': requests_per_minute 10 reached")
    assert from_stagediff_error(received).status == 413
    assert "17825792" in from_stagediff_error(received).message
    assert from_stagediff_error(sent).status == 413
    assert from_stagediff_error(metadata).status == 431
    assert "15592" not in from_stagediff_error(metadata).message  # no header sizes of the request
    assert from_stagediff_error(quota).status == 429


# -------------------------------------------------------------- gRPC side --


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK header field without indexing, neither part Huffman-coded (short strings only)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def _raw_grpc_call(port: int, path: bytes, authorization: bytes) -> bytes:
    """One gRPC call over a raw HTTP/2 connection, with metadata no grpc client sends; what came back."""
    headers = b"".join(
        _literal(name, value)
        for name, value in (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", b"test"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"authorization", authorization),
        )
    )
    request = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"") + _frame(1, 4, 1, headers)
    request += _frame(0, 1, 1, b"\x00" * 5)  # an empty message, and the end of the stream
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(request)
        while b"grpc-status" not in received:
            chunk = connection.recv(65536)
            if not chunk:
                break
            received += chunk
    return received


def test_grpc_metadata_that_is_not_utf8_is_refused_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tenants = TenantRegistry.from_dict({"tenants": [{"name": "t", "api_keys": [hash_api_key(new_api_key())]}]})
    orchestrator = Orchestrator(tmp_path / "state", tenants)
    try:
        with caplog.at_level(logging.INFO):
            answer = _raw_grpc_call(orchestrator.port, b"/stagediff.v1.Generation/ListModels", b"Bearer \xff\xfe\x01k")
    finally:
        orchestrator.stop()
    assert b"grpc-status" in answer and b"API key" in answer, answer[-200:]
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR or record.exc_info]
    assert any("not UTF-8" in record.getMessage() for record in caplog.records)


def test_an_adapter_name_is_the_whole_string() -> None:
    assert LORA_NAME.fullmatch("name") and LORA_NAME.fullmatch("acme/name")
    limits = stages_pb2.ModelLimits(max_loras=4)
    for name in ("name\n", "acme/name\n"):
        with pytest.raises(RequestError, match=r"loras\[0\]\.name"):
            resolve_loras(limits, [stages_pb2.LoraAdapter(name=name)])
