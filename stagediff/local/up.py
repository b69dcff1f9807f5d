"""`stagediff up`: runs a compose file's services as local processes until SIGINT or SIGTERM.

It prints `started NAME pid=N endpoint=HOST:PORT` for each service, then `http URL` (the HTTP gateway's, where
the file has a `serve http` service) and `ready HOST:PORT[,HOST:PORT...]` (the orchestrator's, or with
`--orchestrators N` its replicas', as the SDK's endpoint takes them) once every one is SERVING (the
gateway: once its GET /readyz answers 200), and `exited NAME code=N` for a service that ends. A service is ready
only once its answer carries the launch id given to that process, so another server on its port never passes for
it; before anything starts, a taken --port, --http-port or stage port, or a --state-dir that another running
cluster uses, ends `up` with one line each (exit code 2). `up` records itself for `stagediff ps` and `stagediff down`
(stagediff/cluster_registry.py) once ready, and its services end when it does, however it ends
(services/supervised.py). `--model DIR` (or a Hub id ORG/NAME[@REVISION]) takes the place of the model the compose
file mounts into its containers, and decides the stages: those of its family's chain (families/). Several
`--model` run behind one orchestrator (stagediff/local/models.py): a DiT each, and one text encoder and one VAE
for the models whose components for them are the same files. `--orchestrators N` replicas share the job database
of `--store` (a PostgreSQL URL, or `local-postgres`: `up` starts a throwaway one) and the blobs of `--blobs`
(`local-s3`: a throwaway SeaweedFS).

`up`'s options are declared on the client's side (stagediff/up_options.py), so that `stagediff up --help`
reads the same where the servers are not installed; the stage options among them (STAGE_OPTIONS) are each
passed to the processes of the stage that declares it, over what the compose file's environment says.
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

from stagediff.cluster_registry import ClusterRecord, register, unregister
from stagediff.local.compose import DEFAULT_COMPOSE_FILE
from stagediff.local.servers import ServerMissing, seaweedfs
from stagediff.local.servers import postgres as local_postgres
from stagediff.local.supervisor import LocalCluster, ServiceProcess, StartupConflict
from stagediff.up_options import LOCAL_POSTGRES, LOCAL_S3, STAGE_OPTIONS, build_parser


def stage_flags(options: Mapping[str, Any]) -> dict[str, list[str]]:
    """The stage options given to `stagediff up` (its parsed options by destination name, `vars(args)`), grouped
    by the service they go to."""
    extra: dict[str, list[str]] = {}
    if options.get("tenants"):
        extra["orchestrator"] = ["--tenants", str(Path(options["tenants"]).resolve())]
    for option in STAGE_OPTIONS:
        value = options[option.dest]
        if value is None or value is False or value == []:
            continue
        flag, flags = option.flag, extra.setdefault(option.stage, [])
        if isinstance(value, list):  # a repeatable option (--lora NAME, ...): each value after its own flag
            flags.extend(item for entry in value for item in (flag, str(entry)))
            continue
        flags.extend([flag] if value is True else [flag, str(value)])
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
                compose_file=args.file or DEFAULT_COMPOSE_FILE,
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
