"""Client commands of the CLI: generate, wait, jobs, cancel, delete, models, health, info.

Every command connects with the same flags (endpoint, API key, TLS). The API key is read, in order, from
--api-key, --api-key-file, $STAGEDIFF_API_KEY, the file $STAGEDIFF_API_KEY_FILE names, and
~/.config/stagediff/api-key when it exists: a key in the environment or a file stays out of `ps`.

While a command waits for a job, its progress goes to stderr: a bar per stage with its ETA when stderr is a
terminal, one plain line per event otherwise (a log, a pipe). Its result goes to stdout as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TextIO

from google.protobuf.json_format import MessageToDict

from stagediff.client import (
    BytesReceived,
    Client,
    Event,
    FramesReceived,
    GenerationResult,
    Progress,
    Queued,
    RetryPolicy,
    StageDiffError,
)
from stagediff.media import MEDIA_TYPE_EXTENSIONS, SUPPORTED_EXTENSIONS
from stagediff.protocol import API_KEY_ENV, API_KEY_FILE_ENV, DEFAULT_API_KEY_FILE, OUTPUT_FORMATS, RAW_OUTPUT_FORMAT
from stagediff.v1 import generation_pb2

# The output format each --out extension asks the server for when --format is not given: the server encodes the
# file (.npz: raw frames, written here).
FORMAT_OF_EXTENSION = {
    extension: name
    for name, media_type in OUTPUT_FORMATS.items()
    for extension in MEDIA_TYPE_EXTENSIONS.get(media_type, ())
} | {".npz": RAW_OUTPUT_FORMAT}

# `stagediff jobs --state` names and the JobState each stands for.
JOB_STATES = {
    "queued": generation_pb2.JOB_STATE_QUEUED,
    "running": generation_pb2.JOB_STATE_RUNNING,
    "succeeded": generation_pb2.JOB_STATE_SUCCEEDED,
    "failed": generation_pb2.JOB_STATE_FAILED,
    "cancelled": generation_pb2.JOB_STATE_CANCELLED,
}


class PlainProgress:
    """Progress as one line per event on `stream`: for a log or a pipe."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing to close: each line is written as its event arrives."""

    def __call__(self, event: Event) -> None:
        if isinstance(event, Queued):
            line = f"queued job {event.job_id} at position {event.position}"
        elif isinstance(event, Progress):
            line = f"{event.stage}: {event.step}/{event.total}"
        elif isinstance(event, FramesReceived):
            line = f"received frames {event.first_frame}..{event.first_frame + event.count - 1}"
        elif isinstance(event, BytesReceived):
            line = f"received bytes {event.offset}..{event.offset + event.count - 1}"
        else:
            return
        print(line, file=self.stream, flush=True)


class RichProgress:
    """Progress on a terminal: a bar per stage with its steps, elapsed time and ETA, and the result's download."""

    def __init__(self, stream: TextIO) -> None:
        # Imported here: the other commands start without loading rich.
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bars

        self.bars = Bars(
            TextColumn("{task.description:<14}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(file=stream),
        )
        self.tasks: dict[str, int] = {}
        self.received = 0

    def __enter__(self) -> RichProgress:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bars.stop()

    def __call__(self, event: Event) -> None:
        if isinstance(event, Queued):
            self.bars.console.print(f"queued job {event.job_id} at position {event.position}", highlight=False)
        elif isinstance(event, Progress):
            self._bar(event.stage, event.total)
            self.bars.update(self.tasks[event.stage], completed=event.step, total=event.total)
        elif isinstance(event, FramesReceived):
            self._bar("frames", None)
            self.bars.advance(self.tasks["frames"], event.count)
        elif isinstance(event, BytesReceived):
            self._bar("result", None)
            self.received = event.offset + event.count
            self.bars.update(
                self.tasks["result"], completed=self.received, description=f"result {self.received / 1e6:.1f} MB"
            )

    def _bar(self, name: str, total: int | None) -> None:
        if name not in self.tasks:
            self.tasks[name] = self.bars.add_task(name, total=total)


def progress_display(quiet: bool, stream: TextIO | None = None) -> PlainProgress | RichProgress | None:
    """What shows a job's progress on `stream` (stderr): bars on a terminal, plain lines otherwise; None if quiet."""
    stream = sys.stderr if stream is None else stream
    if quiet:
        return None
    return RichProgress(stream) if stream.isatty() else PlainProgress(stream)


def _lora_argument(value: str) -> tuple[str, float]:
    """--lora NAME[:SCALE] as (name, scale). A name holds no ':' (ModelLimits.loras lists them)."""
    name, colon, scale = value.partition(":")
    try:
        return name, float(scale) if colon else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}': expected NAME or NAME:SCALE, SCALE a number") from None


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


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="localhost:50051")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"the tenant's API key; other users of this machine can read it in `ps`: prefer ${API_KEY_ENV} or "
        "--api-key-file",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help=f"a file holding the API key (default: ${API_KEY_ENV} itself, else the file ${API_KEY_FILE_ENV} names, "
        f"else {DEFAULT_API_KEY_FILE} when it exists)",
    )
    parser.add_argument("--tls", action="store_true", help="connect with TLS (system roots unless --ca-cert)")
    parser.add_argument("--ca-cert", default=None, help="CA certificate (PEM) to verify the server with; implies --tls")
    parser.add_argument(
        "--client-cert", default=None, help="client certificate (PEM) for a server that requires one (mutual TLS)"
    )
    parser.add_argument("--client-key", default=None, help="private key (PEM) of --client-cert")


def _output_format(out: Path, chosen: str | None) -> str:
    """The output format to ask the server for: --format, else the one --out's extension names. Raises ValueError
    when --out cannot hold the result."""
    extension = out.suffix.lower()
    if extension not in FORMAT_OF_EXTENSION:
        raise ValueError(f"--out {out}: the extension must be one of {', '.join(FORMAT_OF_EXTENSION)}")
    output_format = chosen or FORMAT_OF_EXTENSION[extension]
    # .mp4, .png and .npz are written from frames as well; the other files only as the server encoded them.
    if extension not in SUPPORTED_EXTENSIONS and output_format != FORMAT_OF_EXTENSION[extension]:
        raise ValueError(
            f"--format {output_format}: a {extension} file is written as the server encodes it; "
            f"use --format {FORMAT_OF_EXTENSION[extension]} or leave --format out"
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
    summary["wall_seconds"] = round(time.perf_counter() - started, 3)
    return summary


def _follow_job(
    args: argparse.Namespace, run: Callable[[Client, Callable[[Event], None] | None], GenerationResult]
) -> GenerationResult | int:
    """Runs `run(client, on_progress)` with the progress display; returns the result, or the exit code on failure."""
    display = progress_display(args.quiet)
    try:
        with _open_client(args, attempts=args.retries + 1) as client:
            if display is None:
                return run(client, None)
            with display:
                return run(client, display)
    except StageDiffError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _save(result: GenerationResult, out: Path | None, started: float) -> int:
    try:
        path = result.save(out) if out is not None else None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(_summary(result, path, started)))
    return 0


def _generate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        output_format = _output_format(out, args.format)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for flag, path in (("--image", args.image), ("--last-image", args.last_image)) + tuple(
        ("--reference-image", path) for path in args.reference_image
    ):
        if path is not None and not Path(path).is_file():
            print(f"error: {flag} {path}: no such file", file=sys.stderr)
            return 2
    started = time.perf_counter()
    result = _follow_job(
        args,
        lambda client, on_progress: client.generate(
            args.prompt,
            model=args.model,
            negative_prompt=args.negative_prompt,
            height=args.height,
            width=args.width,
            num_frames=args.frames,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            seed=args.seed,
            fps=args.fps,
            interp_exp=args.interp_exp,
            interp_scale=args.interp_scale,
            interp_model_path=args.interp_model_path,
            image=args.image,
            last_image=args.last_image,
            reference_images=args.reference_image,
            cache=args.cache,
            cache_threshold=args.cache_threshold,
            loras=args.lora,
            output_format=output_format,
            output_quality=args.quality,
            keep_raw_frames=args.keep_raw_frames,
            timeout=args.timeout,
            on_progress=on_progress,
        ),
    )
    if isinstance(result, int):
        return result
    return _save(result, out, started)


def _wait(args: argparse.Namespace) -> int:
    out = None if args.out is None else Path(args.out)
    if out is not None and out.suffix.lower() not in FORMAT_OF_EXTENSION:
        print(f"error: --out {out}: the extension must be one of {', '.join(FORMAT_OF_EXTENSION)}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    result = _follow_job(
        args, lambda client, on_progress: client.wait(args.job_id, on_progress=on_progress, timeout=args.timeout)
    )
    if isinstance(result, int):
        return result
    return _save(result, out, started)


def _health(args: argparse.Namespace) -> int:
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


def _ask(args: argparse.Namespace, call: Callable[[Client], object]) -> object | int:
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


def _as_json(message_or_list: object) -> object:
    if isinstance(message_or_list, list):
        return [MessageToDict(message, preserving_proto_field_name=True) for message in message_or_list]
    return MessageToDict(message_or_list, preserving_proto_field_name=True)


def _print_answer(args: argparse.Namespace, call: Callable[[Client], object]) -> int:
    """Prints what `call(client)` answers as JSON (a message, or a list of them)."""
    answer = _ask(args, call)
    if isinstance(answer, int):
        return answer
    print(json.dumps(_as_json(answer), indent=2))
    return 0


def _models(args: argparse.Namespace) -> int:
    """The models the cluster serves, with their limits and the LoRA adapters the caller's tenant may use."""
    return _print_answer(args, Client.list_models)


def _info(args: argparse.Namespace) -> int:
    return _print_answer(args, Client.cluster_info)


def _cancel(args: argparse.Namespace) -> int:
    return _print_answer(args, lambda client: client.cancel(args.job_id))


def _delete(args: argparse.Namespace) -> int:
    deleted = _ask(args, lambda client: client.delete(args.job_id))
    if not isinstance(deleted, bool):  # the exit code of a failed call
        return deleted
    print(json.dumps({"job_id": args.job_id, "deleted": deleted}))
    return 0


def _job_row(job: generation_pb2.Job) -> tuple[str, ...]:
    """A job as `stagediff jobs` lists it: id, state, created, progress, and what is going on."""
    state = generation_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
    created = _local_time(job) if job.HasField("created_at") else ""
    if job.state == generation_pb2.JOB_STATE_QUEUED:
        detail = f"position {job.queue_position}"
    elif job.state == generation_pb2.JOB_STATE_RUNNING:
        detail = job.current_stage
    elif job.state == generation_pb2.JOB_STATE_SUCCEEDED:
        detail = f"{job.num_frames_out} frames {job.media_type}".strip()
    else:
        detail = job.error.message
    return job.job_id, state, created, f"{job.progress_percent:.0f}%", detail


def _local_time(job: generation_pb2.Job) -> str:
    """When the job was created, in this machine's time zone."""
    return datetime.fromtimestamp(job.created_at.ToSeconds()).strftime("%Y-%m-%d %H:%M:%S")


def _jobs(args: argparse.Namespace) -> int:
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


def _add_follow_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that waits for a job."""
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--retries", type=int, default=3, help="retries when the cluster is unavailable")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _non_negative(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"'{value}': expected a whole number >= 0")
    return number


def add_parsers(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="generate a video or image through a cluster")
    _add_connection_arguments(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--negative-prompt", default="")
    generate.add_argument("--model", default="", help="model id (default: the cluster's only model)")
    generate.add_argument("--height", type=int)
    generate.add_argument("--width", type=int)
    generate.add_argument(
        "--frames", type=int, help="number of frames (4k+1 for Wan; 1 for an image model such as qwen-image)"
    )
    generate.add_argument("--steps", type=int, help="denoising steps")
    generate.add_argument(
        "--guidance", type=float, help="CFG scale (true_cfg_scale for qwen-image); above 1 uses the negative prompt"
    )
    generate.add_argument("--seed", type=int, help="the noise's seed (default: the server picks one and reports it)")
    generate.add_argument("--fps", type=float)
    generate.add_argument(
        "--cache",
        default=None,
        help="the DiT's step cache: none, first_block, mag or teacache, as the model offers (default: the server's)",
    )
    generate.add_argument("--cache-threshold", type=float, default=None, help="its threshold; higher skips more")
    generate.add_argument(
        "--lora",
        action="append",
        default=[],
        type=_lora_argument,
        metavar="NAME[:SCALE]",
        help="a LoRA adapter the model lists (`stagediff models`), at SCALE (default 1); repeat for several",
    )
    generate.add_argument("--interp-exp", type=int, default=0, help="frame interpolation: 2**k x the frames' rate")
    generate.add_argument("--interp-scale", type=float, default=0.0, help="RIFE flow scale: 0.25 .. 4 (0: 1)")
    generate.add_argument("--interp-model-path", default="", help="RIFE weights the cluster must be serving")
    generate.add_argument(
        "--image", help="input image (PNG, JPEG, WebP): the first frame of image-to-video, the image to edit"
    )
    generate.add_argument("--last-image", help="the last frame, for a model that takes one")
    generate.add_argument(
        "--reference-image", action="append", default=[], help="a reference image (repeat for several)"
    )
    generate.add_argument(
        "--format",
        choices=tuple(OUTPUT_FORMATS),
        default=None,
        help="the result's format, encoded on the server (raw: frames); default: the one --out's extension names "
        "(.npz: raw)",
    )
    generate.add_argument(
        "--quality", type=int, default=None, help="1 (smallest) to 100 (best) for mp4, webm, jpeg and webp"
    )
    generate.add_argument(
        "--keep-raw-frames", action="store_true", help="with an encoded --format, also receive the raw frames"
    )
    _add_follow_arguments(generate)
    generate.add_argument("--out", required=True, help=f"output file: {', '.join(FORMAT_OF_EXTENSION)}")
    generate.set_defaults(func=_generate)

    wait = commands.add_parser("wait", help="follow a job to its end; print its summary, save its result")
    _add_connection_arguments(wait)
    wait.add_argument("job_id", metavar="JOB_ID")
    _add_follow_arguments(wait)
    wait.add_argument("--out", default=None, help=f"save the result: {', '.join(FORMAT_OF_EXTENSION)}")
    wait.set_defaults(func=_wait)

    jobs = commands.add_parser("jobs", help="list the tenant's jobs, newest first")
    _add_connection_arguments(jobs)
    jobs.add_argument("--state", choices=tuple(JOB_STATES), default=None, help="only the jobs in this state")
    jobs.add_argument("--limit", type=_non_negative, default=0, help="at most this many (0: the server's 100)")
    jobs.add_argument("--json", action="store_true", help="the jobs as JSON, every field")
    jobs.set_defaults(func=_jobs)

    cancel = commands.add_parser("cancel", help="cancel a queued or running job; print it as JSON")
    _add_connection_arguments(cancel)
    cancel.add_argument("job_id", metavar="JOB_ID")
    cancel.set_defaults(func=_cancel)

    delete = commands.add_parser("delete", help="cancel a job if it runs, then delete it and its result")
    _add_connection_arguments(delete)
    delete.add_argument("job_id", metavar="JOB_ID")
    delete.set_defaults(func=_delete)

    models = commands.add_parser("models", help="JSON list of the served models, their limits and LoRA adapters")
    _add_connection_arguments(models)
    models.set_defaults(func=_models)

    health = commands.add_parser("health", help="grpc.health.v1 status of any StageDiff service")
    _add_connection_arguments(health)
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.set_defaults(func=_health)

    info = commands.add_parser("info", help="JSON description of every stage of a cluster")
    _add_connection_arguments(info)
    info.set_defaults(func=_info)
