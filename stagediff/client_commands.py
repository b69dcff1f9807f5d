"""The client commands: generate, wait, jobs, cancel, delete, models, health, info, each a function of the parsed
flags that returns the exit code (0 done, 1 the call or the job failed, 2 a bad argument).

Every command connects with the same flags (endpoint, API key, TLS); while it waits for a job its progress goes
to stderr (stagediff/progress.py) and its result to stdout as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from stagediff.client import Client, Event, GenerationResult, RetryPolicy, StageDiffError
from stagediff.media import SUPPORTED_EXTENSIONS
from stagediff.progress import progress_display
from stagediff.protocol import FORMAT_OF_EXTENSION, JOB_STATE_NAMES
from stagediff.v1 import generation_pb2

# `stagediff jobs --state` names and the JobState each stands for.
JOB_STATES = {name: generation_pb2.JobState.Value(f"JOB_STATE_{name.upper()}") for name in JOB_STATE_NAMES}


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
        with _open_client(args, attempts=_retries(args) + 1) as client:
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


def generate(args: argparse.Namespace) -> int:
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


def wait(args: argparse.Namespace) -> int:
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
    return _print_answer(args, lambda client: client.cancel(args.job_id))


def delete(args: argparse.Namespace) -> int:
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
