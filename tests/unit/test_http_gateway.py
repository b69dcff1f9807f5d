"""The HTTP gateway's answers to the orchestrator's refusals, through OpenAI's own client: each gRPC status is
the HTTP status and the openai package's exception a client expects (401, 403, 404, 429 with Retry-After from
the RetryInfo, 503 naming the stage), in OpenAI's error shape; the gateway's own bounds (body size, content
type, unknown fields) and its readiness. The orchestrator is a small in-process fake here; the flows against a
real cluster are in test_e2e_http.py.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import openai
import pytest
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.gateway.app import create_app
from services.gateway.orchestrator import Orchestrator
from stagediff.status_details import abort_with_retry
from stagediff.v1 import generation_pb2, generation_pb2_grpc

# OpenAI marks its videos API deprecated for its own service; the routes are the convention we serve.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


class Refusing(generation_pb2_grpc.GenerationServicer):
    """Refuses every submit as the caller's key says; records the keys it was given."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    async def Submit(self, request, context):
        key = dict(context.invocation_metadata()).get("authorization", "")
        self.keys.append(key)
        if key == "Bearer bad":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        if key == "Bearer denied":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "loras[0].name: tenant may not use 'x'")
        if key == "Bearer busy":
            await abort_with_retry(context, "tenant 'busy': requests_per_minute 10 reached", 7.2)
        if key == "Bearer down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stage 'dit' at dit:50062 is unavailable: gone")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "height: 65 is not a multiple of 16")

    async def GetJob(self, request, context):
        await context.abort(grpc.StatusCode.NOT_FOUND, f"job_id: no job '{request.job_id}'")


def _http(method: str, url: str, body: bytes | None = None, content_type: str = "application/json"):
    """(status, JSON answer) of one HTTP call."""
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _post(url: str, fields: dict) -> tuple[int, dict]:
    return _http("POST", url, json.dumps(fields).encode())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, Refusing, str]]:
    """The gateway on uvicorn in front of the fake orchestrator, both on one event loop in a thread; and
    another gateway whose orchestrator does not answer."""
    servicer = Refusing()
    grpc_port, http_port, lonely_port = _free_port(), _free_port(), _free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = asyncio.Event()

    async def serve() -> None:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
        servers = []
        for port, endpoint in ((http_port, f"127.0.0.1:{grpc_port}"), (lonely_port, f"127.0.0.1:{_free_port()}")):
            app = create_app(Orchestrator(endpoint), max_body_bytes=4096, image_wait_s=5.0)
            servers.append(uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None)))
        tasks = [asyncio.create_task(web.serve()) for web in servers]
        while not all(web.started for web in servers):
            await asyncio.sleep(0.01)
        started.set()
        await stop.wait()
        for web in servers:
            web.should_exit = True
        await asyncio.gather(*tasks)
        await server.stop(None)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield f"http://127.0.0.1:{http_port}", servicer, f"http://127.0.0.1:{lonely_port}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{base}/v1", max_retries=0, timeout=10)


@pytest.mark.parametrize(
    ("key", "exception", "status", "param"),
    [
        ("bad", openai.AuthenticationError, 401, None),
        ("denied", openai.PermissionDeniedError, 403, None),
        ("busy", openai.RateLimitError, 429, None),
        ("down", openai.InternalServerError, 503, "dit"),
        ("fine", openai.BadRequestError, 400, "height"),
    ],
)
def test_orchestrator_refusals_are_openai_errors(gateway, key, exception, status, param) -> None:
    base, servicer, _ = gateway
    with pytest.raises(exception) as raised:
        _client(base, key).videos.create(prompt="a fox")
    error = raised.value
    assert error.status_code == status
    assert error.body["param"] == param and error.body["message"] and error.body["type"]
    assert servicer.keys[-1] == f"Bearer {key}"  # the caller's key reached the orchestrator
    if status == 429:
        assert error.response.headers["retry-after"] == "8"  # RetryInfo 7.2 s, rounded up


def test_unknown_job_is_404(gateway) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        _client(gateway[0], "fine").videos.retrieve("nope")
    assert "nope" in raised.value.body["message"]


def test_the_gateways_own_bounds(gateway) -> None:
    base = gateway[0]
    status, answer = _post(f"{base}/v1/videos", {"prompt": "x" * 5000})
    assert status == 413 and answer["error"]["code"] == "body_too_large"
    status, _ = _http("POST", f"{base}/v1/videos", b"prompt", content_type="text/plain")
    assert status == 415
    for route, fields, param in (
        ("videos", {"prompt": "x", "num_inference_step": 2}, "num_inference_step"),
        ("videos", {"prompt": "x", "input_reference": "http://internal/secret.png"}, "input_reference"),
        ("videos", {"prompt": "x", "seconds": 2, "num_frames": 9}, "seconds"),
        ("images/generations", {"prompt": "x", "size": "huge"}, "size"),
        ("images/generations", {"prompt": "x", "response_format": "url"}, "response_format"),
        ("images/generations", {"prompt": "x", "n": 11}, "n"),
    ):
        status, answer = _post(f"{base}/v1/{route}", fields)
        assert (status, answer["error"]["param"]) == (400, param), answer


def test_health_and_readiness(gateway) -> None:
    base, _, lonely = gateway
    assert _http("GET", f"{base}/healthz")[0] == 200
    assert _http("GET", f"{base}/readyz") == (200, {"status": "ready"})
    # No orchestrator answers the other gateway: it is up, not ready.
    assert _http("GET", f"{lonely}/healthz")[0] == 200
    status, answer = _http("GET", f"{lonely}/readyz")
    assert status == 503 and "not serving" in answer["error"]["message"]


def test_video_object_fields() -> None:
    """A job as OpenAI's Video object: status names, progress, seconds from frames and fps, the error."""
    from services.gateway.schemas import video_object

    job = generation_pb2.Job(
        job_id="j",
        state=generation_pb2.JOB_STATE_FAILED,
        request=generation_pb2.GenerateRequest(model="m", prompt="p", width=64, height=32, num_frames=9, fps=8),
        progress_percent=42.7,
        error=generation_pb2.JobError(code=14, message="stage 'vae' is unavailable"),
    )
    video = video_object(job)
    assert (video["status"], video["progress"], video["seconds"], video["size"]) == ("failed", 42, "1.12", "64x32")
    assert video["error"] == {"code": "unavailable", "message": "stage 'vae' is unavailable"}


def test_a_chunked_body_over_the_limit_is_413(gateway) -> None:
    """No Content-Length to refuse up front: the chunks are counted as they arrive."""
    base = gateway[0].removeprefix("http://")
    connection = http.client.HTTPConnection(base, timeout=10)
    chunks = iter([b'{"prompt": "', b"x" * 5000, b'"}'])
    connection.request("POST", "/v1/videos", body=chunks, headers={"Content-Type": "application/json"})
    answer = connection.getresponse()
    assert answer.status == 413 and json.loads(answer.read())["error"]["code"] == "body_too_large"
    connection.close()
