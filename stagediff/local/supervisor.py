"""The compose topology as local processes: started in depends_on order, watched, stopped in reverse.

A service's environment is its env files and `environment`, as in a container: STAGEDIFF_* option variables
of the calling shell do not leak in. Every process gets the same cluster secret. A service is up once it
answers SERVING on grpc.health.v1; the HTTP gateway (`serve http`), once its GET /readyz answers 200, which it
does once the orchestrator serves; each answer must carry the launch id given to that process, and the ports
and the state dir must be free before anything starts (ownership.py).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from services.launch_id import LAUNCH_ID_ENV
from services.model_source import resolve_model
from services.stage_table import STAGES
from services.supervised import SUPERVISOR_FD_ENV, SUPERVISOR_PID_ENV
from stagediff.local.compose import (
    DEFAULT_COMPOSE_FILE,
    ComposeService,
    for_chain,
    load_compose,
    replica_groups,
    start_order,
    with_replicas,
)
from stagediff.local.health import HEALTH_POLL_SECONDS
from stagediff.local.health import is_http_ready as is_http_ready  # re-exported: tests and benches wait with them
from stagediff.local.health import is_serving as is_serving
from stagediff.local.health import wait_for_http_ready as wait_for_http_ready
from stagediff.local.health import wait_for_serving as wait_for_serving
from stagediff.local.launch import (
    LaunchSpec,
    connect_host,
    format_endpoint,
    free_ports,
    gpu_environment,
    host_path,
    orchestrator_replicas,
    rewrite_command,
)
from stagediff.local.models import MODEL_MOUNT, for_models, local_models
from stagediff.local.ownership import grpc_ready_as, http_ready_as, startup_problems

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SECRET_ENV = "STAGEDIFF_CLUSTER_SECRET"  # read by every service (services/auth.py)
CLUSTER_SECRET_FILE_ENV = "STAGEDIFF_CLUSTER_SECRET_FILE"  # --cluster-secret-file, from the environment
OPTION_ENV_PREFIX = "STAGEDIFF_"  # every `stagediff serve` option can come from the environment
TLS_CERT_ENV = "STAGEDIFF_TLS_CERT"  # --tls-cert, from the environment
READINESS_PATH = "/readyz"  # the HTTP gateway's: 200 once the orchestrator answers its health check
LOG_TAIL_LINES = 40


def readiness_url(service: ComposeService, args: list[str], environment: dict[str, str], endpoint: str) -> str | None:
    """Where an HTTP service (the gateway) says it is ready: GET /readyz on its endpoint, over https when it
    serves TLS (--tls-cert, in its command or its environment); None for a gRPC service."""
    if not service.is_http:
        return None
    tls = any(arg == "--tls-cert" or arg.startswith("--tls-cert=") for arg in args) or bool(
        environment.get(TLS_CERT_ENV)
    )
    return f"{'https' if tls else 'http'}://{endpoint}{READINESS_PATH}"


# ---------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------


@dataclass
class ServiceProcess:
    """A started service."""

    name: str
    args: list[str]
    port: int
    endpoint: str
    log_path: Path
    process: subprocess.Popen[bytes]
    launch_id: str = ""  # given to this process only; its health answers carry it (services/launch_id.py)
    _log_file: IO[bytes] | None = field(default=None, repr=False)
    _echo_thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _cluster_secret_of(services: dict[str, ComposeService]) -> str | None:
    """The secret the services read from a secret file (STAGEDIFF_CLUSTER_SECRET_FILE), if the file says one.

    Each service then reads that file, which wins over the STAGEDIFF_CLUSTER_SECRET this cluster also
    sets; the cluster's own calls (health checks, tests) must present the same secret."""
    for service in services.values():
        container_file = service.environment.get(CLUSTER_SECRET_FILE_ENV)
        if container_file is None:
            continue
        file = Path(host_path(container_file, service.volumes))
        if file.is_file():
            return file.read_text().strip()
    return None


class StartupConflict(RuntimeError):
    """Ports or the state dir of a cluster are held by another server or cluster: one line each in `problems`."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class LocalCluster:
    """The compose topology as local processes, started in depends_on order and stopped in reverse.

    Usable as a context manager: `with LocalCluster(model_dir) as cluster: Client(cluster.endpoint)`.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        compose_file: str | os.PathLike[str] = DEFAULT_COMPOSE_FILE,
        port: int = 0,
        host: str = "127.0.0.1",
        extra_args: dict[str, list[str]] | None = None,
        threads_per_stage: int | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        echo_logs: bool = False,
        replicas: dict[str, int] | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        http_port: int = 0,
        orchestrators: int = 1,
    ) -> None:
        """Runs the services of `compose_file` that the chain of the model's family uses (families/), for a model
        directory or a Hugging Face Hub id (services/model_source.py): a Wan
        model runs the interpolator when the file has one, an image model never does. Several model directories
        run behind one orchestrator, a DiT each and the other stages shared where the files are the same
        (stagediff/local/models.py).

        `extra_args` go to the named service, or to every replica when it names a stage;
        `replicas` sets how many processes a stage runs (`{"dit": 2}`). `state_dir` holds the
        orchestrator's job store (default: a new temporary directory, so clusters never share one).
        `port` is the orchestrator's and `http_port` the HTTP gateway's, where the file has one (0: a free port).
        `orchestrators` > 1 runs that many orchestrator replicas (`orchestrator-2`, ...; each with a state dir of its
        own under `state_dir`, on a free port), which share a job database given in `extra_args["orchestrator"]`
        (`--store postgresql://...`); the gateway is given all of them.
        Every process gets the same cluster secret: $STAGEDIFF_CLUSTER_SECRET, else a new random one."""
        dirs = [model_dir] if isinstance(model_dir, str | os.PathLike) else list(model_dir)
        # A Hub id (ORG/NAME[@REVISION]) is fetched for every stage (services/model_source.py).
        self.models = local_models([resolve_model(os.fspath(path), STAGES) for path in dirs])
        self.model_dir = self.models[0].path
        self.compose_file = Path(compose_file).resolve()
        self.port = port
        self.http_port = http_port
        self.host = host
        self.extra_args = {name: list(args) for name, args in (extra_args or {}).items()}
        self.threads_per_stage = threads_per_stage
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.env = dict(env or {})
        self.echo_logs = echo_logs
        self.state_dir = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(prefix="stagediff-state-"))
        self.family = self.models[0].family
        if orchestrators < 1:
            raise ValueError(f"orchestrators: {orchestrators}; run at least 1")
        self.orchestrators = orchestrators
        services = for_chain(
            load_compose(self.compose_file, {**os.environ, **self.env}), *(model.family for model in self.models)
        )
        if len(self.models) > 1 and replicas:
            raise ValueError("--replicas: with several --model, each stage runs one process per pool of models")
        self.compose = for_models(with_replicas(services, replicas or {}), self.models)
        self.cluster_secret = (
            _cluster_secret_of(self.compose)
            or self.env.get(CLUSTER_SECRET_ENV)
            or os.environ.get(CLUSTER_SECRET_ENV)
            or secrets.token_urlsafe(32)
        )
        self.stage_of = {name: stage for stage, names in replica_groups(self.compose).items() for name in names}
        unknown = set(self.extra_args) - set(self.compose) - {service.origin for service in self.compose.values()}
        if unknown:
            raise ValueError(
                f"options for {', '.join(sorted(unknown))}, which this cluster does not run: it runs the services of "
                f"{self.compose_file} that {self.family.name} uses ({', '.join(self.compose)})"
            )
        self._services: dict[str, ServiceProcess] = {}
        self._plans: dict[str, LaunchSpec] = {}
        self._lock = threading.Lock()
        # While started: a pipe whose read end every service watches, to end once this process does
        # (services/supervised.py). Neither end is inherited by anything else.
        self._watch_pipe: tuple[int, int] | None = None

    # -- planning -------------------------------------------------------

    def plan(self, local_ports: dict[str, int] | None = None) -> dict[str, LaunchSpec]:
        """Every service's local command, in start order; free ports are picked unless given."""
        order = start_order(self.compose)
        entry = next(name for name, service in self.compose.items() if service.is_entry)
        ports = dict(local_ports or {})
        if entry not in ports and self.port:
            ports[entry] = self.port
        gateway = next((name for name in order if self.compose[name].is_http), None)
        if gateway is not None and gateway not in ports and self.http_port:
            ports[gateway] = self.http_port
        missing = [name for name in order if name not in ports]
        ports.update(zip(missing, free_ports(len(missing), self.host, exclude=ports.values()), strict=True))

        plans: dict[str, LaunchSpec] = {}
        for name in order:
            service = self.compose[name]
            path_map = [
                (str(self.model_dir) if target == MODEL_MOUNT else source, target) for source, target in service.volumes
            ]
            args = rewrite_command(service, host=self.host, local_ports=ports, services=self.compose, path_map=path_map)
            if self.threads_per_stage and service.stage_kind is not None:
                args += ["--threads", str(self.threads_per_stage)]
            stage = self.stage_of.get(name, name)
            if stage != name:
                args += self.extra_args.get(stage, [])
            if service.origin and service.origin != name:  # a model's own service, made from the file's
                args += self.extra_args.get(service.origin, [])
            # Fixed metrics ports of the compose file would collide between local clusters: off unless asked for.
            args = ["0" if index > 0 and args[index - 1] == "--metrics-port" else arg for index, arg in enumerate(args)]
            if service.is_entry:
                args += ["--state-dir", str(self.state_dir)]
            args += self.extra_args.get(name, [])
            for secret, file in service.secret_files:
                if not Path(file).is_file():
                    raise ValueError(
                        f"{name}: secret {secret!r} reads {file}, which does not exist "
                        "(create it, or set STAGEDIFF_SECRETS_DIR to the directory holding the secrets)"
                    )
            environment = {key: host_path(value, path_map) for key, value in service.environment.items()}
            endpoint = format_endpoint(connect_host(self.host), ports[name])
            plans[name] = LaunchSpec(
                name=name,
                args=args,
                environment={**environment, **gpu_environment(service), CLUSTER_SECRET_ENV: self.cluster_secret},
                port=ports[name],
                endpoint=endpoint,
                waits_for=[dep for dep, condition in service.depends_on.items() if condition == "service_healthy"],
                ready_url=readiness_url(service, args, {**environment, **self.env}, endpoint),
            )
        if self.orchestrators > 1:
            plans = orchestrator_replicas(
                plans, entry, self.orchestrators, self.host, self.state_dir, taken_ports=ports.values()
            )
            for name in plans:
                self.compose.setdefault(name, self.compose[entry])  # a replica is the orchestrator's service
        return plans

    # -- lifecycle ------------------------------------------------------

    @property
    def services(self) -> dict[str, ServiceProcess]:
        return dict(self._services)

    @property
    def endpoint(self) -> str:
        """host:port of the orchestrator."""
        for name, service in self._services.items():
            if self.compose[name].is_entry:
                return service.endpoint
        raise RuntimeError("the cluster is not started")

    @property
    def endpoints(self) -> str:
        """host:port of every orchestrator replica, separated by commas (what the SDK's endpoint takes)."""
        found = [service.endpoint for name, service in self._services.items() if self.compose[name].is_entry]
        if not found:
            raise RuntimeError("the cluster is not started")
        return ",".join(found)

    @property
    def http_url(self) -> str | None:
        """The HTTP gateway's base URL (`http://127.0.0.1:8000`), or None where the compose file has none."""
        if not self._services:
            raise RuntimeError("the cluster is not started")
        for name, plan in self._plans.items():
            if plan.ready_url is not None and name in self._services:
                return plan.ready_url.removesuffix(READINESS_PATH)
        return None

    def start(self, timeout: float = 600.0, on_started: Callable[[ServiceProcess], None] | None = None) -> LocalCluster:
        """Starts every service and returns once each answers SERVING; on failure stops them all."""
        if self._services:
            raise RuntimeError("the cluster is already started")
        deadline = time.monotonic() + timeout
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="stagediff-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        self._watch_pipe = os.pipe()
        try:
            plans = self._plans = self.plan()
            self._check_free(plans)
            for plan in plans.values():
                self._wait_healthy(plan.waits_for, deadline, timeout)
                started = self._spawn(plan)
                if on_started is not None:
                    on_started(started)
            self._wait_healthy(list(plans), deadline, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _check_free(self, plans: dict[str, LaunchSpec]) -> None:
        """StartupConflict, one line per port or state dir that another server or cluster holds."""
        flags = {}
        for name, plan in plans.items():
            if self.compose[name].is_entry:
                flags[name] = (plan.port, "--port")
            elif self.compose[name].is_http:
                flags[name] = (plan.port, "--http-port")
            else:
                flags[name] = (plan.port, f"the port chosen for {name}")
        problems = startup_problems(self.host, flags, self.state_dir)
        if problems:
            raise StartupConflict(problems)

    def replicas(self, stage: str) -> list[str]:
        """The services that run `stage` (`dit`, `dit-2`, ...)."""
        return [name for name, of in self.stage_of.items() if of == stage]

    def kill(self, name: str, signum: int = signal.SIGKILL) -> None:
        """Sends `signum` to a service (its whole session, so ranks it spawned go too) and waits for it to exit."""
        service = self._services[name]
        _signal(service.process, signum, group=True)
        service.process.wait()

    def restart(self, name: str, timeout: float = 300.0) -> ServiceProcess:
        """Starts an exited service again with the same command and port; returns once it is SERVING."""
        with self._lock:
            old = self._services[name]
        if old.process.poll() is None:
            raise RuntimeError(f"{name} (pid {old.pid}) is still running; stop or kill it first")
        _close_log(old)
        service = self._spawn(self._plans[name], log_mode="ab")
        self._wait_healthy([name], time.monotonic() + timeout, timeout)
        return service

    def _spawn(self, plan: LaunchSpec, log_mode: str = "wb") -> ServiceProcess:
        assert self.log_dir is not None
        log_path = self.log_dir / f"{plan.name}.log"
        # As in a container, a service's options come from the compose file alone: STAGEDIFF_* variables
        # of this shell would set options of every service (services/environment_options.py).
        inherited = {key: value for key, value in os.environ.items() if not key.startswith(OPTION_ENV_PREFIX)}
        environment = {**inherited, **plan.environment, **self.env}
        # Children import stagediff from the same tree as this process, whatever their cwd.
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), environment.get("PYTHONPATH")]))
        launch_id = environment[LAUNCH_ID_ENV] = secrets.token_hex(16)
        assert self._watch_pipe is not None
        environment[SUPERVISOR_FD_ENV] = str(self._watch_pipe[0])
        if threading.current_thread() is threading.main_thread():  # the death signal follows the forking thread
            environment[SUPERVISOR_PID_ENV] = str(os.getpid())
        log_file = log_path.open(log_mode)
        process = subprocess.Popen(
            [sys.executable, "-m", "stagediff.cli", *plan.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if self.echo_logs else log_file,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
            pass_fds=(self._watch_pipe[0],),
        )
        service = ServiceProcess(
            plan.name, plan.args, plan.port, plan.endpoint, log_path, process, launch_id=launch_id, _log_file=log_file
        )
        if self.echo_logs:
            service._echo_thread = threading.Thread(
                target=_echo, args=(process.stdout, log_file, f"[{plan.name}] "), name=f"log-{plan.name}", daemon=True
            )
            service._echo_thread.start()
        with self._lock:
            self._services[plan.name] = service
        return service

    def _wait_healthy(self, names: list[str], deadline: float, timeout: float) -> None:
        pending = list(names)
        while pending:
            for name in list(pending):
                service = self._services[name]
                code = service.process.poll()
                if code is not None:
                    raise RuntimeError(
                        f"{name} exited with code {code} before it was SERVING; "
                        f"last lines of {service.log_path}:\n{service.log_tail()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining > 0 and self._is_ready(name, service, timeout=min(1.0, remaining)):
                    pending.remove(name)
            if not pending:
                return
            if time.monotonic() >= deadline:
                service = self._services[pending[0]]
                raise RuntimeError(
                    f"{service.name} was not SERVING within {timeout:.0f}s (also waiting for: {pending[1:]}); "
                    f"last lines of {service.log_path}:\n{service.log_tail()}"
                )
            time.sleep(HEALTH_POLL_SECONDS)

    def _is_ready(self, name: str, service: ServiceProcess, timeout: float) -> bool:
        """SERVING on grpc.health.v1, or for the HTTP gateway a 200 from its /readyz, answered with the launch id
        of this very process."""
        ready_url = self._plans[name].ready_url if name in self._plans else None
        if ready_url is not None:
            return http_ready_as(ready_url, service.launch_id, timeout=timeout)
        return grpc_ready_as(service.endpoint, service.launch_id, timeout=timeout)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM in reverse start order, a service only after everything that depends on it has
        exited (so a draining orchestrator can still finish its jobs), and SIGKILL whatever is
        still running `grace` seconds after its SIGTERM. Idempotent."""
        with self._lock:
            remaining = list(reversed(self._services.values()))
        while remaining:
            names = {service.name for service in remaining}
            needed = {dep for service in remaining for dep in self.compose[service.name].depends_on} & names
            wave = [service for service in remaining if service.name not in needed]
            for service in wave:
                if service.process.poll() is None:
                    _signal(service.process, signal.SIGTERM)
            deadline = time.monotonic() + grace
            for service in wave:
                try:
                    service.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    # The whole session, so that ranks a stage spawned go too.
                    _signal(service.process, signal.SIGKILL, group=True)
                    service.process.wait()
            remaining = [service for service in remaining if service not in wave]
        for service in self._services.values():
            _close_log(service)
        if self._watch_pipe is not None:
            for fd in self._watch_pipe:
                os.close(fd)
            self._watch_pipe = None
        atexit.unregister(self.stop)

    def __enter__(self) -> LocalCluster:
        return self if self._services else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _close_log(service: ServiceProcess) -> None:
    if service._echo_thread is not None:
        service._echo_thread.join(timeout=5.0)
    if service._log_file is not None and not service._log_file.closed:
        service._log_file.close()


def _signal(process: subprocess.Popen[bytes], signum: int, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError):  # it has exited already
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)


def _echo(stream: IO[bytes], log_file: IO[bytes], prefix: str) -> None:
    """Copies a child's output into its log file and, prefixed, onto our stderr."""
    for line in iter(stream.readline, b""):
        log_file.write(line)
        log_file.flush()
        sys.stderr.write(prefix + line.decode(errors="replace"))
        sys.stderr.flush()
    stream.close()
