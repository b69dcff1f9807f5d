"""Asking a local service whether it is up: grpc.health.v1 for the gRPC services, GET /readyz for the gateway.

`is_serving` and `is_http_ready` ask whoever answers on the port; `stagediff up` asks with ownership.py, which
also wants the answer to come from the process it started.
"""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HEALTH_POLL_SECONDS = 0.25


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
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


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


def is_http_ready(url: str, timeout: float = 1.0) -> bool:
    """One GET of an HTTP readiness URL (the gateway's /readyz): True on a 2xx answer. An https URL is not
    verified: it is this machine's own process, asked whether it is ready, not who it is."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return bool(200 <= response.status < 300)
    except (urllib.error.URLError, OSError, ValueError):  # HTTPError (a 503) is a URLError
        return False


def wait_for_http_ready(url: str, timeout: float) -> None:
    """Waits until GET `url` answers 2xx; TimeoutError otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f}s")
        if is_http_ready(url, timeout=min(1.0, remaining)):
            return
        time.sleep(min(HEALTH_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
