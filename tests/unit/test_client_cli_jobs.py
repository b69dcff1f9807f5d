"""The client commands against an in-process fake Generation service: jobs, wait, cancel, delete, submit, generate's
flags and output format from --out, the API key read from a file, connection failures in one line, and progress
as plain lines when stderr is not a terminal (bars when it is)."""

from __future__ import annotations

import argparse
import io
import json
import socket
from pathlib import Path

import grpc
import pytest

from stagediff.cli import build_parser, main
from stagediff.client import BytesReceived, Progress, Queued
from stagediff.progress import PlainProgress, RichProgress, progress_display
from stagediff.protocol import API_KEY_ENV, API_KEY_FILE_ENV
from stagediff.request import RequestOptions
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
            generation_pb2.Job(
                job_id="job-video",
                state=generation_pb2.JOB_STATE_SUCCEEDED,
                num_frames_out=9,
                media_type="video/mp4",
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
        if request.prompt == VIDEO_PROMPT and request.output_format == "png":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "output_format: png holds one image and this request makes 9 frames; use mp4, webm or gif for a video",
            )
        for event in self._events():
            yield event

    async def Submit(self, request, context):
        self._record(request, context)
        return generation_pb2.Job(job_id="job-submitted", state=generation_pb2.JOB_STATE_QUEUED)

    def _job(self, job_id: str) -> generation_pb2.Job | None:
        return next((job for job in self.jobs if job.job_id == job_id), None)

    async def GetJob(self, request, context):
        self._record(request, context)
        job = self._job(request.job_id)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job '{request.job_id}'")
        return job

    async def CancelJob(self, request, context):
        self._record(request, context)
        job = self._job(request.job_id)
        if job is not None and job.state == generation_pb2.JOB_STATE_SUCCEEDED:
            return job  # a finished job is left as it is
        return generation_pb2.Job(job_id=request.job_id, state=generation_pb2.JOB_STATE_CANCELLED)

    async def DeleteJob(self, request, context):
        """Deletes the finished jobs; knows no other, as the orchestrator answers for one already deleted."""
        self._record(request, context)
        if request.job_id not in ("job-done", "job-video"):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no job '{request.job_id}'")
        return generation_pb2.DeleteJobResponse(job_id=request.job_id, deleted=True)


# Generate refuses a png for this prompt, as the orchestrator does for a video model's default frames.
VIDEO_PROMPT = "a fox running"


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
    assert lines[2].split() == ["job-done", "succeeded", "100%", "1", "frame", "image/png"]
    assert lines[3].split() == ["job-video", "succeeded", "100%", "9", "frames", "video/mp4"]
    assert run(server, "jobs", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [job["job_id"] for job in listed] == ["job-running", "job-done", "job-video"]
    assert server.servicer.requests[-1].state == generation_pb2.JOB_STATE_UNSPECIFIED


def test_jobs_refuses_an_unknown_state(server, capsys) -> None:
    with pytest.raises(SystemExit):
        run(server, "jobs", "--state", "lost")
    assert "invalid choice: 'lost'" in capsys.readouterr().err


def test_wait_follows_a_running_job_event_by_event(server, capsys, tmp_path: Path) -> None:
    out = tmp_path / "done.png"
    assert run(server, "wait", "job-running", "--out", str(out)) == 0
    assert server.servicer.requests[-1].job_id == "job-running"
    assert out.read_bytes() == png_bytes()
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["job_id"] == "j" and summary["seed"] == 42 and summary["out"] == str(out)
    assert summary["media_type"] == "image/png" and summary["bytes"] == len(png_bytes())
    # stderr is not a terminal here: one plain line per event.
    assert captured.err.splitlines()[:2] == ["queued job j at position 0", "dit: 1/2"]
    assert "received bytes 0.." in captured.err


def test_wait_on_a_finished_job_prints_its_result_once_without_replaying_its_events(
    server, capsys, tmp_path: Path
) -> None:
    out = tmp_path / "done.png"
    assert run(server, "wait", "job-done", "--out", str(out)) == 0
    assert out.read_bytes() == png_bytes()
    captured = capsys.readouterr()
    assert json.loads(captured.out)["out"] == str(out) and captured.err == ""


def test_wait_on_an_unknown_job_is_one_error_line(server, capsys, tmp_path: Path) -> None:
    assert run(server, "wait", "job-lost", "--out", str(tmp_path / "lost.png")) == 1
    assert capsys.readouterr().err == "error: NOT_FOUND: no job 'job-lost'\n"


def test_cancel_and_delete(server, capsys) -> None:
    assert run(server, "cancel", "job-running") == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"job_id": "job-running", "state": "JOB_STATE_CANCELLED"}
    assert captured.err == ""
    assert run(server, "delete", "job-done") == 0
    assert json.loads(capsys.readouterr().out) == {"job_id": "job-done", "deleted": True}
    assert run(server, "delete", "job-gone") == 0  # the server knows it no more
    assert json.loads(capsys.readouterr().out) == {"job_id": "job-gone", "deleted": False}


def test_cancelling_a_finished_job_says_so_and_exits_1(server, capsys) -> None:
    assert run(server, "cancel", "job-done") == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["state"] == "JOB_STATE_SUCCEEDED"
    assert captured.err == "job job-done had already succeeded: nothing to cancel\n"


def test_generate_and_submit_take_the_sdk_names_and_the_old_ones(server, capsys, tmp_path: Path) -> None:
    names = ("--num-frames", "9", "--num-inference-steps", "4", "--guidance-scale", "2.5", "--output-quality", "70")
    old_names = ("--frames", "9", "--steps", "4", "--guidance", "2.5", "--quality", "70")
    for flags in (names, old_names):
        assert run(server, "generate", "--prompt", "a fox", "--quiet", *flags, "--out", str(tmp_path / "f.mp4")) == 0
        request = server.servicer.requests[-1]
        assert (request.num_frames, request.num_inference_steps, request.guidance_scale) == (9, 4, 2.5)
        assert (request.output_format, request.output_quality) == ("mp4", 70)
    assert run(server, "submit", "--prompt", "a fox", *names, "--output-format", "webm", "--seed", "3") == 0
    request = server.servicer.requests[-1]
    assert (request.num_frames, request.seed, request.output_format, request.output_quality) == (9, 3, "webm", 70)
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1] == "job-submitted"
    assert "stagediff wait job-submitted --out FILE" in captured.err


def test_every_request_keyword_but_the_request_id_has_a_flag_of_its_name() -> None:
    options = {action.dest for action in _command_parser("generate")._actions}
    assert set(RequestOptions.__annotations__) - {"request_id"} <= options


def _command_parser(name: str) -> argparse.ArgumentParser:
    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    return commands.choices[name]


@pytest.mark.parametrize("typo", ["--numframes", "--num_frames", "--guidence-scale"])
def test_a_misspelt_flag_is_refused_by_its_command_with_the_closest_flag(typo: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--prompt", "a fox", "--out", "x.mp4", typo, "9"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: stagediff generate ")
    expected = "--guidance-scale" if "guid" in typo else "--num-frames"
    assert f"stagediff generate: error: unrecognized arguments: {typo} 9 (did you mean {expected}?)" in err


def test_generate_help_describes_every_option_with_its_default_and_shows_examples(capsys) -> None:
    parser = _command_parser("generate")
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        takes_a_value = action.nargs != 0 and not action.required
        assert not takes_a_value or "default" in action.help, f"{action.option_strings}: no default in its help"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    shown = capsys.readouterr().out
    assert "Generates a video or an image through a StageDiff cluster" in shown
    assert shown.count("\n  stagediff generate --") == 2 and "examples:" in shown


def test_a_missing_out_directory_is_refused_before_the_job(server, capsys, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    assert run(server, "generate", "--prompt", "a fox", "--out", str(missing / "fox.mp4")) == 2
    assert f"--out {missing / 'fox.mp4'}: the directory {missing} does not exist" in capsys.readouterr().err
    assert run(server, "wait", "job-done", "--out", str(missing / "fox.png")) == 2
    assert f"the directory {missing} does not exist" in capsys.readouterr().err
    assert server.servicer.requests == [] and not missing.exists()


def test_an_image_from_a_video_model_is_refused_saying_num_frames_1_makes_one(server, capsys, tmp_path: Path) -> None:
    assert run(server, "generate", "--prompt", VIDEO_PROMPT, "--out", str(tmp_path / "tri.png")) == 1
    err = capsys.readouterr().err
    assert "output_format: png holds one image and this request makes 9 frames" in err
    assert err.rstrip().endswith("or add --num-frames 1 for a single png image")


def test_connection_failures_are_one_line_naming_the_endpoint(capsys, tmp_path: Path) -> None:
    with socket.socket() as bound:  # bound, not listening: refused
        bound.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{bound.getsockname()[1]}"
        assert main(["jobs", "--endpoint", endpoint]) == 1
        out = ("--out", str(tmp_path / "x.mp4"))
        assert main(["generate", "--endpoint", endpoint, "--retries", "0", "--prompt", "a fox", *out]) == 1
    for err in capsys.readouterr().err.splitlines():
        assert err == (
            f"error: UNAVAILABLE: nothing answers at {endpoint}: start a cluster with `stagediff up --model DIR`, "
            "or check --endpoint (default localhost:50051)"
        )
    assert main(["models", "--endpoint", "http://localhost:50051"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "a gRPC endpoint is HOST:PORT, not a URL; try localhost:50051." in err


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
    err = capsys.readouterr().err
    assert "--output-format mp4: a .webm file is written as the server encodes it; use --output-format webm" in err
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
            BytesReceived("j", 0, 1000),
            BytesReceived("j", 1000, 2608),
        ):
            display(event)
    drawn = terminal.getvalue()
    assert "queued job j at position 0" in drawn and "dit" in drawn and "4/4" in drawn
    # The result's bar counts its size in bytes' units, not "0.0 MB ... 3608/?".
    assert "3.6 kB" in drawn and "/?" not in drawn and "MB" not in drawn
