"""Reading a docker-compose file as compose does, and shaping its services for one run.

The compose files in deploy/ are the one description of a cluster. `load_compose` reads one as compose
does (`extends`, `env_file`, `secrets`, `environment`, variables, bind mounts, GPU reservations) into a
`ComposeService` per service. Then, for the model being served and the replicas asked for:

- `for_chain` keeps the stages the model's family chains (families/): a stage kind outside the chain is
  left out, with every reference to it in the orchestrator's command and in `depends_on`;
- `with_replicas` makes a stage several processes: services named `<stage>-N` (`dit-2`) are replicas of
  `<stage>`, a count clones the stage's service (or trims it) to that many, and every SERVICE:PORT
  reference to one replica of a stage becomes the comma-separated list of all of them, the form the
  orchestrator's stage flags take.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from families.base import Family
from services.stage_table import STAGES
from stagediff.up_options import DEFAULT_COMPOSE_FILE_NAME

ENTRY_COMMAND = ["serve", "orchestrator"]
# The HTTP gateway: a client of the orchestrator's public port, ready once GET /readyz answers 200.
HTTP_COMMAND = ["serve", "http"]
SECRETS_MOUNT = "/run/secrets"  # where compose mounts each of a service's secrets, as a file named after it


def shipped_compose_file(name: str) -> Path:
    """A compose file that ships with stagediff: package data of `stagediff.deploy`, which pyproject.toml maps
    to the folder deploy/ (so an installed wheel has them), or deploy/ itself beside the packages where the
    mapping does not reach (a source tree, an editable install)."""
    try:
        # A package on disk (what setuptools installs) gives a path; Traversable is the general case.
        return Path(str(importlib.resources.files("stagediff.deploy").joinpath(name)))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "deploy" / name


# The CPU variant, which runs on any machine; `-f deploy/docker-compose.yml` runs the GPU topology instead.
DEFAULT_COMPOSE_FILE = shipped_compose_file(DEFAULT_COMPOSE_FILE_NAME)

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
    # The compose file's service this one was made from for one of several models (stagediff/local/models.py),
    # whose options it takes; empty for a service of the file.
    origin: str = ""

    @property
    def is_entry(self) -> bool:
        """The orchestrator is the cluster's front door; the others are stages, and the HTTP gateway in front of it."""
        return self.command[:2] == ENTRY_COMMAND

    @property
    def is_http(self) -> bool:
        """The HTTP gateway (`serve http`): no gRPC health service; its readiness is GET /readyz."""
        return self.command[:2] == HTTP_COMMAND

    @property
    def stage_kind(self) -> str | None:
        """The stage kind the service runs (`serve dit ...`: "dit"), or None for anything else (the orchestrator,
        the HTTP gateway)."""
        kind = self.command[1] if self.command[:1] == ["serve"] and len(self.command) > 1 else None
        return kind if kind in STAGES else None


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
    """Each stage service and its replicas (`<stage>-N`), the stage first, then by N. Services that run no stage
    (the orchestrator, the HTTP gateway) are in no group."""
    groups: dict[str, list[str]] = {}
    for name, service in services.items():
        if service.stage_kind is None:
            continue
        match = _REPLICA_NAME.match(name)
        if match and match["stage"] in services and services[match["stage"]].stage_kind is not None:
            groups.setdefault(match["stage"], []).append(name)
        else:
            groups.setdefault(name, []).insert(0, name)
    for members in groups.values():
        members[1:] = sorted(members[1:], key=lambda member: int(member.rsplit("-", 1)[1]))
    return groups


def for_chain(services: dict[str, ComposeService], *families: Family) -> dict[str, ComposeService]:
    """The services that serve models of `families`: the stages of their chains (an optional one where the file
    has it), the orchestrator, and any service that runs no stage. References to the stages left out go
    from every command (`--interp interp:50064`) and every depends_on. A stage a chain cannot do without
    and the file lacks is refused, naming it."""
    kinds = {service.stage_kind for service in services.values()}
    for family in families:
        missing = [stage for stage in family.required_stages() if stage not in kinds]
        if missing:
            raise ValueError(
                f"{family.name} runs through the stages {' -> '.join(family.chain)}, but no service of the compose "
                f"file runs {', '.join(f'`serve {stage}`' for stage in missing)}"
            )
    left_out = {
        name
        for name, service in services.items()
        if service.stage_kind is not None and not any(family.uses_stage(service.stage_kind) for family in families)
    }
    references = {f"{name}:{services[name].container_port}" for name in left_out}

    def names_left_out(text: str) -> bool:
        return all(part in references for part in text.split(","))

    def without_references(command: list[str]) -> list[str]:
        kept: list[str] = []
        index = 0
        while index < len(command):
            option, equals, inline = command[index].partition("=")
            value = inline if equals else (command[index + 1] if index + 1 < len(command) else "")
            if option.startswith("--") and value and names_left_out(value):
                index += 1 if equals else 2
            else:
                kept.append(command[index])
                index += 1
        return kept

    return {
        name: replace(
            service,
            command=without_references(service.command),
            depends_on={dep: condition for dep, condition in service.depends_on.items() if dep not in left_out},
        )
        for name, service in services.items()
        if name not in left_out
    }


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
        if not all(part in references for part in parts):
            return text
        stages = {references[part] for part in parts}
        if len(stages) != 1:
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
        service_stage = stage_of.get(name)
        if service_stage is None:
            result[name] = replace(
                service, command=expand_command(service.command), depends_on=expand_depends_on(service.depends_on)
            )
            continue
        if members[service_stage][0] in result:
            continue
        # Where a stage first appears in the file: all its replicas, declared or cloned from the stage.
        for member in members[service_stage]:
            source = services.get(member, services[service_stage])
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
