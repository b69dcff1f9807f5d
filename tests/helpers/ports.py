"""Servers that take a port before the cluster does: a foreign gRPC server and a foreign /readyz."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

STARTUP_TIMEOUT_S = 120


@contextlib.contextmanager
def foreign_grpc_server() -> Iterator[str]:
    """A gRPC server that answers SERVING to health checks, started by nobody who gave it a launch id."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@contextlib.contextmanager
def foreign_readyz(launch_id: str | None = None) -> Iterator[str]:
    """An HTTP server whose GET /readyz answers 200 {"status": "ready"} (with `launch_id`, when given)."""
    body = json.dumps({"status": "ready", **({"launch_id": launch_id} if launch_id else {})}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/readyz"
    finally:
        server.shutdown()
        server.server_close()
