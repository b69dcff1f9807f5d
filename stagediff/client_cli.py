"""Client commands of the CLI: generate, models, health, info."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from google.protobuf.json_format import MessageToDict

from stagediff.client import Client, FramesReceived, Progress, Queued, RetryPolicy, StageDiffError

OUTPUT_SUFFIXES = (".mp4", ".png", ".npz")


def _print_event(event: object) -> None:
    if isinstance(event, Queued):
        print(f"queued job {event.job_id} at position {event.position}", file=sys.stderr)
    elif isinstance(event, Progress):
        print(f"{event.stage}: {event.step}/{event.total}", file=sys.stderr)
    elif isinstance(event, FramesReceived):
        print(f"received frames {event.first_frame}..{event.first_frame + event.count - 1}", file=sys.stderr)


def _lora_argument(value: str) -> tuple[str, float]:
    """--lora NAME[:SCALE] as (name, scale). A name holds no ':' (ModelLimits.loras lists them)."""
    name, colon, scale = value.partition(":")
    try:
        return name, float(scale) if colon else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}': expected NAME or NAME:SCALE, SCALE a number") from None


def _connection(args: argparse.Namespace) -> dict:
    """Client options from the connection flags every command shares."""
    return {
        "api_key": args.api_key,
        "tls": args.tls,
        "ca_cert": args.ca_cert,
        "client_cert": args.client_cert,
        "client_key": args.client_key,
    }


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="localhost:50051")
    parser.add_argument("--api-key", default=None, help="the tenant's API key (default: $STAGEDIFF_API_KEY)")
    parser.add_argument("--tls", action="store_true", help="connect with TLS (system roots unless --ca-cert)")
    parser.add_argument("--ca-cert", default=None, help="CA certificate (PEM) to verify the server with; implies --tls")
    parser.add_argument(
        "--client-cert", default=None, help="client certificate (PEM) for a server that requires one (mutual TLS)"
    )
    parser.add_argument("--client-key", default=None, help="private key (PEM) of --client-cert")


def _generate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix not in OUTPUT_SUFFIXES:
        print(f"error: --out {out}: use one of {', '.join(OUTPUT_SUFFIXES)}", file=sys.stderr)
        return 2
    for flag, path in (("--image", args.image), ("--last-image", args.last_image)) + tuple(
        ("--reference-image", path) for path in args.reference_image
    ):
        if path is not None and not Path(path).is_file():
            print(f"error: {flag} {path}: no such file", file=sys.stderr)
            return 2
    started = time.perf_counter()
    try:
        with Client(args.endpoint, retry=RetryPolicy(max_attempts=args.retries + 1), **_connection(args)) as client:
            result = client.generate(
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
                timeout=args.timeout,
                on_progress=None if args.quiet else _print_event,
            )
    except StageDiffError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    path = result.save(out)
    summary = {
        "job_id": result.job_id,
        "out": str(path),
        "frames": int(result.frames.shape[0]),
        "height": int(result.frames.shape[1]),
        "width": int(result.frames.shape[2]),
        "fps": result.fps,
        "timings": result.timings,
        "transformer_passes": {"run": result.passes_run, "skipped": result.passes_skipped},
        "wall_seconds": round(time.perf_counter() - started, 3),
    }
    print(json.dumps(summary))
    return 0


def _health(args: argparse.Namespace) -> int:
    try:
        with Client(args.endpoint, retry=RetryPolicy(max_attempts=1), **_connection(args)) as client:
            status = client.health(args.service)
    except StageDiffError as error:
        print(f"UNREACHABLE {error}")
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def _print_answer(args: argparse.Namespace, call: Callable[[Client], object]) -> int:
    """Prints what `call(client)` answers as JSON (a message, or a list of them)."""
    try:
        with Client(args.endpoint, retry=RetryPolicy(max_attempts=1), **_connection(args)) as client:
            answer = call(client)
    except StageDiffError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    messages = answer if isinstance(answer, list) else [answer]
    as_json = [MessageToDict(message, preserving_proto_field_name=True) for message in messages]
    print(json.dumps(as_json if isinstance(answer, list) else as_json[0], indent=2))
    return 0


def _models(args: argparse.Namespace) -> int:
    """The models the cluster serves, with their limits and the LoRA adapters the caller's tenant may use."""
    return _print_answer(args, Client.list_models)


def _info(args: argparse.Namespace) -> int:
    return _print_answer(args, Client.cluster_info)


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
    generate.add_argument("--seed", type=int)
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
    generate.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    generate.add_argument("--retries", type=int, default=3, help="retries when the cluster is unavailable")
    generate.add_argument("--quiet", action="store_true", help="no progress on stderr")
    generate.add_argument("--out", required=True, help="output file: .mp4, .png or .npz")
    generate.set_defaults(func=_generate)

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
