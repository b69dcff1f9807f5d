"""The options of `stagediff serve orchestrator` (no torch here: `stagediff up` and the tests read them).

One endpoint flag per stage kind (services/stage_table.py), each optional: a cluster runs the stages its
model's chain uses (families/), so a deployment of an image model has no interpolator to name.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from services.auth import add_cluster_secret_argument, add_stage_tls_arguments, add_tls_arguments
from services.environment_options import OptionParser
from services.logging_setup import add_logging_arguments
from services.metrics import add_metrics_arguments
from services.orchestrator.adapter_rate import DEFAULT_ADAPTERS_PER_MINUTE
from services.orchestrator.blobs.s3 import CHECKSUM_MODES
from services.orchestrator.kept_outputs import DEFAULT_AFTER_S as KEEP_OUTPUTS_AFTER_S
from services.orchestrator.membership import LEADER_LEASE_S
from services.orchestrator.preemption import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_CHECKPOINT_MIN_STEPS,
    DEFAULT_MAX_PREEMPTIONS,
    DEFAULT_PROTECT_LAST_STEPS,
)
from services.orchestrator.sizes import MinFree, parse_size
from services.orchestrator.stage_clients import PROBE_INTERVAL_S, REPLICA_WAIT_S
from services.orchestrator.store.jobstore import DEFAULT_LEASE_TTL_S
from services.server import add_server_arguments
from services.stage_table import STAGES

DEFAULT_PORT = 50051
# Every queued job may hold a Generate stream open: the default leaves room for a full queue
# (--max-queued-jobs 256) and as many watchers and unary calls again.
MAX_CONCURRENT_RPCS = 1024
# How long a job whose Generate stream was lost (not cancelled by the client) keeps running, waiting for the
# client's retry to attach again with the same request id.
DEFAULT_DRAIN_GRACE_S = 60.0  # a replica leaving lets its running jobs finish this long
DEFAULT_DETACH_GRACE_S = 60.0
DEFAULT_STATE_DIR = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "stagediff"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _min_free(text: str) -> MinFree:
    try:
        return MinFree.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_stage_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """`--<stage> HOST:PORT|dns:NAME:PORT[,...]` for every stage kind (services/orchestrator/discovery.py)."""
    group = parser.add_argument_group("stages", "the replicas of each stage the served model's chain uses")
    for name, stage in STAGES.items():
        group.add_argument(
            f"--{name}",
            default=None,
            metavar="HOST:PORT|dns:NAME:PORT[,...]",
            help=f"the {name} stage's replicas, comma-separated ({stage.summary}): endpoints, or dns:NAME:PORT "
            "for every address NAME resolves to, looked up again every --health-interval (a headless Service)",
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, default_max_rpcs=MAX_CONCURRENT_RPCS)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    add_stage_endpoint_arguments(parser)
    parser.add_argument("--max-running-jobs", type=int, default=4, help="jobs in flight across the stages")
    parser.add_argument("--max-queued-jobs", type=int, default=256, help="jobs waiting, all tenants together")
    parser.add_argument(
        "--stage-retries",
        type=int,
        default=1,
        help="retries of a stage that is UNAVAILABLE with no other serving replica "
        "(failing over to another serving replica spends none)",
    )
    parser.add_argument(
        "--detach-grace",
        type=float,
        default=DEFAULT_DETACH_GRACE_S,
        metavar="SECONDS",
        help="how long a job with a request id keeps running after its Generate stream is lost, waiting for "
        "the client to attach again (0: cancel at once; an explicit CancelJob always does; default: %(default)s)",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=PROBE_INTERVAL_S,
        help="seconds between health probes of every stage replica (default: %(default)s)",
    )
    parser.add_argument(
        "--replica-wait",
        type=float,
        default=REPLICA_WAIT_S,
        help="seconds a call waits for a replica of its stage to serve again before failing (default: %(default)s)",
    )
    parser.add_argument(
        "--cold-start-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="where a stage has no replica serving a job's model (a pool scaled to zero, starting on demand), how "
        "long the job waits for one, in order, before it fails UNAVAILABLE naming the stage; size it to the model's "
        "load time (0, the default: --replica-wait)",
    )
    parser.add_argument("--tenants", metavar="FILE", help="tenants YAML (API keys, priorities, quotas); default: open")
    parser.add_argument(
        "--state-dir",
        default=str(DEFAULT_STATE_DIR),
        help="where job records (SQLite) and results live, so that a restart loses no job (default: %(default)s)",
    )
    parser.add_argument(
        "--store",
        metavar="postgresql://USER@HOST:PORT/DATABASE",
        help="keep job records in PostgreSQL, shared by every orchestrator replica (password in PGPASSWORD or "
        "~/.pgpass); default: SQLite in --state-dir, for one orchestrator",
    )
    parser.add_argument(
        "--store-password-file",
        metavar="FILE",
        help="with --store postgresql://: a file holding the database user's password (a docker or Kubernetes "
        "secret), instead of PGPASSWORD",
    )
    parser.add_argument(
        "--blobs",
        metavar="s3://BUCKET[/PREFIX]|DIR",
        help="keep stage outputs, input images and results in S3 (keys from AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY or boto3's other sources) or in a directory; default: --state-dir",
    )
    parser.add_argument(
        "--blobs-endpoint",
        metavar="URL",
        help="the endpoint of an S3-compatible store for --blobs s3://... (e.g. http://seaweedfs:8333); default: AWS's",
    )
    parser.add_argument(
        "--presign-downloads",
        type=int,
        default=0,
        metavar="SECONDS",
        help="with --blobs s3://: GetJob names a presigned URL of a succeeded job's encoded file, valid this long, "
        "and the HTTP gateway answers its content download with a 307 there; clients must reach the store's "
        "endpoint (0: off, downloads stream through the orchestrator; default: %(default)s)",
    )
    parser.add_argument(
        "--blobs-checksums",
        default="when_required",
        choices=CHECKSUM_MODES,
        help="when the S3 client adds and checks CRC checksums: when_supported is boto3's default, which some "
        "S3-compatible stores refuse (default: %(default)s)",
    )
    parser.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="with --store postgresql://: where the other orchestrator replicas reach this one's gRPC port "
        "(default: this host's name and --port)",
    )
    parser.add_argument(
        "--leader-lease",
        type=float,
        default=LEADER_LEASE_S,
        metavar="SECONDS",
        help="with --store postgresql://: how long the leading replica's lease lasts unrenewed; a follower leads "
        "within it and a second after the leader dies (default: %(default)s)",
    )
    parser.add_argument(
        "--job-lease",
        type=float,
        default=DEFAULT_LEASE_TTL_S,
        metavar="SECONDS",
        help="with --store postgresql://: how long a job's lease lasts unrenewed; the job of a replica that "
        "died runs again elsewhere after it (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-grace",
        type=float,
        default=DEFAULT_DRAIN_GRACE_S,
        metavar="SECONDS",
        help="with --store postgresql://: on SIGTERM, how long the running jobs may take to finish here before "
        "the replica leaves them to another (default: %(default)s)",
    )
    parser.add_argument(
        "--keep-outputs-after",
        type=float,
        default=KEEP_OUTPUTS_AFTER_S,
        metavar="SECONDS",
        help="how long a job runs on past a finished stage before that stage's output is written to the store, "
        "for a restart to resume after it: a job that ends sooner writes none, and a crash within it runs the "
        "stage again (0: at once; default: %(default)s)",
    )
    parser.add_argument(
        "--max-kept-jobs",
        type=int,
        default=1000,
        help="finished jobs (and their results) each tenant keeps, unless its max_kept_jobs quota says otherwise; "
        "its oldest go first (default: %(default)s)",
    )
    parser.add_argument(
        "--max-stored-bytes-per-tenant",
        type=_size,
        default="20GiB",
        metavar="SIZE",
        help="bytes of results and intermediates each tenant keeps in --state-dir, unless its max_stored_bytes "
        "quota says otherwise (e.g. 20GiB, 500MiB; default: %(default)s)",
    )
    parser.add_argument(
        "--job-retention",
        type=float,
        default=86400.0,
        metavar="SECONDS",
        help="seconds a finished job and its result are kept (0: no age limit; default: %(default)s, one day)",
    )
    parser.add_argument(
        "--min-free-bytes",
        type=_min_free,
        default="1GiB",
        metavar="SIZE|PERCENT",
        help="space kept free on the --state-dir volume: below it new jobs are refused with RESOURCE_EXHAUSTED "
        "(e.g. 1GiB, 5%%; default: %(default)s)",
    )
    parser.add_argument(
        "--max-job-attempts", type=int, default=3, help="restarts of a job interrupted by orchestrator restarts"
    )
    parser.add_argument(
        "--adapters-per-minute",
        type=int,
        default=DEFAULT_ADAPTERS_PER_MINUTE,
        metavar="N",
        help="distinct LoRA adapters each tenant may name in any minute, unless its adapters_per_minute quota says "
        "otherwise; more are refused with RESOURCE_EXHAUSTED and a retry delay (0: no bound; default: %(default)s)",
    )
    parser.add_argument(
        "--batch-per-tenant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let the DiT batch a request only with the same tenant's, so that no tenant shares a batch (or its "
        "timing) with another (default: on with --tenants, off without)",
    )
    add_step_scheduling_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    add_logging_arguments(parser)
    add_metrics_arguments(parser)
    add_tls_arguments(parser)
    add_stage_tls_arguments(parser)
    add_cluster_secret_argument(parser)
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="start anyway without a cluster secret, or with --tenants on a non-loopback --host without TLS "
        "(default: refuse)",
    )


def add_step_scheduling_arguments(parser: argparse.ArgumentParser) -> None:
    """Preemption at the DiT gate and checkpoints of denoising state (services/orchestrator/preemption.py)."""
    group = parser.add_argument_group("step scheduling", "jobs waiting for a DiT slot, and the DiT's running ones")
    group.add_argument(
        "--preemption",
        choices=("on", "off"),
        default="on",
        help="let a waiting job of a higher priority class take the DiT slot of a running job of a lower one, which "
        "yields at a step boundary and continues later from the same step (default: %(default)s)",
    )
    group.add_argument(
        "--max-preemptions",
        type=int,
        default=DEFAULT_MAX_PREEMPTIONS,
        metavar="N",
        help="times one job may be made to yield (0: never; default: %(default)s)",
    )
    group.add_argument(
        "--preemption-protect-steps",
        type=int,
        default=DEFAULT_PROTECT_LAST_STEPS,
        metavar="N",
        help="a job with at most this many denoising steps left is never made to yield (default: %(default)s)",
    )
    group.add_argument(
        "--checkpoint-every",
        type=int,
        default=DEFAULT_CHECKPOINT_EVERY,
        metavar="K",
        help="save a running job's denoising state every K steps, so that another DiT replica continues it if its "
        "own fails (0: off, the job starts its DiT stage again; default: %(default)s)",
    )
    group.add_argument(
        "--checkpoint-min-steps",
        type=int,
        default=DEFAULT_CHECKPOINT_MIN_STEPS,
        metavar="M",
        help="with --checkpoint-every: jobs of fewer steps are not checkpointed, as running them again costs less "
        "(default: %(default)s)",
    )


def batch_per_tenant(choice: bool | None, has_tenants: bool) -> bool:
    """Whether the DiT batches a request only with its own tenant's: `choice` (--[no-]batch-per-tenant), else
    whether the cluster has a tenants file."""
    return choice if choice is not None else has_tenants


def build_parser() -> OptionParser:
    parser = OptionParser(
        prog="stagediff serve orchestrator",
        description="The orchestrator: the public Generation API of a StageDiff cluster, in front of its stages.",
    )
    add_arguments(parser)
    return parser
