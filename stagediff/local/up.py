"""`stagediff up`: runs a compose file's services as local processes until SIGINT or SIGTERM.

It prints `started NAME pid=N endpoint=HOST:PORT` for each service, then `http URL` (the HTTP gateway's, where
the file has a `serve http` service) and `ready HOST:PORT[,HOST:PORT...]` (the orchestrator's, or with
`--orchestrators N` its replicas', as the SDK's endpoint takes them) once every one is SERVING (the
gateway: once its GET /readyz answers 200), and `exited NAME code=N` for a service that ends. A service is ready
only once its answer carries the launch id given to that process, so another server on its port never passes for
it; before anything starts, a taken --port, --http-port or stage port, or a --state-dir that another running
cluster uses, ends `up` with one line each (exit code 2). `up` records itself for
`stagediff ps` and `stagediff down` (stagediff/cluster_registry.py) once ready, and its services end when it does,
however it ends (services/supervised.py). `--model DIR` (or a Hub id ORG/NAME[@REVISION]) is
mounted where the compose file mounts the model (/models/model), and decides the stages: those of its family's
chain (families/). Several `--model` run behind one orchestrator (stagediff/local/models.py): a DiT each, and
one text encoder and one VAE for the models whose components for them are the same files. `--orchestrators N`
replicas share the job database of `--store` (a PostgreSQL URL, or
`local-postgres`: `up` starts a throwaway one) and the blobs of `--blobs` (`local-s3`: a throwaway SeaweedFS).

The stage options `up` takes (FORWARDED_OPTIONS) are declared by the stages themselves: each is found in
the one `stagediff serve` parser that declares it (its names, type, choices and help come from there) and
passed to that stage's processes, over what the compose file's environment says.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from services.environment_options import Declaration, declared_options
from services.gateway.options import DEFAULT_PORT as DEFAULT_HTTP_PORT
from services.orchestrator.options import DEFAULT_PORT, DEFAULT_STATE_DIR
from services.stage_table import SERVE_TARGETS
from stagediff.cluster_registry import ClusterRecord, register, unregister
from stagediff.local.compose import DEFAULT_COMPOSE_FILE
from stagediff.local.servers import ServerMissing, seaweedfs
from stagediff.local.servers import postgres as local_postgres
from stagediff.local.supervisor import LocalCluster, ServiceProcess, StartupConflict

LOCAL_POSTGRES = "local-postgres"  # --store: a throwaway PostgreSQL started by `up`
LOCAL_S3 = "local-s3"  # --blobs: a throwaway SeaweedFS started by `up`

# Stage options `stagediff up` passes on, each to the stage whose parser declares it.
FORWARDED_OPTIONS = (
    "--embedding-cache-bytes",
    "--embedding-cache-size",
    "--ulysses-degree",
    "--ring-degree",
    "--cfg-parallel-size",
    "--tensor-parallel-size",
    "--use-hsdp",
    "--hsdp-shard-size",
    "--hsdp-replicate-size",
    "--quantization",
    "--ignored-layers",
    "--enable-cpu-offload",
    "--enable-layerwise-offload",
    "--offload-blocks",
    "--compile",
    "--cache-backend",
    "--cache-threshold",
    "--max-batch-size",
    "--batch-wait-ms",
    "--lora-dir",
    "--lora-cache-bytes",
    "--lora-max-file-bytes",
    "--max-loras-per-request",
    "--lora",
    "--vae-patch-parallel-size",
    "--vae-use-tiling",
    "--vae-tile-sample-min-height",
    "--vae-tile-sample-min-width",
    "--vae-tile-sample-stride-height",
    "--vae-tile-sample-stride-width",
    "--interp-model-path",
)


def forwarded_options() -> dict[str, tuple[str, Declaration]]:
    """Each forwarded option -> (the serve target it goes to, its declaration there). An option that no
    parser declares, or that several do, is a mistake in FORWARDED_OPTIONS: ValueError naming it."""
    declared = {target: declared_options(target) for target in SERVE_TARGETS}
    forwarded = {}
    for option in FORWARDED_OPTIONS:
        targets = [target for target, options in declared.items() if option in options]
        if len(targets) != 1:
            raise ValueError(f"`stagediff up {option}` must be declared by exactly one serve target, not {targets}")
        forwarded[option] = (targets[0], declared[targets[0]][option])
    return forwarded


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
        "prints 'ready HOST:PORT' once all are SERVING; SIGINT or SIGTERM stops them.",
    )
    up.add_argument(
        "--model",
        required=True,
        action="append",
        help="diffusers checkpoint directory (mounted at /models/model); repeat it to serve several models behind one "
        "orchestrator: a DiT each, and one text encoder and VAE for the models whose components are the same files",
    )
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="orchestrator port (0: a free port)")
    up.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="the HTTP gateway's port, where the compose file has one (default: %(default)s; 0: a free port)",
    )
    up.add_argument("-f", "--file", default=str(DEFAULT_COMPOSE_FILE), help="compose file (default: %(default)s)")
    up.add_argument("--host", default="127.0.0.1", help="address every service binds")
    up.add_argument("--threads-per-stage", type=int, default=None, help="torch intra-op threads of each stage")
    up.add_argument("--log-dir", default=None, help="where SERVICE.log files go (default: a new temporary directory)")
    up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds until every service is SERVING")
    up.add_argument("--echo-logs", action="store_true", help="also copy every service's log to stderr")
    up.add_argument(
        "--replicas",
        type=parse_replicas,
        default=None,
        metavar="STAGE=N[,STAGE=N...]",
        help="processes per stage, e.g. text-encoder=1,dit=2,vae=2,interp=1 (default: the compose file's "
        "services; `<stage>-N` services are replicas of `<stage>`)",
    )
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
    up.add_argument("--blobs-endpoint", metavar="URL", help="the S3-compatible endpoint of --blobs s3://...")
    groups = {}
    for target, declaration in forwarded_options().values():
        if target not in groups:
            groups[target] = up.add_argument_group(f"{target} options", f"passed to the {target} stage")
        options = {key: value for key, value in declaration.options.items() if key not in ("default", "required")}
        if "help" in options:  # the stage's default, since here an option left out is not passed at all
            options["help"] = options["help"].replace("%(default)s", str(declaration.options.get("default")))
        groups[target].add_argument(*declaration.names, default=None, **options)
    return up


def stage_flags(options: Mapping[str, Any]) -> dict[str, list[str]]:
    """The stage options given to `stagediff up` (its parsed options by destination name, `vars(args)`), grouped
    by the service they go to."""
    extra: dict[str, list[str]] = {}
    if options.get("tenants"):
        extra["orchestrator"] = ["--tenants", str(Path(options["tenants"]).resolve())]
    for option, (target, _) in forwarded_options().items():
        value = options[option.lstrip("-").replace("-", "_")]
        if value is None or value is False or value == []:
            continue
        if isinstance(value, list):  # a repeatable option (--lora NAME, ...): each value after its own flag
            extra.setdefault(target, []).extend(item for entry in value for item in (option, str(entry)))
            continue
        extra.setdefault(target, []).extend([option] if value is True else [option, str(value)])
    return extra


class _Shutdown(Exception):
    """SIGINT or SIGTERM reached `stagediff up`."""


def _raise_shutdown(signum: int, frame: object) -> None:
    raise _Shutdown(signum)


def run(args: argparse.Namespace) -> int:
    if args.orchestrators < 1:
        print("stagediff up: --orchestrators: run at least 1", file=sys.stderr, flush=True)
        return 2
    if args.orchestrators > 1 and not args.store:
        print(
            f"stagediff up: --orchestrators {args.orchestrators}: the replicas share a job database; give --store "
            f"postgresql://USER@HOST/DB, or --store {LOCAL_POSTGRES} to start one",
            file=sys.stderr,
            flush=True,
        )
        return 2
    with contextlib.ExitStack() as servers:
        try:
            store_flags, environment = _storage(args.store, args.blobs, args.blobs_endpoint, servers)
        except ServerMissing as error:
            print(f"stagediff up: {error}", file=sys.stderr, flush=True)
            return 1
        extra = stage_flags(vars(args))
        if store_flags:
            extra.setdefault("orchestrator", []).extend(store_flags)
        try:
            cluster = LocalCluster(
                args.model,
                compose_file=args.file,
                port=args.port,
                http_port=args.http_port,
                host=args.host,
                extra_args=extra,
                env=environment,
                orchestrators=args.orchestrators,
                threads_per_stage=args.threads_per_stage,
                log_dir=args.log_dir,
                echo_logs=args.echo_logs,
                replicas=args.replicas,
                state_dir=args.state_dir,
            )
        except (OSError, ValueError, yaml.YAMLError) as error:
            print(f"stagediff up: {error}", file=sys.stderr, flush=True)
            return 2
        return _serve_cluster(cluster, args.startup_timeout)


def _storage(
    store: str | None, blobs: str | None, blobs_endpoint: str | None, servers: contextlib.ExitStack
) -> tuple[list[str], dict[str, str]]:
    """The orchestrators' --store and --blobs flags and the environment they need, starting the throwaway
    servers asked for (stopped when `servers` closes)."""
    flags: list[str] = []
    environment: dict[str, str] = {}
    if store == LOCAL_POSTGRES:
        postgres = servers.enter_context(local_postgres())
        print(f"postgres {postgres.dsn}", flush=True)
        flags += ["--store", postgres.dsn]
    elif store:
        flags += ["--store", store]
    if blobs == LOCAL_S3:
        s3 = servers.enter_context(seaweedfs(Path(tempfile.mkdtemp(prefix="stagediff-seaweedfs-"))))
        print(f"s3 {s3.endpoint} bucket={s3.bucket}", flush=True)
        flags += ["--blobs", f"s3://{s3.bucket}", "--blobs-endpoint", s3.endpoint]
        environment = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    elif blobs:
        flags += ["--blobs", blobs]
        if blobs_endpoint:
            flags += ["--blobs-endpoint", blobs_endpoint]
    return flags, environment


def _serve_cluster(cluster: LocalCluster, startup_timeout: float) -> int:
    """Starts `cluster`, reports it, and keeps it until SIGINT or SIGTERM."""

    def started(service: ServiceProcess) -> None:
        print(f"started {service.name} pid={service.pid} endpoint={service.endpoint}", flush=True)

    previous = {sig: signal.signal(sig, _raise_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            cluster.start(timeout=startup_timeout, on_started=started)
        except StartupConflict as conflict:
            for problem in conflict.problems:
                print(f"stagediff up: {problem}", file=sys.stderr, flush=True)
            return 2
        except RuntimeError as error:
            print(f"stagediff up: {error}", file=sys.stderr, flush=True)
            return 1
        print(f"logs in {cluster.log_dir}", file=sys.stderr, flush=True)
        if cluster.http_url is not None:
            print(f"http {cluster.http_url}", flush=True)
        print(f"ready {cluster.endpoints}", flush=True)
        _register(cluster)  # for `stagediff ps` and `stagediff down`, until this process exits
        exited: set[str] = set()
        while True:
            for name, service in cluster.services.items():
                code = service.process.poll()
                if code is not None and name not in exited:
                    exited.add(name)
                    print(f"exited {name} code={code}", flush=True)
            time.sleep(0.5)
    except _Shutdown:
        return 0
    finally:
        # A second signal must not interrupt the stop itself; stop is bounded by its grace period.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        unregister()
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _register(cluster: LocalCluster) -> None:
    """Records the running cluster in this user's registry (stagediff/cluster_registry.py)."""
    record = ClusterRecord.of_this_process(
        endpoint=cluster.endpoints,
        state_dir=str(Path(cluster.state_dir).resolve()),
        log_dir=str(cluster.log_dir),
        models=[model.model_id for model in cluster.models],
        http_url=cluster.http_url,
    )
    try:
        register(record)
    except OSError as error:
        print(f"stagediff up: not listed by `stagediff ps`: {error}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    return run(build_parser().parse_args(argv))
