"""Random and hostile requests against every route of the HTTP gateway: none is answered 500.

Hypothesis draws requests from the gateway's own schemas: the bodies' fields are the pydantic models' (so a
field added later is fuzzed too), each given either a plausible value or a hostile one (integers past int32
and int64, NaN, infinities, 1e308, lone surrogates, nested lists and objects, unknown fields), sent as JSON (NaN
and Infinity spelled as Python writes them), as a multipart form (with an uploaded file), or as garbage bytes;
query parameters and video ids likewise; the Authorization header is a valid key, none, random bytes or
kilobytes. Every answer is a 2xx, 4xx, or a 504 where an image route waited out its jobs (they never finish
here); a 4xx is OpenAI's error shape. The gateway runs in process in front of the real GenerationServicer
with fake stages (tests/helpers/http_gateway_fake.py), whose jobs never run a model.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import quote_from_bytes

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.gateway.schemas import ImageEdit, ImageGenerate, VideoCreate
from tests.helpers.http_gateway_fake import gateway

pytestmark = pytest.mark.timeout(180)

# Where an image route waits for its jobs before answering 504: short, as they never finish here.
IMAGE_WAIT_S = 0.05
HOSTILE_NUMBERS = [0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, 2**64, 10**30, -(10**30)]
HOSTILE_NUMBERS += [1e308, -1e308, 5e-324, float("nan"), float("inf"), float("-inf"), 0.3, 16.0]
HOSTILE_TEXT = ["", "auto", "64x64", "99999x99999", "a:0.5", "a:nan", "a:1e308", "name\n", "../x", "mp4", "png"]
HOSTILE_TEXT += ["data:image/png;base64,AAAA", "data:,", "data:image/png;base64,!!", "none", "\x00", "x" * 5000]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(HOSTILE_NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.sampled_from(HOSTILE_TEXT),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
# Values that pass the schemas, so that requests also reach the orchestrator's own checks and the job routes.
PLAUSIBLE = {
    "model": st.sampled_from(["", "tiny", "other"]),
    "prompt": st.text(min_size=1, max_size=20),
    "size": st.sampled_from(["32x32", "64x48", "auto", "17x17"]),
    "width": st.sampled_from([16, 32, 48, 1024, 2048]),
    "height": st.sampled_from([16, 32, 48, 1024, 2048]),
    "num_frames": st.sampled_from([1, 5, 9, 10, 200]),
    "num_inference_steps": st.integers(1, 3),
    "seed": st.integers(0, 2**63 - 1),
    "fps": st.sampled_from([8.0, 16.0, 240.0]),
    "seconds": st.sampled_from([0.5, 1.0, 3600.0]),
    "lora": st.sampled_from(["a", "a:0.5", {"name": "acme/b"}, ["a", "b:2"]]),
    "cache": st.sampled_from(["none", "teacache", "x"]),
    "cache_threshold": st.sampled_from([0.1, 1.0]),
    "n": st.integers(1, 3),
    "output_quality": st.integers(1, 100),
    "output_compression": st.integers(0, 100),
    "frame_interpolation_exp": st.integers(0, 4),
    "frame_interpolation_scale": st.sampled_from([0.0, 0.5, 4.0]),
}
ROUTES = {"/v1/videos": VideoCreate, "/v1/images/generations": ImageGenerate, "/v1/images/edits": ImageEdit}


@st.composite
def bodies(draw, model) -> dict:
    """Some of `model`'s fields (prompt most often), each plausible or hostile, and now and then unknown ones."""
    names = sorted(model.model_fields)
    chosen = draw(st.lists(st.sampled_from(names), max_size=6, unique=True))
    if draw(st.integers(0, 4)):
        chosen.append("prompt")
    body = {}
    for name in chosen:
        plausible = PLAUSIBLE.get(name)
        body[name] = draw(plausible if plausible is not None and draw(st.booleans()) else values)
    if not draw(st.integers(0, 9)):
        body[draw(st.text(min_size=1, max_size=12))] = draw(values)
    return body


def _wire(value) -> bytes:
    """A form or query value as a client puts it on the wire: text as UTF-8 (a lone surrogate as the invalid
    bytes a hostile client can send), anything else as JSON."""
    return (value if isinstance(value, str) else json.dumps(value)).encode("utf-8", "surrogatepass")


@st.composite
def authorizations(draw, key: str) -> dict:
    header_bytes = st.binary(max_size=40).map(lambda raw: raw.translate(None, b"\r\n\x00"))
    if draw(st.sampled_from(["key", "key", "other"])) == "key":  # mostly, so that requests go past the key check
        return {"Authorization": f"Bearer {key}".encode()}
    choice = draw(
        st.one_of(
            st.none(),
            header_bytes.map(lambda raw: b"Bearer " + raw),
            header_bytes,
            st.sampled_from([b"Bearer " + b"k" * 15_000, b"Bearer sd-" + b"a" * 43, b"Basic x"]),
        )
    )
    return {} if choice is None else {"Authorization": choice}


@st.composite
def requests(draw, key: str) -> tuple[str, str, dict]:
    """(method, path, keyword arguments of TestClient.request)."""
    headers = draw(authorizations(key))
    if draw(st.booleans()):
        headers["Idempotency-Key"] = draw(st.text(st.characters(max_codepoint=0x7E, min_codepoint=0x20), max_size=120))
    kind = draw(st.sampled_from(["json", "json", "json", "form", "bytes", "get"]))
    if kind == "get":
        text = st.text(min_size=1, max_size=70).map(lambda text: quote_from_bytes(_wire(text), safe=""))
        video = draw(st.one_of(text, st.just("0" * 32)))
        path = draw(
            st.sampled_from(
                ["/v1/videos", f"/v1/videos/{video}", f"/v1/videos/{video}/content", f"/v1/videos/{video}/events"]
                + ["/v1/models", "/healthz"]
            )
        )
        method = "DELETE" if path == f"/v1/videos/{video}" and draw(st.booleans()) else "GET"
        params = draw(st.dictionaries(st.sampled_from(["limit", "after", "order", "variant"]), scalars, max_size=3))
        query = "&".join(f"{name}={quote_from_bytes(_wire(value))}" for name, value in params.items())
        return method, f"{path}?{query}" if query else path, {"headers": headers}
    path = draw(st.sampled_from(sorted(ROUTES)))
    body = draw(bodies(ROUTES[path]))
    if kind == "json":
        headers["Content-Type"] = "application/json"
        return "POST", path, {"headers": headers, "content": json.dumps(body).encode()}
    if kind == "bytes":
        headers["Content-Type"] = draw(st.sampled_from(["application/json", "text/plain", "multipart/form-data"]))
        return "POST", path, {"headers": headers, "content": draw(st.binary(max_size=200))}
    field = "image" if path.endswith("edits") else "input_reference"
    files = {field: ("x.png", draw(st.binary(max_size=64)), "image/png")} if draw(st.booleans()) else None
    data = {name: _wire(value) for name, value in body.items()}
    return "POST", path, {"headers": headers, "data": data, "files": files}


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str]]:
    with gateway(tmp_path_factory.mktemp("state"), image_wait_s=IMAGE_WAIT_S) as served:
        yield served


def test_no_request_is_answered_500(http) -> None:
    client, key = http
    statuses: Counter[int] = Counter()
    json_headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    @settings(
        max_examples=800,
        deadline=timedelta(seconds=5),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(requests(key))
    @example(("POST", "/v1/videos", {"headers": json_headers, "content": b"[" * 100_000}))
    @example(("POST", "/v1/videos", {"headers": json_headers, "content": b'{"a": 1e999}'}))
    @example(("POST", "/v1/videos", {"headers": json_headers, "content": b"1" * 5000}))
    def check(request: tuple[str, str, dict]) -> None:
        method, path, arguments = request
        answer = client.request(method, path, **arguments)
        statuses[answer.status_code] += 1
        image_route = path.startswith("/v1/images")  # its jobs never finish here
        assert answer.status_code < 500 or (image_route and answer.status_code == 504), (
            f"{method} {path}: {answer.status_code} {answer.text[:300]}"
        )
        if answer.status_code >= 400:
            assert "message" in answer.json()["error"], answer.text[:300]

    check()
    # The requests reached every layer: jobs were made, and the schemas, the key check and the orchestrator
    # refused some.
    assert {200, 400, 401, 404} <= set(statuses), statuses
