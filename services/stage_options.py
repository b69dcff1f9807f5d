"""The options every stage service takes, declared without importing torch or a stage's compute.

Each stage's `options.py` adds these and its own to an `OptionParser` (services/environment_options.py),
whose values come from the command line, the environment and a config file.
"""

from __future__ import annotations

import argparse

from services.auth import add_cluster_secret_argument, add_tls_arguments
from services.environment_options import OptionParser
from services.logging_setup import add_logging_arguments
from services.metrics import add_metrics_arguments
from services.server import DEFAULT_GRACE_SECONDS, add_server_arguments
from services.stage_table import STAGES


def add_stage_arguments(
    parser: argparse.ArgumentParser,
    default_port: int,
    *,
    reads_checkpoint: bool = True,
    drain_grace_s: float = DEFAULT_GRACE_SECONDS,
) -> None:
    """The options of every stage. A stage that does not read the served checkpoint (its StageKind says
    `reads_checkpoint=False`) takes `--model` only to report the checkpoint's id and limits."""
    if reads_checkpoint:
        parser.add_argument("--model", required=True, help="diffusers checkpoint directory")
    else:
        parser.add_argument(
            "--model",
            default=None,
            help="diffusers checkpoint directory whose id and limits the stage reports (optional: the stage "
            "does not load its weights)",
        )
    parser.add_argument("--model-name", default=None, help="model id to serve under (default: directory name)")
    add_server_arguments(parser)
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument(
        "--drain-grace",
        type=float,
        default=drain_grace_s,
        metavar="SECONDS",
        help="on SIGTERM, how long the calls in flight may run on while health says NOT_SERVING and no new call "
        "is taken; calls still running then are cut, and the orchestrator moves them to another replica. Keep "
        "a container's termination grace above it (default: %(default)s, this stage's longest call at real size)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--num-weight-load-threads", type=int, default=4, help="threads reading safetensors shards (default 4)"
    )
    parser.add_argument(
        "--disable-multithread-weight-load", action="store_true", help="read shards one at a time, in one thread"
    )
    add_cluster_secret_argument(parser)
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve without a cluster secret, answering any caller that reaches the port "
        "(default: refuse to start without one)",
    )
    add_tls_arguments(parser)
    add_logging_arguments(parser)
    add_metrics_arguments(parser)


def add_stage_kind_arguments(parser: argparse.ArgumentParser, stage: str) -> None:
    """`add_stage_arguments` with the port and checkpoint use of the stage kind (services/stage_table.py)."""
    kind = STAGES[stage]
    add_stage_arguments(
        parser, kind.default_port, reads_checkpoint=kind.reads_checkpoint, drain_grace_s=kind.drain_grace_s
    )
    if kind.shares_components:
        parser.add_argument(
            "--also-serve",
            action="append",
            default=[],
            metavar="DIR",
            help=f"another checkpoint directory whose {stage} components are the same files as --model's: this "
            "replica serves its model too, with the weights loaded once (repeatable)",
        )


def stage_parser(stage: str) -> OptionParser:
    """An empty parser for `stagediff serve <stage>`, described by its stage kind."""
    return OptionParser(prog=f"stagediff serve {stage}", description=f"The {stage} stage: {STAGES[stage].summary}.")
