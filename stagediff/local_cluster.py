"""Runs the docker-compose topology as local processes: `stagediff up`.

The compose files in deploy/ are the one description of the cluster:
docker-compose.yml (a GPU pool per stage) and docker-compose.cpu.yml (the same
services on CPUs, the default here), both built on common-services.yml.
Instead of a second, hand-kept list of services for development and tests, this
module reads such a file as compose does (`extends`, `env_file`, `secrets`,
variables) and starts each service's `command` as `python -m stagediff.cli ...`,
rewritten for one machine: every service gets a free local port, SERVICE:PORT
references point at those ports, and container paths (the model volume, each
secret under /run/secrets) point at host paths, in the command and in the
environment. A GPU reservation becomes CUDA_VISIBLE_DEVICES of that process.
The environment of a service is its env files and `environment`, as in a
container: STAGEDIFF_* option variables of the calling shell do not leak in.

A stage may run as several replicas: services named `<stage>-N` (`dit-2`) are
replicas of `<stage>`, and `--replicas dit=2` clones the stage's service until
it has that many. Every SERVICE:PORT reference to one replica of a stage
becomes the comma-separated list of all of them, the form the orchestrator's
stage flags take.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CLUSTER_SECRET_ENV = "STAGEDIFF_CLUSTER_SECRET"  # read by every service (services/auth.py)
CLUSTER_SECRET_FILE_ENV = "STAGEDIFF_CLUSTER_SECRET_FILE"  # --cluster-secret-file, from the environment
OPTION_ENV_PREFIX = "STAGEDIFF_"  # every `stagediff serve` option can come from the environment
DEFAULT_STATE_DIR = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "stagediff"
MODEL_MOUNT = "/models/model"
ENTRY_COMMAND = ["serve", "orchestrator"]
HEALTH_POLL_SECONDS = 0.25
LOG_TAIL_LINES = 40


def _default_compose_file() -> Path:
    """The repository's CPU variant, which runs on any machine: next to the package source, else under the
    current directory. `-f deploy/docker-compose.yml` runs the GPU topology instead."""
    beside_package = PACKAGE_ROOT / "deploy" / "docker-compose.cpu.yml"
    return beside_package if beside_package.is_file() else Path.cwd() / "deploy" / "docker-compose.cpu.yml"


DEFAULT_COMPOSE_FILE = _default_compose_file()


# ---------------------------------------------------------------------------
# Reading the compose file
# ---------------------------------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:(?P<dollar>\$)"  # $$
    r"|\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"  # ${VAR}, ${VAR:-default}, ${VAR:?error}
    r"|(?P<bare>[A-Za-z_]\w*))"  # $VAR
)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Expands `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}` and `$$` as compose does."""

    def substitute(match: re.Match[str]) -> str:
        if match["dollar"]:
            return "$"
        name = match["braced"] or match["bare"]
        value = env.get(name)
        op, arg = match["op"], match["arg"] or ""
        if op is None:
            return value or ""
        unset = value is None or (op.startswith(":") and value == "")
        if not unset:
            return value or ""
        if op.endswith("?"):
            raise ValueError(f"${{{name}}} is required: {arg or 'not set'}")
        return arg

    return _VARIABLE.sub(substitute, text)


def _interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    return node


@dataclass(frozen=True)
class ComposeService:
    """What the compose file says about one service, after `extends`, env files and variable expansion."""

    name: str
    command: list[str]
    depends_on: dict[str, str]  # service -> condition
    environment: dict[str, str]  # env files first, then `environment` on top, as compose does
    volumes: list[tuple[str, str]]  # (host path, container path): bind mounts and secrets
    gpu_device_ids: list[str]
    container_port: int
    secret_files: list[tuple[str, str]] = field(default_factory=list)  # (secret name, host file)

    @property
    def is_entry(self) -> bool:
        """The orchestrator is the cluster's front door; the others are stages."""
        return self.command[:2] == ENTRY_COMMAND


SECRETS_MOUNT = "/run/secrets"  # where compose mounts each of a service's secrets, as a file named after it


def load_compose(compose_file: str | os.PathLike[str], env: dict[str, str] | None = None) -> dict[str, ComposeService]:
    """Reads the services of a compose file, in file order."""
    path = Path(compose_file).resolve()
    env = dict(os.environ if env is None else env)
    documents: dict[Path, dict[str, Any]] = {}
    services: dict[str, ComposeService] = {}
    for name in _read_document(path, env, documents).get("services") or {}:
        body = _service_body(path, name, env, documents, chain=())
        command = body.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if not command:
            raise ValueError(f"{path}: service {name} has no command")
        command = [str(arg) for arg in command]
        environment = {}
        for env_file in body.get("env_file") or []:
            environment.update(read_env_file(env_file))
        environment.update(body.get("environment") or {})
        secrets = body.get("x-secret-files") or []
        services[name] = ComposeService(
            name=name,
            command=command,
            depends_on=_depends_on(body.get("depends_on")),
            environment=environment,
            volumes=[*body.get("x-bind-mounts", []), *((host, target) for _, host, target in secrets)],
            gpu_device_ids=_gpu_device_ids(body),
            container_port=_port_of(name, command),
            secret_files=[(secret, host) for secret, host, _ in secrets],
        )
    if sum(service.is_entry for service in services.values()) != 1:
        raise ValueError(f"{path}: expected exactly one service running `{' '.join(ENTRY_COMMAND)}`")
    for service in services.values():
        unknown = set(service.depends_on) - set(services)
        if unknown:
            raise ValueError(f"{path}: {service.name} depends on unknown services {sorted(unknown)}")
    return services


def _read_document(path: Path, env: dict[str, str], documents: dict[Path, dict[str, Any]]) -> dict[str, Any]:
    if path not in documents:
        if not path.is_file():
            raise ValueError(f"compose file {path} does not exist")
        documents[path] = _interpolate_tree(yaml.safe_load(path.read_text()) or {}, env)
    return documents[path]


def _service_body(
    path: Path, name: str, env: dict[str, str], documents: dict[Path, dict[str, Any]], chain: tuple[str, ...]
) -> dict[str, Any]:
    """One service as declared in `path`, with what it `extends` merged under it.

    Paths are resolved against the file that writes them (as compose does), so a
    service extended from another file keeps its own relative paths. Bind mounts,
    env files and secrets come back in the private keys `x-bind-mounts`,
    `env_file` (absolute) and `x-secret-files` ((name, host file, container file)).
    """
    where = f"{path}:{name}"
    if where in chain:
        raise ValueError(f"`extends` has a cycle: {' -> '.join([*chain, where])}")
    document = _read_document(path, env, documents)
    declared = (document.get("services") or {}).get(name)
    if not isinstance(declared, dict):
        raise ValueError(f"{path}: no service {name!r}")
    body = {key: value for key, value in declared.items() if key not in ("volumes", "env_file", "secrets", "extends")}
    body["environment"] = _environment(declared.get("environment"), env)
    volumes = declared.get("volumes") or []
    body["x-bind-mounts"] = [mount for spec in volumes if (mount := _bind_mount(spec, path.parent))]
    env_files = declared.get("env_file") or []
    env_files = [env_files] if isinstance(env_files, str) else env_files
    body["env_file"] = [_resolve(path.parent, item) for item in env_files]
    body["x-secret-files"] = [_secret_file(path, document, spec) for spec in declared.get("secrets") or []]

    extends = declared.get("extends")
    if extends is None:
        return body
    if isinstance(extends, str):
        extends = {"service": extends}
    base_path = _resolve(path.parent, extends["file"]) if extends.get("file") else path
    base = _service_body(Path(base_path), extends["service"], env, documents, (*chain, where))
    base.pop("depends_on", None)  # compose never inherits depends_on through `extends`
    return _merge_service(base, body)


def _merge_service(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge of a service over the one it extends: mappings merge key by key, env files and secrets
    add up, bind mounts are replaced by container path, anything else is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if key in ("env_file", "x-secret-files"):
            merged[key] = [*base.get(key, []), *value]
        elif key == "x-bind-mounts":
            targets = {target for _, target in value}
            merged[key] = [mount for mount in base.get(key, []) if mount[1] not in targets] + value
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _merge_service(base[key], value)
        else:
            merged[key] = value
    return merged


def _resolve(base: Path, path: str) -> str:
    expanded = Path(path).expanduser()
    return str(expanded if expanded.is_absolute() else (base / expanded).resolve())


def _secret_file(path: Path, document: dict[str, Any], spec: Any) -> tuple[str, str, str]:
    """(name, host file, container file) of a service's secret: `name` or {source, target}."""
    source, target = (spec, spec) if isinstance(spec, str) else (spec["source"], spec.get("target") or spec["source"])
    declared = (document.get("secrets") or {}).get(source)
    if not isinstance(declared, dict) or "file" not in declared:
        raise ValueError(f"{path}: secret {source!r} is not declared with a `file` under the top-level `secrets`")
    container_file = target if target.startswith("/") else f"{SECRETS_MOUNT}/{target}"
    return source, _resolve(path.parent, declared["file"]), container_file


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """KEY=VALUE lines of a compose env file; blank lines and `#` comments are skipped, one level of
    matching quotes around a value is removed."""
    variables: dict[str, str] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ValueError(f"env file {path}: {error.strerror or error}") from None
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, equals, value = line.removeprefix("export ").partition("=")
        if not equals or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", key.strip()):
            raise ValueError(f"env file {path}, line {number}: expected KEY=VALUE, got {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        variables[key.strip()] = value
    return variables


def _depends_on(value: Any) -> dict[str, str]:
    if isinstance(value, list):
        return {name: "service_started" for name in value}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in (value or {}).items()}


def _environment(value: Any, env: dict[str, str]) -> dict[str, str]:
    """Compose's mapping and `K=V` list forms; a key without a value takes it from `env`, as compose does."""
    if isinstance(value, dict):
        items = list(value.items())
    else:
        items = [(key, item if equals else None) for key, equals, item in (str(v).partition("=") for v in value or [])]
    environment = {}
    for key, item in items:
        if item is None and key in env:
            environment[str(key)] = env[key]
        elif item is not None:
            environment[str(key)] = str(item)
    return environment


def _bind_mount(spec: Any, base: Path) -> tuple[str, str] | None:
    """(host, container) of a bind mount; named and anonymous volumes have no host path and are skipped."""
    if isinstance(spec, dict):
        if spec.get("type", "volume") != "bind":
            return None
        source, target = str(spec["source"]), str(spec["target"])
    else:
        parts = str(spec).split(":")
        if len(parts) < 2:
            return None
        source, target = parts[0], parts[1]
        if not source.startswith((".", "/", "~")):
            return None
    return _resolve(base, source), target.rstrip("/") or "/"


def _gpu_device_ids(body: dict[str, Any]) -> list[str]:
    reservations = (((body.get("deploy") or {}).get("resources") or {}).get("reservations")) or {}
    return [
        str(device_id)
        for device in reservations.get("devices") or []
        if "gpu" in (device.get("capabilities") or [])
        for device_id in device.get("device_ids") or []
    ]


def _port_of(name: str, command: list[str]) -> int:
    for index, arg in enumerate(command):
        if arg == "--port" and index + 1 < len(command):
            return int(command[index + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    raise ValueError(f"service {name}: its command has no --port, so it cannot be reached")


_REPLICA_NAME = re.compile(r"^(?P<stage>.+)-(?P<number>\d+)$")


def replica_groups(services: dict[str, ComposeService]) -> dict[str, list[str]]:
    """Each stage service and its replicas (`<stage>-N`), the stage first, then by N."""
    groups: dict[str, list[str]] = {}
    for name, service in services.items():
        if service.is_entry:
            continue
        match = _REPLICA_NAME.match(name)
        if match and match["stage"] in services and not services[match["stage"]].is_entry:
            groups.setdefault(match["stage"], []).append(name)
        else:
            groups.setdefault(name, []).insert(0, name)
    for members in groups.values():
        members[1:] = sorted(members[1:], key=lambda member: int(member.rsplit("-", 1)[1]))
    return groups


def parse_replicas(text: str) -> dict[str, int]:
    """`text-encoder=1,dit=2` -> {"text-encoder": 1, "dit": 2}."""
    counts: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        stage, equals, count = item.partition("=")
        if not equals or not count.strip().isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: use STAGE=COUNT with COUNT >= 1, e.g. dit=2")
        counts[stage.strip()] = int(count)
    return counts


def with_replicas(services: dict[str, ComposeService], counts: dict[str, int]) -> dict[str, ComposeService]:
    """The services with each stage in `counts` cloned (as `<stage>-N`) or trimmed to that many replicas,
    and every reference to a replica of a stage expanded to all of them."""
    groups = replica_groups(services)
    unknown = sorted(set(counts) - set(groups))
    if unknown:
        raise ValueError(f"--replicas names {unknown}, which are not stages; stages: {sorted(groups)}")
    members: dict[str, list[str]] = {}
    for stage, names in groups.items():
        wanted = counts.get(stage, len(names))
        kept = names[:wanted]
        number = max([1, *(int(name.rsplit("-", 1)[1]) for name in names[1:])])
        while len(kept) < wanted:
            number += 1
            kept.append(f"{stage}-{number}")
        members[stage] = kept
    stage_of = {name: stage for stage, names in groups.items() for name in names}
    references = {f"{name}:{services[name].container_port}": stage_of[name] for name in stage_of}

    def expand(text: str) -> str:
        parts = text.split(",")
        stages = {references.get(part) for part in parts}
        if len(stages) != 1 or None in stages:
            return text
        (stage,) = stages
        return ",".join(f"{name}:{services.get(name, services[stage]).container_port}" for name in members[stage])

    def expand_command(command: list[str]) -> list[str]:
        expanded = []
        for arg in command:
            option, equals, inline = arg.partition("=")
            expanded.append(f"{option}={expand(inline)}" if equals and option.startswith("--") else expand(arg))
        return expanded

    def expand_depends_on(depends_on: dict[str, str]) -> dict[str, str]:
        result: dict[str, str] = {}
        for name, condition in depends_on.items():
            for member in members[stage_of[name]] if name in stage_of else [name]:
                result.setdefault(member, condition)
        return result

    result: dict[str, ComposeService] = {}
    for name, service in services.items():
        stage = stage_of.get(name)
        if stage is None:
            result[name] = replace(
                service, command=expand_command(service.command), depends_on=expand_depends_on(service.depends_on)
            )
            continue
        if members[stage][0] in result:
            continue
        # Where a stage first appears in the file: all its replicas, declared or cloned from the stage.
        for member in members[stage]:
            source = services.get(member, services[stage])
            result[member] = replace(
                source,
                name=member,
                command=expand_command(source.command),
                depends_on=expand_depends_on(source.depends_on),
            )
    return result


def start_order(services: dict[str, ComposeService]) -> list[str]:
    """Services after everything they depend on; file order otherwise."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise ValueError(f"depends_on has a cycle through {name}")
        visiting.add(name)
        for dependency in services[name].depends_on:
            visit(dependency)
        visiting.discard(name)
        order.append(name)

    for name in services:
        visit(name)
    return order


# ---------------------------------------------------------------------------
# Rewriting a container command for this machine
# ---------------------------------------------------------------------------


def connect_host(host: str) -> str:
    """Where to connect to a server bound on `host` (a wildcard address is reached through loopback)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def rewrite_command(
    service: ComposeService,
    *,
    host: str,
    local_ports: dict[str, int],
    services: dict[str, ComposeService],
    path_map: list[tuple[str, str]],
) -> list[str]:
    """The service's command with local ports, hosts, endpoints of other services and host paths."""
    references = {f"{name}:{other.container_port}": name for name, other in services.items()}

    def value(text: str) -> str:
        if "," in text:  # a list of endpoints: the replicas of a stage
            return ",".join(value(part) for part in text.split(","))
        if text in references:
            return format_endpoint(connect_host(host), local_ports[references[text]])
        name, _, port = text.rpartition(":")
        if name in services and port.isdigit():
            raise ValueError(f"{service.name}: {text} is not {name}'s --port ({services[name].container_port})")
        return host_path(text, path_map)

    rewritten: list[str] = []
    args = iter(service.command)
    for arg in args:
        option, equals, inline = arg.partition("=")
        if arg in ("--port", "--host"):
            rewritten += [arg, str(local_ports[service.name]) if arg == "--port" else host]
            next(args, None)
        elif equals and option in ("--port", "--host"):
            rewritten.append(f"{option}={local_ports[service.name] if option == '--port' else host}")
        elif equals and option.startswith("--"):
            rewritten.append(f"{option}={value(inline)}")
        else:
            rewritten.append(value(arg))
    return rewritten


def host_path(text: str, path_map: list[tuple[str, str]]) -> str:
    """`text` with a container path (under a bind mount or a secret) replaced by its host path."""
    for host, container in sorted(path_map, key=lambda pair: len(pair[1]), reverse=True):
        if text == container or text.startswith(container + "/"):
            return host + text[len(container) :]
    return text


def gpu_environment(service: ComposeService) -> dict[str, str]:
    """The GPUs a service reserves, as a local process sees them: CUDA_VISIBLE_DEVICES lists the
    reservation's device ids (a DiT group of 4 on GPUs 0-3 sees exactly those four, as its ranks
    would in the container). A service without a reservation keeps the environment it has."""
    if not service.gpu_device_ids:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(service.gpu_device_ids)}


def free_ports(count: int, host: str, exclude: Iterable[int] = ()) -> list[int]:
    """Ports the kernel hands out now; all sockets stay open until the end so no port repeats."""
    excluded = set(exclude)
    sockets: list[socket.socket] = []
    ports: list[int] = []
    family = socket.AF_INET6 if ":" in connect_host(host) else socket.AF_INET
    try:
        while len(ports) < count:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((connect_host(host), 0))
            port = sock.getsockname()[1]
            if port not in excluded:
                ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


# ---------------------------------------------------------------------------
# Health
# ---------------------------------------------------------------------------


def is_serving(endpoint: str, timeout: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """One grpc.health.v1 check of the whole server (service name ""), over TLS when given `credentials`."""
    try:
        with (
            grpc.secure_channel(endpoint, credentials) if credentials is not None else grpc.insecure_channel(endpoint)
        ) as channel:
            request = health_pb2.HealthCheckRequest(service="")
            response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
    except grpc.RpcError:
        return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def wait_for_serving(endpoint: str, timeout: float, credentials: grpc.ChannelCredentials | None = None) -> None:
    """Waits until `endpoint` answers SERVING on grpc.health.v1 (over TLS with `credentials`); TimeoutError
    otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{endpoint} was not SERVING within {timeout:.0f}s")
        if is_serving(endpoint, timeout=min(1.0, remaining), credentials=credentials):
            return
        time.sleep(min(HEALTH_POLL_SECONDS, max(0.0, deadline - time.monotonic())))


# ---------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchSpec:
    """How one service is started on this machine."""

    name: str
    args: list[str]  # stagediff arguments, after `python -m stagediff.cli`
    environment: dict[str, str]
    port: int
    endpoint: str
    waits_for: list[str]  # services that must be SERVING first (depends_on: service_healthy)


@dataclass
class ServiceProcess:
    """A started service."""

    name: str
    args: list[str]
    port: int
    endpoint: str
    log_path: Path
    process: subprocess.Popen[bytes]
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


class LocalCluster:
    """The compose topology as local processes, started in depends_on order and stopped in reverse.

    Usable as a context manager: `with LocalCluster(model_dir) as cluster: Client(cluster.endpoint)`.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
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
    ) -> None:
        """`extra_args` go to the named service, or to every replica when it names a stage;
        `replicas` sets how many processes a stage runs (`{"dit": 2}`). `state_dir` holds the
        orchestrator's job store (default: a new temporary directory, so clusters never share one).
        Every process gets the same cluster secret: $STAGEDIFF_CLUSTER_SECRET, else a new random one."""
        self.model_dir = Path(model_dir).resolve()
        self.compose_file = Path(compose_file).resolve()
        self.port = port
        self.host = host
        self.extra_args = {name: list(args) for name, args in (extra_args or {}).items()}
        self.threads_per_stage = threads_per_stage
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.env = dict(env or {})
        self.echo_logs = echo_logs
        self.state_dir = Path(state_dir) if state_dir is not None else Path(tempfile.mkdtemp(prefix="stagediff-state-"))
        self.compose = with_replicas(load_compose(self.compose_file, {**os.environ, **self.env}), replicas or {})
        self.cluster_secret = (
            _cluster_secret_of(self.compose)
            or self.env.get(CLUSTER_SECRET_ENV)
            or os.environ.get(CLUSTER_SECRET_ENV)
            or secrets.token_urlsafe(32)
        )
        self.stage_of = {name: stage for stage, names in replica_groups(self.compose).items() for name in names}
        unknown = set(self.extra_args) - set(self.compose)
        if unknown:
            raise ValueError(f"extra_args names services that are not in {self.compose_file}: {sorted(unknown)}")
        self._services: dict[str, ServiceProcess] = {}
        self._plans: dict[str, LaunchSpec] = {}
        self._lock = threading.Lock()

    # -- planning -------------------------------------------------------

    def plan(self, local_ports: dict[str, int] | None = None) -> dict[str, LaunchSpec]:
        """Every service's local command, in start order; free ports are picked unless given."""
        order = start_order(self.compose)
        entry = next(name for name, service in self.compose.items() if service.is_entry)
        ports = dict(local_ports or {})
        if entry not in ports and self.port:
            ports[entry] = self.port
        missing = [name for name in order if name not in ports]
        ports.update(zip(missing, free_ports(len(missing), self.host, exclude=ports.values()), strict=True))

        plans: dict[str, LaunchSpec] = {}
        for name in order:
            service = self.compose[name]
            path_map = [
                (str(self.model_dir) if target == MODEL_MOUNT else source, target) for source, target in service.volumes
            ]
            args = rewrite_command(service, host=self.host, local_ports=ports, services=self.compose, path_map=path_map)
            if self.threads_per_stage and not service.is_entry:
                args += ["--threads", str(self.threads_per_stage)]
            stage = self.stage_of.get(name, name)
            if stage != name:
                args += self.extra_args.get(stage, [])
            # Fixed metrics ports of the compose file would collide between local clusters: off unless asked for.
            args = [
                "0" if index > 0 and args[index - 1] == "--metrics-port" else arg for index, arg in enumerate(args)
            ]
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
            plans[name] = LaunchSpec(
                name=name,
                args=args,
                environment={**environment, **gpu_environment(service), CLUSTER_SECRET_ENV: self.cluster_secret},
                port=ports[name],
                endpoint=format_endpoint(connect_host(self.host), ports[name]),
                waits_for=[dep for dep, condition in service.depends_on.items() if condition == "service_healthy"],
            )
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

    def start(self, timeout: float = 600.0, on_started: Callable[[ServiceProcess], None] | None = None) -> LocalCluster:
        """Starts every service and returns once each answers SERVING; on failure stops them all."""
        if self._services:
            raise RuntimeError("the cluster is already started")
        deadline = time.monotonic() + timeout
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="stagediff-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            plans = self._plans = self.plan()
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
        log_file = log_path.open(log_mode)
        process = subprocess.Popen(
            [sys.executable, "-m", "stagediff.cli", *plan.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if self.echo_logs else log_file,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
        )
        service = ServiceProcess(plan.name, plan.args, plan.port, plan.endpoint, log_path, process, log_file)
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
                if remaining > 0 and is_serving(service.endpoint, timeout=min(1.0, remaining)):
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
    try:
        if group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
    except ProcessLookupError:
        pass


def _echo(stream: IO[bytes], log_file: IO[bytes], prefix: str) -> None:
    """Copies a child's output into its log file and, prefixed, onto our stderr."""
    for line in iter(stream.readline, b""):
        log_file.write(line)
        log_file.flush()
        sys.stderr.write(prefix + line.decode(errors="replace"))
        sys.stderr.flush()
    stream.close()


# ---------------------------------------------------------------------------
# `stagediff up`
# ---------------------------------------------------------------------------

# Stage options of `stagediff up`, and the stage each one is passed to. Parallel,
# offload and quantization flags join this list with the stages that implement them.
STAGE_FLAGS: list[tuple[list[str], str, dict[str, Any]]] = [
    (["--embedding-cache-bytes"], "text-encoder", {"type": int}),
    (["--embedding-cache-size"], "text-encoder", {"type": int}),
    (["--ulysses-degree", "--usp"], "dit", {"type": int}),
    (["--ring-degree", "--ring"], "dit", {"type": int}),
    (["--cfg-parallel-size"], "dit", {"type": int, "choices": [1, 2]}),
    (["--tensor-parallel-size"], "dit", {"type": int}),
    (["--use-hsdp"], "dit", {"action": "store_true"}),
    (["--hsdp-shard-size"], "dit", {"type": int}),
    (["--hsdp-replicate-size"], "dit", {"type": int}),
    (["--quantization"], "dit", {"choices": ["fp8", "int8"]}),
    (["--ignored-layers"], "dit", {}),
    (["--enable-cpu-offload"], "dit", {"action": "store_true"}),
    (["--enable-layerwise-offload"], "dit", {"action": "store_true"}),
    (["--offload-blocks"], "dit", {"type": int}),
    (["--vae-patch-parallel-size"], "vae", {"type": int}),
    (["--vae-use-tiling"], "vae", {"action": "store_true"}),
    (["--vae-tile-sample-min-height"], "vae", {"type": int}),
    (["--vae-tile-sample-min-width"], "vae", {"type": int}),
    (["--vae-tile-sample-stride-height"], "vae", {"type": int}),
    (["--vae-tile-sample-stride-width"], "vae", {"type": int}),
    (["--interp-model-path"], "interp", {}),
]


def stage_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """The stage options given to `stagediff up`, grouped by the service they go to."""
    extra: dict[str, list[str]] = {}
    if getattr(args, "tenants", None):
        extra["orchestrator"] = ["--tenants", str(Path(args.tenants).resolve())]
    for names, service, _ in STAGE_FLAGS:
        value = getattr(args, names[0].lstrip("-").replace("-", "_"), None)
        if value is None or value is False:
            continue
        extra.setdefault(service, []).extend([names[0]] if value is True else [names[0], str(value)])
    return extra


class _Shutdown(Exception):
    """SIGINT or SIGTERM reached `stagediff up`."""


def _raise_shutdown(signum: int, frame: object) -> None:
    raise _Shutdown(signum)


def _up(args: argparse.Namespace) -> int:
    try:
        cluster = LocalCluster(
            args.model,
            compose_file=args.file,
            port=args.port,
            host=args.host,
            extra_args=stage_flags(args),
            threads_per_stage=args.threads_per_stage,
            log_dir=args.log_dir,
            echo_logs=args.echo_logs,
            replicas=args.replicas,
            state_dir=args.state_dir,
        )
    except (OSError, ValueError, yaml.YAMLError) as error:
        print(f"stagediff up: {error}", file=sys.stderr, flush=True)
        return 2

    def started(service: ServiceProcess) -> None:
        print(f"started {service.name} pid={service.pid} endpoint={service.endpoint}", flush=True)

    previous = {sig: signal.signal(sig, _raise_shutdown) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            cluster.start(timeout=args.startup_timeout, on_started=started)
        except RuntimeError as error:
            print(f"stagediff up: {error}", file=sys.stderr, flush=True)
            return 1
        print(f"logs in {cluster.log_dir}", file=sys.stderr, flush=True)
        print(f"ready {cluster.endpoint}", flush=True)
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
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `stagediff up` to the CLI."""
    up = commands.add_parser(
        "up",
        help="run the docker-compose topology as local processes",
        description="Starts every service of the compose file as a local process and prints "
        "'ready HOST:PORT' once all are SERVING; SIGINT or SIGTERM stops them.",
    )
    up.add_argument("--model", required=True, help="diffusers checkpoint directory (mounted at /models/model)")
    up.add_argument("--port", type=int, default=50051, help="orchestrator port (0: a free port)")
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
    stage_options = up.add_argument_group("stage options", "passed to the stage they concern")
    for names, service, options in STAGE_FLAGS:
        stage_options.add_argument(*names, default=None, help=f"passed to {service}", **options)
    up.set_defaults(func=_up)
