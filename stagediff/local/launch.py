"""Turning a compose service into a process on this machine.

Every service gets a free local port; SERVICE:PORT references (lists of them too) point at those ports;
container paths (the model volume, each secret under /run/secrets, bind mounts) point at host paths, in
the command and in the environment; a GPU reservation becomes the process's CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from stagediff.local.compose import ComposeService


@dataclass(frozen=True)
class LaunchSpec:
    """How one service is started on this machine."""

    name: str
    args: list[str]  # stagediff arguments, after `python -m stagediff.cli`
    environment: dict[str, str]
    port: int
    endpoint: str
    waits_for: list[str]  # services that must be SERVING first (depends_on: service_healthy)
    # An HTTP service's readiness URL (the gateway's GET /readyz); None: grpc.health.v1 on `endpoint`.
    ready_url: str | None = None


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


def orchestrator_replicas(
    plans: dict[str, LaunchSpec],
    entry: str,
    count: int,
    host: str,
    state_dir: Path,
    *,
    taken_ports: Iterable[int] = (),
) -> dict[str, LaunchSpec]:
    """`plans` with the orchestrator (`entry`) cloned into `count` replicas (`entry`, `entry`-2, ...), each
    advertising its own address to the others and keeping its spool in a folder of its own, started right after
    it; the services that call the orchestrator are given every replica."""
    base = plans[entry]
    replicas = [replace(base, args=[*base.args, "--advertise", base.endpoint])]
    for number, port in enumerate(free_ports(count - 1, host, exclude=taken_ports), start=2):
        endpoint = format_endpoint(connect_host(host), port)
        args = with_option(base.args, "--port", str(port))
        args = with_option(args, "--state-dir", str(state_dir / f"replica-{number}"))
        replicas.append(
            replace(base, name=f"{entry}-{number}", args=[*args, "--advertise", endpoint], port=port, endpoint=endpoint)
        )
    every = ",".join(replica.endpoint for replica in replicas)
    ordered: dict[str, LaunchSpec] = {}
    for name, plan in plans.items():
        if name == entry:
            ordered.update((replica.name, replica) for replica in replicas)
        else:
            ordered[name] = replace(plan, args=[every if arg == base.endpoint else arg for arg in plan.args])
    return ordered


def with_option(args: list[str], option: str, value: str) -> list[str]:
    """`args` with every value of `option` replaced (or the option added)."""
    if option not in args:
        return [*args, option, value]
    return [value if index > 0 and args[index - 1] == option else arg for index, arg in enumerate(args)]
