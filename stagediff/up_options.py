"""The options of `stagediff up`, declared on the client's side: `stagediff up --help` reads the same from any
install, the client alone included, and a mistaken option is refused before the servers are loaded.

Pure argparse: nothing here imports the servers (services/, the stages, yaml, torch). What the servers define is
written here as values, and tests/unit/test_up_options.py checks each against them: the default ports and state
directory, the compose file's name, and every stage option `up` passes on (STAGE_OPTIONS). A stage option is
declared by its stage (`stagediff serve STAGE --help`); here it has the stage's names, type, choices and help,
with the stage's default written into the help. `up` gives it no default of its own: left out, it is not passed,
and the compose file's environment or the stage's default applies.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PORT = 50051  # the orchestrator's (services/orchestrator/options.py)
DEFAULT_HTTP_PORT = 8000  # the HTTP gateway's (services/gateway/options.py)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_STARTUP_TIMEOUT_S = 600.0
# The orchestrator's job store (its --state-dir default), under $XDG_STATE_HOME.
DEFAULT_STATE_DIR = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "stagediff"
# The compose file run without -f: the CPU topology, one of the servers' deploy/ files (stagediff/local/compose.py).
DEFAULT_COMPOSE_FILE_NAME = "docker-compose.cpu.yml"
LOCAL_POSTGRES = "local-postgres"  # --store: a throwaway PostgreSQL started by `up`
LOCAL_S3 = "local-s3"  # --blobs: a throwaway SeaweedFS started by `up`


@dataclass(frozen=True)
class StageOption:
    """An option `up` passes on to the one stage that declares it: its names (the first is the stage's canonical
    flag) and add_argument's keyword arguments, less the default."""

    stage: str
    names: tuple[str, ...]
    options: dict[str, Any]

    @property
    def flag(self) -> str:
        return self.names[0]

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _option(stage: str, *names: str, **options: Any) -> StageOption:
    return StageOption(stage, names, options)


STAGE_OPTIONS = (
    _option(
        "text-encoder",
        "--embedding-cache-bytes",
        type=int,
        help="bytes of embeddings kept in the LRU cache; 0 disables it (default: 268435456, 256 MiB)",
    ),
    _option(
        "text-encoder",
        "--embedding-cache-size",
        type=int,
        help="texts kept in the LRU cache, within --embedding-cache-bytes; 0 disables it (default: 1024)",
    ),
    _option("dit", "--ulysses-degree", "--usp", type=int, help="Ulysses sequence parallel degree (default: 1)"),
    _option("dit", "--ring-degree", "--ring", type=int, help="Ring attention degree (default: 1)"),
    _option("dit", "--cfg-parallel-size", type=int, choices=[1, 2], help="one rank group per branch (default: 1)"),
    _option("dit", "--tensor-parallel-size", type=int, help="attention heads and MLP sharded (default: 1)"),
    _option("dit", "--use-hsdp", action="store_true", help="shard each block's weights with FSDP2"),
    _option("dit", "--hsdp-shard-size", type=int, help="ranks a weight is sharded over"),
    _option("dit", "--hsdp-replicate-size", type=int, help="replicas of the sharded weights (default: 1)"),
    _option(
        "dit",
        "--quantization",
        choices=["fp8", "int8", "gguf"],
        help="fp8, int8: weight-only, per output channel; gguf: the .gguf file in the transformer folder, "
        "dequantized on the fly to the stage's compute dtype (chosen by itself when the folder holds only a .gguf "
        "file)",
    ),
    _option(
        "dit",
        "--ignored-layers",
        help="comma-separated linear layer names or patterns kept in full precision (fp8, int8)",
    ),
    _option("dit", "--enable-cpu-offload", action="store_true", help="experts wait in CPU memory when not in use"),
    _option(
        "dit", "--enable-layerwise-offload", action="store_true", help="blocks stream to the device one group at a time"
    ),
    _option("dit", "--offload-blocks", type=int, help="blocks resident at once with layerwise offload (default: 1)"),
    _option(
        "dit",
        "--compile",
        action="store_true",
        help="torch.compile each repeated transformer block (regional compilation)",
    ),
    _option(
        "dit",
        "--cache-backend",
        choices=("none", "first_block", "mag", "teacache"),
        help="default step cache (default: none)",
    ),
    _option(
        "dit",
        "--cache-threshold",
        type=float,
        help="its threshold; higher skips more (default: first_block 0.1, mag 0.06, teacache 0.08)",
    ),
    _option("dit", "--max-batch-size", type=int, help="requests in one batch (default 1: no batching; at most 64)"),
    _option(
        "dit",
        "--batch-wait-ms",
        type=float,
        help="how long a request waits for partners before its batch starts (default 10; at most 10000)",
    ),
    _option(
        "dit",
        "--continuous-batching",
        action="store_true",
        help="step up to --max-batch-size requests together, a new one joining at the next step boundary, each "
        "at its own step (families whose loop runs as steps, one rank; --batch-wait-ms is not used)",
    ),
    _option(
        "dit",
        "--batch-growth",
        choices=("measured", "full"),
        help="with --continuous-batching, how far a batch of one shape grows: 'measured' (default) while a row's "
        "measured share of a step keeps falling; 'full' to --max-batch-size whatever a row costs",
    ),
    _option(
        "dit",
        "--lora-dir",
        help="directory of adapters: NAME.safetensors for the adapter NAME, TENANT/NAME.safetensors for one "
        "private to TENANT (default: none; requests naming adapters are refused)",
    ),
    _option(
        "dit",
        "--lora-cache-bytes",
        type=int,
        help="bytes of adapters kept loaded on each rank, the least recently used evicted (default 4294967296)",
    ),
    _option("dit", "--lora-max-file-bytes", type=int, help="largest adapter file read (default 2147483648)"),
    _option(
        "dit",
        "--max-loras-per-request",
        type=int,
        help="adapters one request may apply at once (default 4; 0: only the fused ones of --lora)",
    ),
    _option(
        "dit",
        "--lora",
        action="append",
        metavar="NAME[:SCALE]",
        help="fuse an adapter of --lora-dir into the base weights at startup, at SCALE (default 1); repeatable. "
        "The model is served as MODEL+NAME, at no cost per step (few-step distillation adapters)",
    ),
    _option(
        "vae",
        "--vae-patch-parallel-size",
        type=int,
        help="ranks the rows of each frame are split over, exactly (default: 1)",
    ),
    _option(
        "vae", "--vae-use-tiling", action="store_true", help="decode in overlapping tiles on one device (approximate)"
    ),
    _option("vae", "--vae-tile-sample-min-height", type=int, help="tile height in pixels (default: 256)"),
    _option("vae", "--vae-tile-sample-min-width", type=int, help="tile width in pixels (default: 256)"),
    _option("vae", "--vae-tile-sample-stride-height", type=int, help="vertical tile stride (default: 192)"),
    _option("vae", "--vae-tile-sample-stride-width", type=int, help="horizontal tile stride (default: 192)"),
    _option(
        "interp",
        "--interp-model-path",
        help="RIFE 4.22.lite or 4.25 flownet.pkl (default: optical flow, no weights)",
    ),
)


def parse_replicas(text: str) -> dict[str, int]:
    """`text-encoder=1,dit=2` -> {"text-encoder": 1, "dit": 2}."""
    counts: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        stage, equals, count = item.partition("=")
        if not equals or not count.strip().isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: use STAGE=COUNT with COUNT >= 1, e.g. dit=2")
        counts[stage.strip()] = int(count)
    return counts


def build_parser() -> argparse.ArgumentParser:
    up = argparse.ArgumentParser(
        prog="stagediff up",
        description="Starts the services of a compose file that the model's chain uses as local processes, and "
        "prints 'ready HOST:PORT' once all are SERVING; SIGINT or SIGTERM stops them. Needs the servers "
        "(stagediff-server) installed beside the client.",
    )
    _add_cluster_arguments(up)
    _add_storage_arguments(up)
    _add_stage_arguments(up)
    return up


def _add_cluster_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument(
        "--model",
        required=True,
        action="append",
        metavar="DIR|ORG/NAME[@REVISION]",
        help="a diffusers checkpoint directory (model_index.json and its component folders; `stagediff "
        "init-model` writes one) or a Hugging Face Hub id (fetched through huggingface_hub's cache, only the "
        "files the stages load; HF_HUB_OFFLINE=1 uses the cache alone); repeat it to serve several models "
        "behind one orchestrator: a DiT each, and one "
        "text encoder and VAE for the models whose components are the same files",
    )
    up.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="the orchestrator's port (default: %(default)s; 0: a free port)"
    )
    up.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="the HTTP gateway's port, where the compose file has one (default: %(default)s; 0: a free port)",
    )
    up.add_argument(
        "-f",
        "--file",
        default=None,
        help=f"compose file (default: the CPU topology, {DEFAULT_COMPOSE_FILE_NAME} of deploy/, which ships with "
        "the servers)",
    )
    up.add_argument("--host", default=DEFAULT_HOST, help="the address every service binds (default: %(default)s)")
    up.add_argument(
        "--threads-per-stage",
        type=int,
        default=None,
        help="torch intra-op threads of each stage (default: torch's own, every core for each stage)",
    )
    up.add_argument("--log-dir", default=None, help="where SERVICE.log files go (default: a new temporary directory)")
    up.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        help="seconds until every service is SERVING (default: %(default)s)",
    )
    up.add_argument("--echo-logs", action="store_true", help="also copy every service's log to stderr")
    up.add_argument(
        "--replicas",
        type=parse_replicas,
        default=None,
        metavar="STAGE=N[,STAGE=N...]",
        help="processes per stage, e.g. text-encoder=1,dit=2,vae=2,interp=1 (default: the compose file's "
        "services; `<stage>-N` services are replicas of `<stage>`)",
    )


def _add_storage_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument(
        "--state-dir",
        default=str(DEFAULT_STATE_DIR),
        help="the orchestrator's job store: jobs and results survive restarts of `up` (default: %(default)s)",
    )
    up.add_argument("--tenants", metavar="FILE", help="tenants YAML for the orchestrator (default: open, no keys)")
    up.add_argument(
        "--orchestrators",
        type=int,
        default=1,
        metavar="N",
        help="orchestrator replicas, sharing the job database of --store (default: %(default)s)",
    )
    up.add_argument(
        "--store",
        metavar=f"postgresql://...|{LOCAL_POSTGRES}",
        help=f"the orchestrators' job database; {LOCAL_POSTGRES} starts a throwaway PostgreSQL for as long as `up` "
        "runs (default: SQLite in --state-dir, one orchestrator)",
    )
    up.add_argument(
        "--blobs",
        metavar=f"s3://BUCKET[/PREFIX]|DIR|{LOCAL_S3}",
        help=f"where results and stage outputs live; {LOCAL_S3} starts a throwaway SeaweedFS for as long as `up` "
        "runs (default: --state-dir)",
    )
    up.add_argument(
        "--blobs-endpoint", metavar="URL", help="the S3-compatible endpoint of --blobs s3://... (default: AWS's)"
    )


def _add_stage_arguments(up: argparse.ArgumentParser) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in STAGE_OPTIONS:
        if option.stage not in groups:
            groups[option.stage] = up.add_argument_group(
                f"{option.stage} options",
                f"passed to the {option.stage} stage; left out, the compose file's environment or the stage's "
                "default applies",
            )
        groups[option.stage].add_argument(*option.names, default=None, **option.options)
