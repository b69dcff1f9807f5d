"""The client commands' flags: generate, wait, jobs, cancel, delete, models, health, info.

Every command connects with the same flags (endpoint, API key, TLS). The API key is read, in order, from
--api-key, --api-key-file, $STAGEDIFF_API_KEY, the file $STAGEDIFF_API_KEY_FILE names, and
~/.config/stagediff/api-key when it exists: a key in the environment or a file stays out of `ps`.

The commands themselves are in client_commands.py, imported only when one runs: building the parsers (and so
`stagediff --help`) loads argparse and stagediff.protocol alone, not gRPC, numpy or PyAV. How the commands show
progress is in progress.py.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from stagediff.protocol import (
    API_KEY_ENV,
    API_KEY_FILE_ENV,
    DEFAULT_API_KEY_FILE,
    FORMAT_OF_EXTENSION,
    JOB_STATE_NAMES,
    OUTPUT_FORMATS,
)


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    """The command `name` of client_commands.py, imported when it runs."""

    def run(args: argparse.Namespace) -> int:
        commands = importlib.import_module("stagediff.client_commands")
        command: Callable[[argparse.Namespace], int] = getattr(commands, name)
        return command(args)

    return run


def _lora_argument(value: str) -> tuple[str, float]:
    """--lora NAME[:SCALE] as (name, scale). A name holds no ':' (ModelLimits.loras lists them)."""
    name, colon, scale = value.partition(":")
    try:
        return name, float(scale) if colon else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}': expected NAME or NAME:SCALE, SCALE a number") from None


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        default="localhost:50051",
        help="the orchestrator's HOST:PORT, or its replicas' separated by commas (the next is tried when one is "
        "unavailable; default: %(default)s)",
    )
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


def _add_follow_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that waits for a job."""
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument(
        "--retries",
        type=int,
        default=None,
        help="retries when the cluster is unavailable (default: 3, over about 3.5 s; with several --endpoint "
        "addresses 6, over about 15 s: enough for a takeover between orchestrator replicas)",
    )
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
    generate.set_defaults(func=_command("generate"))

    wait = commands.add_parser("wait", help="follow a job to its end; print its summary, save its result")
    _add_connection_arguments(wait)
    wait.add_argument("job_id", metavar="JOB_ID")
    _add_follow_arguments(wait)
    wait.add_argument("--out", default=None, help=f"save the result: {', '.join(FORMAT_OF_EXTENSION)}")
    wait.set_defaults(func=_command("wait"))

    jobs = commands.add_parser("jobs", help="list the tenant's jobs, newest first")
    _add_connection_arguments(jobs)
    jobs.add_argument("--state", choices=JOB_STATE_NAMES, default=None, help="only the jobs in this state")
    jobs.add_argument("--limit", type=_non_negative, default=0, help="at most this many (0: the server's 100)")
    jobs.add_argument("--json", action="store_true", help="the jobs as JSON, every field")
    jobs.set_defaults(func=_command("jobs"))

    cancel = commands.add_parser("cancel", help="cancel a queued or running job; print it as JSON")
    _add_connection_arguments(cancel)
    cancel.add_argument("job_id", metavar="JOB_ID")
    cancel.set_defaults(func=_command("cancel"))

    delete = commands.add_parser("delete", help="cancel a job if it runs, then delete it and its result")
    _add_connection_arguments(delete)
    delete.add_argument("job_id", metavar="JOB_ID")
    delete.set_defaults(func=_command("delete"))

    models = commands.add_parser("models", help="JSON list of the served models, their limits and LoRA adapters")
    _add_connection_arguments(models)
    models.set_defaults(func=_command("models"))

    health = commands.add_parser("health", help="grpc.health.v1 status of any StageDiff service")
    _add_connection_arguments(health)
    health.add_argument("--service", default="", help="service name (default: the whole server)")
    health.set_defaults(func=_command("health"))

    info = commands.add_parser("info", help="JSON description of every stage of a cluster")
    _add_connection_arguments(info)
    info.set_defaults(func=_command("info"))
