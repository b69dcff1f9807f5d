"""The client commands against an in-process fake Generation service: jobs, wait, cancel, delete, generate's output
format from --out, the API key read from a file, and progress as plain lines when stderr is not a terminal (bars
when it is)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from stagediff.cli import main
from stagediff.client import BytesReceived, Progress, Queued
from stagediff.progress import PlainProgress, RichProgress, progress_display
from stagediff.protocol import API_KEY_ENV, API_KEY_FILE_ENV
from stagediff.v1 import generation_pb2, generation_pb2_grpc
from tests.helpers.fake_client_server import FakeServer
from tests.helpers.sdk_events import encoded_events, png_bytes


class Jobs(generation_pb2_grpc.GenerationServicer):
    """Two jobs; WatchJob and Generate stream a PNG result; records every request and its authorization."""

    def __init__(self) -> None:
        self.requests: list[object] = []
        self.authorization: list[str | None] = []
        self.jobs = [
            generation_pb2.Job(
                job_id="job-running",
                state=generation_pb2.JOB_STATE_RUNNING,
                current_stage="dit",
                progress_percent=42.4,
            ),
            generation_pb2.Job(
                job_id="job-done",
                state=generation_pb2.JOB_STATE_SUCCEEDED,
                num_frames_out=1,
                media_type="image/png",
                progress_percent=100,
            ),
        ]
        self.jobs[0].created_at.FromSeconds(1_700_000_000)

    def _record(self, request, context) -> None:
        self.requests.append(request)
        self.authorization.append(dict(context.invocation_metadata()).get("authorization"))

    def _events(self):
        events = encoded_events(png_bytes(), "image/png", pieces=2)
        events.insert(
            1,
            generation_pb2.GenerateEvent(
                job_id="j", progress=generation_pb2.StageProgress(stage="dit", step=1, total=2)
            ),
        )
        return events

    async def ListJobs(self, request, context):
        self._record(request, context)
        return generation_pb2.ListJobsResponse(jobs=self.jobs)

    async def WatchJob(self, request, context):
        self._record(request, context)
        for event in self._events():
            yield event

    async def Generate(self, request, context):
        self._record(request, context)
        for event in self._events():
            yield event

    async def CancelJob(self, request, context):
        self._record(request, context)
        return generation_pb2.Job(job_id=request.job_id, state=generation_pb2.JOB_STATE_CANCELLED)

    async def DeleteJob(self, request, context):
        self._record(request, context)
        return generation_pb2.DeleteJobResponse(job_id=request.job_id, deleted=request.job_id == "job-done")


@pytest.fixture
def server(monkeypatch, tmp_path: Path):
    """The fake service, with no API key in the environment or the home directory."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(API_KEY_FILE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    fake = FakeServer(Jobs())
    yield fake
    fake.stop()


def run(server: FakeServer, *argv: str) -> int:
    return main([argv[0], "--endpoint", f"127.0.0.1:{server.port}", *argv[1:]])


def test_jobs_lists_a_table_or_json(server, capsys) -> None:
    assert run(server, "jobs", "--state", "running", "--limit", "5") == 0
    request = server.servicer.requests[-1]
    assert (request.state, request.limit) == (generation_pb2.JOB_STATE_RUNNING, 5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["JOB", "ID", "STATE", "CREATED", "DONE", "DETAIL"]
    assert lines[1].split()[:2] == ["job-running", "running"] and lines[1].split()[-2:] == ["42%", "dit"]
    assert lines[2].split() == ["job-done", "succeeded", "100%", "1", "frames", "image/png"]
    assert run(server, "jobs", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [job["job_id"] for job in listed] == ["job-running", "job-done"]
    assert server.servicer.requests[-1].state == generation_pb2.JOB_STATE_UNSPECIFIED


def test_jobs_refuses_an_unknown_state(server, capsys) -> None:
    with pytest.raises(SystemExit):
        run(server, "jobs", "--state", "lost")
    assert "invalid choice: 'lost'" in capsys.readouterr().err


def test_wait_saves_the_result_and_prints_its_job_and_seed(server, capsys, tmp_path: Path) -> None:
    out = tmp_path / "done.png"
    assert run(server, "wait", "job-done", "--out", str(out)) == 0
    assert server.servicer.requests[-1].job_id == "job-done"
    assert out.read_bytes() == png_bytes()
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["job_id"] == "j" and summary["seed"] == 42 and summary["out"] == str(out)
    assert summary["media_type"] == "image/png" and summary["bytes"] == len(png_bytes())
    # stderr is not a terminal here: one plain line per event.
    assert captured.err.splitlines()[:2] == ["queued job j at position 0", "dit: 1/2"]
    assert "received bytes 0.." in captured.err


def test_cancel_and_delete(server, capsys) -> None:
    assert run(server, "cancel", "job-running") == 0
    assert json.loads(capsys.readouterr().out) == {"job_id": "job-running", "state": "JOB_STATE_CANCELLED"}
    assert run(server, "delete", "job-done") == 0
    assert json.loads(capsys.readouterr().out) == {"job_id": "job-done", "deleted": True}
    assert run(server, "delete", "job-gone") == 0
    assert json.loads(capsys.readouterr().out) == {"job_id": "job-gone", "deleted": False}


def test_generate_asks_for_the_format_its_out_extension_names(server, capsys, tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    assert run(server, "generate", "--prompt", "a fox", "--quiet", "--out", str(out)) == 0
    assert server.servicer.requests[-1].output_format == "png"
    assert out.read_bytes() == png_bytes() and capsys.readouterr().err == ""
    npz = tmp_path / "fox.npz"
    assert run(server, "generate", "--prompt", "a fox", "--quiet", "--format", "png", "--out", str(npz)) == 0
    assert server.servicer.requests[-1].output_format == "png" and npz.is_file()
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["seed"] == 42
    jpeg = tmp_path / "fox.jpg"
    args = ("generate", "--prompt", "a fox", "--quality", "80", "--keep-raw-frames", "--out", str(jpeg))
    assert run(server, *args) == 2  # the fake answers with a PNG, which a .jpg file cannot hold
    request = server.servicer.requests[-1]
    assert (request.output_format, request.output_quality, request.keep_raw_frames) == ("jpeg", 80, True)


def test_generate_refuses_a_format_its_file_cannot_hold(server, capsys, tmp_path: Path) -> None:
    calls = len(server.servicer.requests)
    assert run(server, "generate", "--prompt", "a fox", "--format", "mp4", "--out", str(tmp_path / "x.webm")) == 2
    assert (
        "--format mp4: a .webm file is written as the server encodes it; use --format webm" in capsys.readouterr().err
    )
    assert run(server, "generate", "--prompt", "a fox", "--out", str(tmp_path / "x.tiff")) == 2
    assert "--out" in capsys.readouterr().err and len(server.servicer.requests) == calls


def test_the_api_key_comes_from_a_file(server, monkeypatch, tmp_path: Path) -> None:
    given = tmp_path / "given-key"
    given.write_text("key-from-flag\n")
    named = tmp_path / "named-key"
    named.write_text("key-from-env-file")
    default = tmp_path / "home" / ".config" / "stagediff" / "api-key"
    default.parent.mkdir(parents=True)
    default.write_text("key-from-default\n")

    assert run(server, "jobs") == 0  # the default file
    assert run(server, "jobs", "--api-key-file", str(given)) == 0
    monkeypatch.setenv(API_KEY_FILE_ENV, str(named))
    assert run(server, "jobs") == 0
    monkeypatch.setenv(API_KEY_ENV, "key-from-env")
    assert run(server, "jobs") == 0
    assert run(server, "jobs", "--api-key", "key-from-argument") == 0
    assert server.servicer.authorization == [
        "Bearer key-from-default",
        "Bearer key-from-flag",
        "Bearer key-from-env-file",
        "Bearer key-from-env",
        "Bearer key-from-argument",
    ]


def test_an_unreadable_key_file_is_an_error_naming_it(server, capsys, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-key"
    assert run(server, "jobs", "--api-key-file", str(missing)) == 2
    assert f"api_key_file: cannot read the API key file {missing}" in capsys.readouterr().err
    assert server.servicer.requests == []


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_bars_on_a_terminal_and_lines_elsewhere() -> None:
    assert isinstance(progress_display(False, io.StringIO()), PlainProgress)
    assert progress_display(True, Terminal()) is None
    terminal = Terminal()
    display = progress_display(False, terminal)
    assert isinstance(display, RichProgress)
    with display:
        for event in (
            Queued("j", 0),
            Progress("j", "dit", 1, 4),
            Progress("j", "dit", 4, 4),
            BytesReceived("j", 0, 10),
        ):
            display(event)
    drawn = terminal.getvalue()
    assert "queued job j at position 0" in drawn and "dit" in drawn and "4/4" in drawn
