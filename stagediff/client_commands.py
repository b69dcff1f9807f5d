"""The client commands: generate, submit, wait, jobs, cancel, delete, models, health, info, each a function of the
parsed flags that returns the exit code (0 done, 1 the call or the job failed, 2 a bad argument, 130 a job
cancelled by Ctrl-C).

Every command connects with the same flags (endpoint, API key, TLS); while it waits for a job its progress goes
to stderr (stagediff/progress.py) and its result to stdout as JSON. Ctrl-C while it waits cancels the job (a
second Ctrl-C does not stop the cancel) and prints one line, `cancelled job ID`. An --out file goes into a
directory that exists: a missing one is refused before the job starts, since it is more often a typo than a wish.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TypeVar, cast

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from stagediff.async_client import CANCEL_TIMEOUT_S
from stagediff.client import Client, Event, GenerationResult, InvalidArgument, Notice, RetryPolicy, StageDiffError
from stagediff.interrupts import interrupts_ignored
from stagediff.media import SUPPORTED_EXTENSIONS
from stagediff.progress import PlainProgress, RichProgress, progress_display
from stagediff.protocol import FORMAT_OF_EXTENSION, INTERRUPTED, JOB_STATE_NAMES, OUTPUT_FORMATS
from stagediff.request import RequestOptions
from stagediff.v1 import generation_pb2, stages_pb2

# `stagediff jobs --state` names and the JobState each stands for.
JOB_STATES = {name: generation_pb2.JobState.Value(f"JOB_STATE_{name.upper()}") for name in JOB_STATE_NAMES}
# The RequestOptions keywords the request flags set, each the parsed name of its flag: all but request_id, the
# SDK's own (the images are read from their files, and generate derives output_format from --out).
REQUEST_FLAG_NAMES = tuple(name for name in RequestOptions.__annotations__ if name != "request_id")

# The states a job ends in; a finished job is neither cancelled again nor followed event by event.
FINISHED_STATES = frozenset(
    (generation_pb2.JOB_STATE_SUCCEEDED, generation_pb2.JOB_STATE_FAILED, generation_pb2.JOB_STATE_CANCELLED)
)


def _retries(args: argparse.Namespace) -> int:
    """--retries, or its default: more with several orchestrator addresses, to ride out a takeover."""
    if args.retries is not None:
        return int(args.retries)
    return 6 if "," in args.endpoint else 3


def _open_client(args: argparse.Namespace, attempts: int = 1) -> Client:
    """A client from the connection flags every command shares; `attempts` tries when the cluster is unavailable.
    Raises ValueError when the API key file cannot be read."""
    return Client(
        args.endpoint,
        retry=RetryPolicy(max_attempts=attempts),
        api_key=args.api_key,
        api_key_file=args.api_key_file,
        tls=args.tls,
        ca_cert=args.ca_cert,
        client_cert=args.client_cert,
        client_key=args.client_key,
    )


def _check_out(out: Path) -> None:
    """Raises ValueError when --out names a file in a directory that does not exist: a typo, usually; refused
    before the job runs rather than created."""
    if not out.parent.is_dir():
        raise ValueError(
            f"--out {out}: the directory {out.parent} does not exist; create it first (mkdir -p {out.parent})"
        )


def _output_format(out: Path, chosen: str | None) -> str:
    """The output format to ask the server for: --format, else the one --out's extension names. Raises ValueError
    when --out cannot hold the result."""
    extension = out.suffix.lower()
    if extension not in FORMAT_OF_EXTENSION:
        raise ValueError(f"--out {out}: the extension must be one of {', '.join(FORMAT_OF_EXTENSION)}")
    _check_out(out)
    output_format = chosen or FORMAT_OF_EXTENSION[extension]
    # .mp4, .png and .npz are written from frames as well; the other files only as the server encoded them.
    if extension not in SUPPORTED_EXTENSIONS and output_format != FORMAT_OF_EXTENSION[extension]:
        raise ValueError(
            f"--output-format {output_format}: a {extension} file is written as the server encodes it; "
            f"use --output-format {FORMAT_OF_EXTENSION[extension]} or leave it out"
        )
    return output_format


def _summary(result: GenerationResult, out: Path | None, started: float) -> dict:
    """The JSON a command prints for a finished job."""
    summary: dict = {"job_id": result.job_id, "seed": result.seed}
    if out is not None:
        summary["out"] = str(out)
    summary["frames"] = result.num_frames
    if result.data is None:
        summary["height"] = int(result.frames.shape[1])
        summary["width"] = int(result.frames.shape[2])
    else:
        summary["media_type"] = result.media_type
        summary["bytes"] = len(result.data)
    summary["fps"] = result.fps
    summary["timings"] = result.timings
    summary["transformer_passes"] = {"run": result.passes_run, "skipped": result.passes_skipped}
    if result.notices:
        summary["notices"] = [dataclasses.asdict(notice) for notice in result.notices]
    summary["wall_seconds"] = round(time.perf_counter() - started, 3)
    return summary


class _JobFollower:
    """The on_progress of a followed job: shows each event on the display (if any) and remembers the job's id,
    which Ctrl-C cancels."""

    def __init__(self, job_id: str, display: PlainProgress | RichProgress | None) -> None:
        self.job_id = job_id
        self.display = display

    def __call__(self, event: Event) -> None:
        self.job_id = self.job_id or event.job_id
        if self.display is not None:
            self.display(event)


def _follow_job(
    args: argparse.Namespace,
    run: Callable[[Client, Callable[[Event], None]], GenerationResult],
    job_id: str = "",
) -> GenerationResult | int:
    """Runs `run(client, on_progress)` with the progress display; returns the result, or the exit code on failure.
    Ctrl-C cancels the job (`job_id`, or the one the events name) and returns INTERRUPTED."""
    display = progress_display(args.quiet)
    follower = _JobFollower(job_id, display)
    try:
        with _open_client(args, attempts=_retries(args) + 1) as client:
            try:
                if display is None:
                    return run(client, follower)
                with display:
                    return run(client, follower)
            except KeyboardInterrupt:
                return _cancel_interrupted(client, follower.job_id)
    except StageDiffError as error:
        print(f"error: {error}{_hint(error, args)}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def print_notices(notices: Iterable[Notice | stages_pb2.Notice]) -> None:
    """Each change made to the request that its caller did not ask for (a truncated prompt), as a `note:` line on
    stderr: a result's notices, or a job's."""
    for notice in notices:
        print(f"note: {notice.message}", file=sys.stderr)


def _cancel_interrupted(client: Client, job_id: str) -> int:
    """After Ctrl-C: cancels the job, with further Ctrl-C ignored until the cancel is answered (within
    CANCEL_TIMEOUT_S), and says in one line what became of it."""
    if not job_id:
        print("interrupted before the cluster named the job", file=sys.stderr)
        return INTERRUPTED
    with interrupts_ignored():
        try:
            job = client.cancel(job_id, timeout=CANCEL_TIMEOUT_S)
        except StageDiffError as error:
            print(f"interrupted; cancelling job {job_id} failed: {error}", file=sys.stderr)
            return INTERRUPTED
    print(_finished_note(job) or f"cancelled job {job_id}", file=sys.stderr)
    return INTERRUPTED


def _state_name(job: generation_pb2.Job) -> str:
    """The job's state as the commands name it: queued, running, succeeded, failed, cancelled."""
    return generation_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()


def _finished_note(job: generation_pb2.Job) -> str | None:
    """What a cancel answered with a job that had succeeded or failed before it says; None if it was cancelled."""
    if job.state in (generation_pb2.JOB_STATE_SUCCEEDED, generation_pb2.JOB_STATE_FAILED):
        return f"job {job.job_id} had already {_state_name(job)}: nothing to cancel"
    return None


def _hint(error: StageDiffError, args: argparse.Namespace) -> str:
    """What the command's flags can do about a refusal the server words in the API's terms: an image format
    refused for a video's frames."""
    output_format = getattr(args, "output_format", None) or ""
    image = OUTPUT_FORMATS.get(output_format, "").startswith("image/")
    if isinstance(error, InvalidArgument) and error.field == "output_format" and image:
        return f"; or add --num-frames 1 for a single {output_format} image"
    return ""


def _save(result: GenerationResult, out: Path | None, started: float) -> int:
    print_notices(result.notices)
    try:
        path = result.save(out) if out is not None else None
        # A file written from the raw frames (.npz, .png) holds no sound: the waveform goes beside it as a .wav.
        sound = None
        if path is not None and result.audio is not None and (result.data is None or path.suffix.lower() == ".npz"):
            sound = result.save_audio(path.with_suffix(".wav"))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = _summary(result, path, started)
    if result.audio is not None:
        summary["audio"] = {
            "sample_rate": result.audio_sample_rate,
            "channels": int(result.audio.shape[0]),
            "samples": int(result.audio.shape[1]),
        }
        if sound is not None:
            summary["audio_out"] = str(sound)
    print(json.dumps(summary))
    return 0


def _request_options(args: argparse.Namespace) -> RequestOptions:
    """The request the flags ask for: each request flag's parsed name is its RequestOptions keyword. Raises
    ValueError naming an input image flag whose file does not exist."""
    for flag, path in (("--image", args.image), ("--last-image", args.last_image)) + tuple(
        ("--reference-image", path) for path in args.reference_images
    ):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    return cast(RequestOptions, {name: getattr(args, name) for name in REQUEST_FLAG_NAMES})


def generate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        args.output_format = _output_format(out, args.output_format)
        options = _request_options(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = _follow_job(
        args,
        lambda client, on_progress: client.generate(
            args.prompt, timeout=args.timeout, on_progress=on_progress, **options
        ),
    )
    if isinstance(result, int):
        return result
    return _save(result, out, started)


def submit(args: argparse.Namespace) -> int:
    """Queues the job and prints its id alone on stdout (for `JOB=$(stagediff submit ...)`)."""
    try:
        options = _request_options(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    job = _ask(args, lambda client: client.submit(args.prompt, **options))
    if isinstance(job, int):
        return job
    print(job.job_id)
    print(f"queued job {job.job_id}: `stagediff wait {job.job_id} --out FILE` follows it", file=sys.stderr)
    return 0


def wait(args: argparse.Namespace) -> int:
    out = None if args.out is None else Path(args.out)
    if out is not None:
        try:
            _output_format(out, None)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    result = _follow_job(args, lambda client, on_progress: _wait(client, args, on_progress), job_id=args.job_id)
    if isinstance(result, int):
        return result
    return _save(result, out, started)


def _wait(client: Client, args: argparse.Namespace, on_progress: Callable[[Event], None]) -> GenerationResult:
    """The job's result; its progress shown while it runs. A finished job's events would replay from its start:
    its result (or its error) comes alone."""
    if client.get_job(args.job_id).state in FINISHED_STATES:
        return client.wait(args.job_id, timeout=args.timeout)
    return client.wait(args.job_id, on_progress=on_progress, timeout=args.timeout)


def health(args: argparse.Namespace) -> int:
    try:
        with _open_client(args) as client:
            status = client.health(args.service)
    except StageDiffError as error:
        print(f"UNREACHABLE {error}")
        return 1
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(status)
    return 0 if status == "SERVING" else 1


_Answer = TypeVar("_Answer")


def _ask(args: argparse.Namespace, call: Callable[[Client], _Answer]) -> _Answer | int:
    """What `call(client)` answers, or the exit code after printing why it failed."""
    try:
        with _open_client(args) as client:
            return call(client)
    except StageDiffError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _as_json(message_or_list: Message | Sequence[Message]) -> object:
    if isinstance(message_or_list, Message):
        return MessageToDict(message_or_list, preserving_proto_field_name=True)
    return [MessageToDict(message, preserving_proto_field_name=True) for message in message_or_list]


def _print_answer(args: argparse.Namespace, call: Callable[[Client], Message | Sequence[Message]]) -> int:
    """Prints what `call(client)` answers as JSON (a message, or a list of them)."""
    answer = _ask(args, call)
    if isinstance(answer, int):
        return answer
    print(json.dumps(_as_json(answer), indent=2))
    return 0


def models(args: argparse.Namespace) -> int:
    """The models the cluster serves, with their limits and the LoRA adapters the caller's tenant may use."""
    return _print_answer(args, Client.list_models)


def info(args: argparse.Namespace) -> int:
    return _print_answer(args, Client.cluster_info)


def cancel(args: argparse.Namespace) -> int:
    """Prints the job as JSON; a job that had already succeeded or failed gets a note on stderr and exit code 1
    (nothing was cancelled)."""
    job = _ask(args, lambda client: client.cancel(args.job_id))
    if isinstance(job, int):
        return job
    print(json.dumps(_as_json(job), indent=2))
    note = _finished_note(job)
    if note is None:
        return 0
    print(note, file=sys.stderr)
    return 1


def delete(args: argparse.Namespace) -> int:
    deleted = _ask(args, lambda client: client.delete(args.job_id))
    if not isinstance(deleted, bool):  # the exit code of a failed call
        return deleted
    print(json.dumps({"job_id": args.job_id, "deleted": deleted}))
    return 0


def _job_row(job: generation_pb2.Job) -> tuple[str, ...]:
    """A job as `stagediff jobs` lists it: id, state, created, progress, and what is going on."""
    state = _state_name(job)
    created = _local_time(job) if job.HasField("created_at") else ""
    if job.state == generation_pb2.JOB_STATE_QUEUED:
        detail = f"position {job.queue_position}"
    elif job.state == generation_pb2.JOB_STATE_RUNNING:
        detail = job.current_stage
    elif job.state == generation_pb2.JOB_STATE_SUCCEEDED:
        frames = "frame" if job.num_frames_out == 1 else "frames"
        detail = f"{job.num_frames_out} {frames} {job.media_type}".strip()
    else:
        detail = job.error.message
    return job.job_id, state, created, f"{job.progress_percent:.0f}%", detail


def _local_time(job: generation_pb2.Job) -> str:
    """When the job was created, in this machine's time zone."""
    return datetime.fromtimestamp(job.created_at.ToSeconds()).strftime("%Y-%m-%d %H:%M:%S")


def jobs(args: argparse.Namespace) -> int:
    state = JOB_STATES[args.state] if args.state else generation_pb2.JOB_STATE_UNSPECIFIED
    jobs = _ask(args, lambda client: client.list_jobs(state, args.limit))
    if isinstance(jobs, int):
        return jobs
    if args.json:
        print(json.dumps(_as_json(jobs), indent=2))
        return 0
    rows = [("JOB ID", "STATE", "CREATED", "DONE", "DETAIL"), *(_job_row(job) for job in jobs)]
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    for row in rows:
        print("  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[4]]).rstrip())
    return 0
