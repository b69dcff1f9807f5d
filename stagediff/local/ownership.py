"""Making sure that the services a local cluster reports ready are its own.

Before anything starts (and so before any model loads), `startup_problems` finds what another running server or
cluster already holds: each port the cluster is to listen on, and the state dir, whose LOCK the orchestrator
that uses it holds (services/orchestrator/store/database.py). Each problem is one line naming the port or the directory
and the `stagediff up` flag that set it.

Once they run, a service counts as ready only when the answer carries the launch id the cluster gave that very
process (services/launch_id.py): a port answering is not enough, since until a new service binds its port (or
fails to, and exits) an older server may still answer there, as may a server on the far side of a wildcard
address. gRPC services send it with their health answer, the HTTP gateway in its GET /readyz body.
"""

from __future__ import annotations

import fcntl
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launch_id import LAUNCH_ID_METADATA
from services.orchestrator.store import LOCK_NAME
from services.ports import bind_problem

# The largest /readyz body read: a few fields of JSON.
MAX_READINESS_BYTES = 4096


def state_dir_problem(state_dir: Path) -> str | None:
    """Why `state_dir` cannot be this cluster's job store now (its LOCK is held by a running orchestrator),
    in one line naming --state-dir; None when it can."""
    try:
        with open(state_dir / LOCK_NAME, "rb") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # released as the file closes
    except FileNotFoundError:
        return None  # no orchestrator ever used it, or not yet: the orchestrator creates it
    except BlockingIOError:
        return (
            f"--state-dir {state_dir} is in use by another running cluster (its orchestrator holds "
            f"{state_dir / LOCK_NAME}); stop that cluster, or choose another --state-dir"
        )
    except OSError as error:
        return f"--state-dir {state_dir} cannot be used: {error.strerror or error}"
    return None


def startup_problems(host: str, ports: dict[str, tuple[int, str]], state_dir: Path) -> list[str]:
    """One line for each port of `ports` (service -> (port, the flag that set it)) that cannot be bound on
    `host`, and for a state dir in use."""
    problems = [bind_problem(host, port, flag) for port, flag in ports.values()]
    problems.append(state_dir_problem(state_dir))
    return [problem for problem in problems if problem is not None]


def grpc_ready_as(endpoint: str, launch_id: str, timeout: float) -> bool:
    """Whether `endpoint` answers SERVING on grpc.health.v1 with the launch id `launch_id`."""
    try:
        with grpc.insecure_channel(endpoint) as channel:
            request = health_pb2.HealthCheckRequest(service="")
            response, call = health_pb2_grpc.HealthStub(channel).Check.with_call(request, timeout=timeout)
    except grpc.RpcError:
        return False
    answered_by = dict(call.initial_metadata() or ()).get(LAUNCH_ID_METADATA)
    return response.status == health_pb2.HealthCheckResponse.SERVING and answered_by == launch_id


def http_ready_as(url: str, launch_id: str, timeout: float) -> bool:
    """Whether GET `url` (the gateway's /readyz) answers 2xx with {"launch_id": `launch_id`}. An https URL is not
    verified: the launch id, not the certificate, tells whose process answers."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            body = json.loads(response.read(MAX_READINESS_BYTES))
    except (urllib.error.URLError, OSError, ValueError):  # HTTPError (a 503) is a URLError
        return False
    return isinstance(body, dict) and body.get("launch_id") == launch_id
