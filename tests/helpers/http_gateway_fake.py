"""The HTTP gateway in process (fastapi's TestClient) in front of a real GenerationServicer with fake stages.

The orchestrator is test_public_admission.py's: the real servicer, its interceptors (tenant keys, field
bounds) and its port's message limit, with stages that never run a model; its jobs wait until it stops. The
gateway is the real app with its real gRPC client; requests reach it without a socket, so a test can send what
an HTTP client library would refuse to (a header of raw bytes). No server error is raised into the test: a
500 is answered as a 500, for the test to see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from fastapi.testclient import TestClient

from services.gateway.app import create_app
from services.gateway.orchestrator import Orchestrator as GatewayOrchestrator
from services.orchestrator.tenants import TenantRegistry, hash_api_key, new_api_key
from tests.helpers.fake_orchestrator import Orchestrator

# The gateway's default body limit: larger than the orchestrator's port takes, as deployed.
MAX_BODY_BYTES = 64 << 20


@contextlib.contextmanager
def gateway(state_dir: Path, *, image_wait_s: float = 5.0, playground: bool = True) -> Iterator[tuple[TestClient, str]]:
    """(client, a tenant's key): the gateway in front of an orchestrator with one tenant. The image routes wait
    `image_wait_s` for jobs that never finish here, then answer 504; `playground` serves the web playground."""
    key = new_api_key()
    tenants = TenantRegistry.from_dict({"tenants": [{"name": "tenant", "api_keys": [hash_api_key(key)]}]})
    orchestrator = Orchestrator(state_dir, tenants)
    app = create_app(
        GatewayOrchestrator(f"127.0.0.1:{orchestrator.port}"),
        max_body_bytes=MAX_BODY_BYTES,
        image_wait_s=image_wait_s,
        playground=playground,
    )
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, key
    finally:
        orchestrator.stop()
