"""The client commands' flags: generate, submit, wait, jobs, cancel, delete, models, health, info.

Every command connects with the same flags (endpoint, API key, TLS). The API key is read, in order, from
--api-key, --api-key-file, $STAGEDIFF_API_KEY, the file $STAGEDIFF_API_KEY_FILE names, and
~/.config/stagediff/api-key when it exists: a key in the environment or a file stays out of `ps`.

The request flags of generate and submit speak the SDK's and the HTTP API's vocabulary: each is a RequestOptions
keyword with dashes (`--num-frames` is `num_frames`, and its parsed name), and the older short names
(`--frames`, `--steps`, `--guidance`, `--format`, `--quality`) stay as aliases. Every command's parser is a
`CommandParser`: a flag it does not know is refused with its own usage and the closest flag it has.

The commands themselves are in client_commands.py, imported only when one runs: building the parsers (and so
`stagediff --help`) loads argparse and stagediff.protocol alone, not gRPC, numpy or PyAV. How the commands show
progress is in progress.py.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
from collections.abc import Callable, Sequence

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


class CommandParser(argparse.ArgumentParser):
    """A command's parser: a flag it does not know is refused here, with this command's usage and the closest
    flag it has (argparse would hand it to the top-level parser, whose usage and error name no command)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggestions(extras)}")
        return parsed, extras

    def _suggestions(self, extras: list[str]) -> str:
        """`(did you mean --num-frames?)` for each unknown flag with a close match among this command's flags."""
        flags = [flag for action in self._actions for flag in action.option_strings]
        hints: list[str] = []
        for extra in extras:
            if extra.startswith("-"):
                close = difflib.get_close_matches(extra.partition("=")[0], flags, n=1)
                hints.extend(f"did you mean {match}?" for match in close)
        return f" ({'; '.join(hints)})" if hints else ""


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        default="localhost:50051",
        help="the orchestrator's gRPC HOST:PORT (not the HTTP gateway's URL), or its replicas' separated by commas, "
        "the next tried when one is unavailable (default: %(default)s, where `stagediff up` serves)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"the tenant's API key; other users of this machine can read it in `ps`: prefer ${API_KEY_ENV} or "
        "--api-key-file (default: none, a cluster without tenants needs none)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help=f"a file holding the API key (default: ${API_KEY_ENV} itself, else the file ${API_KEY_FILE_ENV} names, "
        f"else {DEFAULT_API_KEY_FILE} when it exists)",
    )
    parser.add_argument(
        "--tls", action="store_true", help="connect with TLS, verified against the system's roots unless --ca-cert"
    )
    parser.add_argument(
        "--ca-cert", default=None, help="CA certificate (PEM) to verify the server with; implies --tls (default: none)"
    )
    parser.add_argument(
        "--client-cert",
        default=None,
        help="client certificate (PEM) for a server that requires one, mutual TLS (default: none)",
    )
    parser.add_argument("--client-key", default=None, help="private key (PEM) of --client-cert (default: none)")


def _add_follow_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that waits for a job."""
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default: none)")
    parser.add_argument(
        "--retries",
        type=int,
        default=None,
        help="retries when the cluster is unavailable (default: 3, over about 3.5 s; with several --endpoint "
        "addresses 6, over about 15 s: enough for a takeover between orchestrator replicas)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress on stderr (default: bars on a terminal, else lines)"
    )


def _non_negative(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"'{value}': expected a whole number >= 0")
    return number


GENERATE_DESCRIPTION = """\
Generates a video or an image through a StageDiff cluster and saves it to --out. Progress goes to stderr
(a bar per stage on a terminal); a JSON summary (job id, seed, frames, timings) to stdout. Every request
flag left out takes the model's default, as the SDK and the HTTP API do (`stagediff models` lists them).
Ctrl-C cancels the job. Exit status: 0 done, 1 the call or the job failed, 2 a bad argument, 130 cancelled
by Ctrl-C."""

GENERATE_EXAMPLES = """\
examples:
  # a 9-frame video from the cluster `stagediff up --model models/demo` serves on this machine
  stagediff generate --prompt "a red circle moving right on a dark background" --num-frames 9 --seed 7 \\
      --out circle.mp4
  # one image, edited from a photo, from a cluster on another host
  stagediff generate --endpoint gpu-host:50051 --prompt "make the sky purple" --image photo.jpg \\
      --num-inference-steps 20 --out edited.png"""


def _add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a request (generate, submit): RequestOptions' keywords, with dashes."""
    parser.add_argument("--prompt", required=True, help="what to generate, or for an editing model the edit")
    parser.add_argument(
        "--negative-prompt", default=None, help="what to steer away from, used with --guidance-scale above 1 "
        "(default: the model's, usually none)"
    )  # fmt: skip
    parser.add_argument("--model", default=None, help="model id (default: the cluster's only model)")
    parser.add_argument("--height", type=int, help="output height in pixels, a multiple of 16 for Wan (default: the "
                        "model's; an editing model's follows the --image)")  # fmt: skip
    parser.add_argument("--width", type=int, help="output width in pixels, like --height (default: the model's)")
    parser.add_argument(
        "--num-frames",
        "--frames",
        type=int,
        help="number of frames: 4k+1 for Wan, 1 for an image (default: the model's, 1 for an image model)",
    )
    parser.add_argument("--num-inference-steps", "--steps", type=int, help="denoising steps (default: the model's)")
    parser.add_argument(
        "--guidance-scale",
        "--guidance",
        type=float,
        help="CFG scale (true_cfg_scale for qwen-image and flux); above 1 uses the negative prompt (default: the "
        "model's)",
    )
    parser.add_argument(
        "--embedded-guidance-scale",
        type=float,
        help="the guidance a guidance-distilled model embeds (FLUX.1-dev: FluxPipeline's guidance_scale; refused by "
        "other models; default: the model's)",
    )
    parser.add_argument("--seed", type=int, help="the noise's seed (default: the server picks one and reports it)")
    parser.add_argument("--fps", type=float, help="the output's frame rate (default: the model's)")
    parser.add_argument(
        "--cache",
        default=None,
        help="the DiT's step cache: none, first_block, mag or teacache, as the model offers (default: the server's)",
    )
    parser.add_argument(
        "--cache-threshold", type=float, default=None, help="its threshold; higher skips more (default: the method's)"
    )
    parser.add_argument(
        "--lora",
        "--loras",
        dest="loras",
        action="append",
        default=[],
        type=_lora_argument,
        metavar="NAME[:SCALE]",
        help="a LoRA adapter the model lists (`stagediff models`), at SCALE (default 1); repeat for several "
        "(default: none)",
    )
    parser.add_argument(
        "--interp-exp", type=int, default=0, help="frame interpolation: 2**k x the frames' rate (default: 0, none)"
    )
    parser.add_argument(
        "--interp-scale", type=float, default=0.0, help="RIFE flow scale: 0.25 .. 4 (default: 0, meaning 1)"
    )
    parser.add_argument(
        "--interp-model-path",
        default="",
        help="RIFE weights the cluster must be serving (default: whichever it serves)",
    )
    parser.add_argument(
        "--image",
        metavar="FILE",
        help="input image (PNG, JPEG, WebP): the first frame of image-to-video, the image to edit (default: none)",
    )
    parser.add_argument(
        "--last-image", metavar="FILE", help="the last frame, for a model that takes one (default: none)"
    )
    parser.add_argument(
        "--reference-image",
        "--reference-images",
        dest="reference_images",
        metavar="FILE",
        action="append",
        default=[],
        help="a reference image; repeat for several (default: none)",
    )
    parser.add_argument(
        "--output-quality",
        "--quality",
        type=int,
        default=None,
        help="1 (smallest) to 100 (best) for mp4, webm, jpeg and webp (default: the format's)",
    )
    parser.add_argument(
        "--keep-raw-frames",
        action="store_true",
        help="with an encoded --output-format, also receive the raw frames (default: the encoded file only)",
    )
    parser.add_argument(
        "--audio-codec",
        choices=("none", "aac", "opus", "raw"),
        default=None,
        help="for a model that makes sound: none for a silent result, or the codec: aac (mp4), opus (webm), raw "
        "(the waveform; written beside raw frames as a .wav) (default: the format's own)",
    )
    parser.add_argument(
        "--deadline",
        dest="deadline_s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds from submission by which the job should be done: it is refused at once when the cluster "
        "estimates it cannot be (default: none)",
    )


def _add_output_format_argument(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--output-format",
        "--format",
        choices=tuple(OUTPUT_FORMATS),
        default=None,
        help=f"the result's format, encoded on the server (raw: frames) (default: {default})",
    )


def add_parsers(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate",
        help="generate a video or image through a cluster",
        description=GENERATE_DESCRIPTION,
        epilog=GENERATE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_connection_arguments(generate)
    _add_request_arguments(generate)
    _add_output_format_argument(generate, "the one --out's extension names; .npz: raw")
    _add_follow_arguments(generate)
    generate.add_argument(
        "--out",
        required=True,
        help=f"output file, in a directory that exists: {', '.join(FORMAT_OF_EXTENSION)} (.png and the other image "
        "formats hold one frame: --num-frames 1)",
    )
    generate.set_defaults(func=_command("generate"))

    submit = commands.add_parser(
        "submit",
        help="queue a job and print its id at once (follow it with `stagediff wait JOB_ID`)",
        description="Queues a job with generate's request flags and prints its id; `stagediff wait JOB_ID --out "
        "FILE` follows it and saves its result, `stagediff cancel JOB_ID` stops it.",
    )
    _add_connection_arguments(submit)
    _add_request_arguments(submit)
    _add_output_format_argument(submit, "raw frames")
    submit.set_defaults(func=_command("submit"))

    wait = commands.add_parser(
        "wait",
        help="follow a job to its end; print its summary, save its result",
        description="Follows a job to its end (a finished one: its result alone, no replay of its progress), "
        "saves its result if asked and prints its summary as JSON. Ctrl-C cancels the job.",
    )
    _add_connection_arguments(wait)
    wait.add_argument("job_id", metavar="JOB_ID")
    _add_follow_arguments(wait)
    wait.add_argument(
        "--out", default=None, help=f"save the result, in a directory that exists: {', '.join(FORMAT_OF_EXTENSION)}"
    )
    wait.set_defaults(func=_command("wait"))

    jobs = commands.add_parser("jobs", help="list the tenant's jobs, newest first")
    _add_connection_arguments(jobs)
    jobs.add_argument("--state", choices=JOB_STATE_NAMES, default=None, help="only the jobs in this state")
    jobs.add_argument("--limit", type=_non_negative, default=0, help="at most this many (0: the server's 100)")
    jobs.add_argument("--json", action="store_true", help="the jobs as JSON, every field")
    jobs.set_defaults(func=_command("jobs"))

    cancel = commands.add_parser(
        "cancel",
        help="cancel a queued or running job; print it as JSON",
        description="Cancels a queued or running job and prints it as JSON. A job that had already succeeded or "
        "failed is left as it is: a note on stderr says so, and the exit status is 1.",
    )
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
