"""The deploy/ compose files and what the local cluster reads from them: paths, the stages and their ports, and
the HTTP gateway's own startup check."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stagediff.local.launch import free_ports

REPOSITORY = Path(__file__).resolve().parents[2]
DEPLOY = REPOSITORY / "deploy"
GPU_COMPOSE_FILE = DEPLOY / "docker-compose.yml"
CPU_COMPOSE_FILE = DEPLOY / "docker-compose.cpu.yml"
STAGES = {"text-encoder": 50061, "dit": 50062, "vae": 50063, "interp": 50064}


# The stages every chain needs; the interpolator is optional (families/).
REQUIRED_STAGES = ("text-encoder", "dit", "vae")


# The HTTP gateway (`stagediff serve http`): a client of the orchestrator's public port, published beside it.
GATEWAY = "gateway"
GATEWAY_PORT = 8000


def gateway_refusal(args: Any) -> str | None:
    """What `stagediff serve http` refuses to start for (its own check): plain HTTP beyond loopback, where Bearer
    keys would cross the network in clear, unless told --insecure; a TLS certificate without its key."""
    from services.gateway.config import GatewayConfig
    from services.gateway.service import startup_problem

    return startup_problem(GatewayConfig.from_options(args))


@contextlib.contextmanager
def readyz_server(status: int | None) -> Iterator[int]:
    """A stand-in for the gateway on a free port: GET /readyz answers `status` (None: nothing listens); yields the
    port."""
    if status is None:
        yield free_ports(1, "127.0.0.1")[0]
        return

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status if self.path == "/readyz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            """Quiet: the test reads the answers, not the server's log lines."""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def dit_world_size(args: Any) -> int:
    """The ranks a DiT's parsed parallel flags ask for."""
    from dit_svc.config import parallel_config

    return parallel_config(
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        cfg_parallel_size=args.cfg_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        use_hsdp=args.use_hsdp,
        hsdp_shard_size=args.hsdp_shard_size,
        hsdp_replicate_size=args.hsdp_replicate_size,
    ).total_ranks
