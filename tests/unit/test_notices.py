"""What changes a request is reported or refused, never silent: a frame count or size the model cannot take is
refused naming the nearest values it takes; the HTTP gateway's `seconds` made a frame count (rounded, clamped)
and `output_compression` 100 are notices of the job, answered with every video object; a job's notices reach the
CLI as `note:` lines and its JSON. The gateway runs in process in front of a real GenerationServicer with fake
stages (tests/helpers/http_gateway_fake.py); the text encoder's truncation notices are in test_text_encoder.py,
and end to end in tests/e2e/test_e2e_http.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.gateway.schemas import frames_for_seconds, quality_for_compression
from services.orchestrator.notices import from_json, merge, take_request_notices, to_json
from services.validation import nearest_allowed, validate_size
from stagediff.cli import main
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2
from stagekit.errors import RequestError
from tests.helpers.fake_client_server import FakeServer
from tests.helpers.fake_orchestrator import LIMITS
from tests.helpers.http_gateway_fake import gateway
from tests.helpers.sdk_events import encoded_events, png_bytes

TRUNCATED = stages_pb2.Notice(
    field="prompt",
    given="721 tokens",
    used="512 tokens",
    message="the prompt was truncated to 512 tokens (721 given); the text encoder takes at most 512",
    source="text-encoder",
)


@pytest.mark.parametrize(
    ("size", "refusal"),
    [
        ((32, 32, 10), "num_frames: 10 is not allowed; the VAE takes 4*k+1 frames (1, 5, 9, ...) up to 129; "
         "the nearest allowed are 9 and 13"),
        ((32, 32, 200), "num_frames: 200 is not allowed; the VAE takes 4*k+1 frames (1, 5, 9, ...) up to 129; "
         "the nearest allowed is 129"),
        ((32, 32, 0), "the nearest allowed is 1"),
        ((500, 32, 9), "height: 500 is not allowed; use a positive multiple of 16 up to 1024; "
         "the nearest allowed are 496 and 512"),
        ((32, 2000, 9), "width: 2000 is not allowed; use a positive multiple of 16 up to 1024; "
         "the nearest allowed is 1024"),
        ((32, -3, 9), "the nearest allowed is 16"),
    ],
)  # fmt: skip
def test_a_size_the_model_cannot_make_is_refused_naming_the_nearest_values(size, refusal) -> None:
    height, width, num_frames = size
    with pytest.raises(RequestError) as refused:
        validate_size(LIMITS, height, width, num_frames)
    assert refusal in str(refused.value)


def test_nearest_allowed_values_stay_within_the_range() -> None:
    assert nearest_allowed(10, 1, 4, 81) == [9, 13]
    assert nearest_allowed(82, 1, 4, 81) == [81] and nearest_allowed(-7, 1, 4, 81) == [1]
    assert nearest_allowed(20, 16, 16, 8) == []


@pytest.mark.parametrize(
    ("seconds", "fps", "frames", "used", "why"),
    [
        (100, 16, 129, "8.06 s", "at most 129 frames"),
        (5, 16, 81, "5.06 s", "4*k+1 frames, and 81 at 16 fps are the nearest"),
        (0.01, 16, 5, "0.31 s", "at least 5 frames"),
        (8.0625, 16, 129, None, None),  # 129 frames at 16 fps exactly: nothing changed
    ],
)
def test_seconds_become_the_frames_the_model_makes_and_say_so(seconds, fps, frames, used, why) -> None:
    made, notice = frames_for_seconds(seconds, fps, LIMITS.temporal_factor, LIMITS.max_frames)
    assert made == frames
    if used is None:
        assert notice is None
    else:
        assert (notice.field, notice.given, notice.used, notice.source) == ("seconds", f"{seconds:g} s", used, "http")
        assert notice.message.startswith(f"the video is {used} long, not {seconds:g} s: ") and why in notice.message


def test_compression_100_is_a_quality_of_1_and_says_so() -> None:
    assert quality_for_compression(30) == (70, None)
    quality, notice = quality_for_compression(100)
    assert quality == 1 and (notice.field, notice.given, notice.used) == ("output_compression", "100", "99")


def test_a_front_ends_notices_move_from_the_request_to_the_job_and_are_added_once() -> None:
    request = generation_pb2.GenerateRequest(prompt="a fox", notices=[TRUNCATED])
    stripped, notices = take_request_notices(request)
    assert notices == [TRUNCATED] and not stripped.notices and stripped.prompt == "a fox" and request.notices
    clamped = stages_pb2.Notice(field="seconds", given="100 s", used="8.06 s", message="clamped", source="http")
    assert merge([TRUNCATED], [clamped, TRUNCATED]) == [TRUNCATED, clamped]
    assert from_json(to_json([TRUNCATED, clamped])) == [TRUNCATED, clamped] and from_json("[]") == []


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str]]:
    with gateway(tmp_path_factory.mktemp("state")) as served:
        yield served


def _call(http, method: str, path: str, body: dict | None = None):
    client, key = http
    return client.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})


def test_seconds_clamped_over_http_are_the_jobs_notice(http) -> None:
    """`"seconds": "100"` was clamped to the model's longest clip without a word; the video object says so,
    and so does every later answer about the job (the notice is the job's, kept by the orchestrator)."""
    created = _call(http, "POST", "/v1/videos", {"prompt": "a fox", "seconds": "100"})
    assert created.status_code == 200, created.text
    video = created.json()
    assert (video["num_frames"], video["seconds"]) == (129, "8.06")
    assert video["notices"] == [
        {
            "field": "seconds",
            "given": "100 s",
            "used": "8.06 s",
            "message": "the video is 8.06 s long, not 100 s: the model makes at most 129 frames (129 at 16 fps)",
            "source": "http",
        }
    ]
    assert _call(http, "GET", f"/v1/videos/{video['id']}").json()["notices"] == video["notices"]
    exact = _call(http, "POST", "/v1/videos", {"prompt": "a fox", "num_frames": 9}).json()
    assert exact["notices"] == []


def test_num_frames_the_vae_cannot_take_is_400_naming_the_nearest_values(http) -> None:
    answer = _call(http, "POST", "/v1/videos", {"prompt": "a fox", "num_frames": 10})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "num_frames" and "the nearest allowed are 9 and 13" in error["message"]


class NoticedJob(generation_pb2_grpc.GenerationServicer):
    """One finished job whose result reports a truncated prompt."""

    async def GetJob(self, request, context):
        return generation_pb2.Job(job_id=request.job_id, state=generation_pb2.JOB_STATE_SUCCEEDED)

    async def WatchJob(self, request, context):
        for event in encoded_events(png_bytes(), "image/png", notices=[TRUNCATED]):
            yield event


def test_the_cli_prints_a_jobs_notices(capsys, tmp_path: Path) -> None:
    server = FakeServer(NoticedJob())
    try:
        out = tmp_path / "fox.png"
        assert main(["wait", "job", "--endpoint", f"127.0.0.1:{server.port}", "--quiet", "--out", str(out)]) == 0
    finally:
        server.stop()
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"note: {TRUNCATED.message}"]
    assert json.loads(captured.out)["notices"] == [
        {"field": "prompt", "given": "721 tokens", "used": "512 tokens", "message": TRUNCATED.message,
         "source": "text-encoder"}
    ]  # fmt: skip
