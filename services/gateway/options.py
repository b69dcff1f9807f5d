"""The options of `stagediff serve http` (no torch here: `stagediff up` and the tests read them).

The HTTP gateway is a client of the orchestrator: it holds no jobs and no tenants of its own, so its options are
where it listens, how it reaches the orchestrator, and the bounds on what one HTTP request may carry.
"""

from __future__ import annotations

import argparse

from services.auth import add_tls_arguments
from services.environment_options import OptionParser
from services.images import MAX_IMAGE_BYTES
from services.logging_setup import add_logging_arguments
from services.server import DEFAULT_HOST

DEFAULT_PORT = 8000
DEFAULT_ORCHESTRATOR = "localhost:50051"
# A request's body: the JSON fields and, for image-to-video and edits, the input images. The largest legitimate
# body is the orchestrator's limit on image bytes as one base64 data URL in JSON, with 1 MiB for the other fields.
DEFAULT_MAX_BODY_BYTES = 4 * -(-MAX_IMAGE_BYTES // 3) + (1 << 20)
# How long POST /v1/images/generations and /v1/images/edits wait for their jobs before answering 504 (the jobs
# go on; their ids are in the error so that a client can fetch them).
DEFAULT_IMAGE_WAIT_S = 600.0
# Connections and requests served at once; beyond, 503. Each open progress stream or video download holds one,
# and one WatchJob stream on the orchestrator (whose own --max-concurrent-rpcs is 1024).
# When the open connections reach it, the one idle longest is closed to make room (connections.py).
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
# A request's line and headers, from its connection's opening (or the previous answer): a slow mobile client
# sends them in well under a second.
DEFAULT_HEADER_TIMEOUT_S = 10.0
# A request's body, from its headers: the largest body at about 200 KB/s.
DEFAULT_BODY_TIMEOUT_S = 120.0
# Video downloads one key may have open at once (each reads a whole file from the orchestrator); beyond, 429.
DEFAULT_MAX_DOWNLOADS_PER_KEY = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address to bind (default %(default)s: this machine only; 0.0.0.0 for every interface, as in a container)",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--orchestrator",
        default=DEFAULT_ORCHESTRATOR,
        metavar="HOST:PORT",
        help="the orchestrator's public gRPC endpoint (default: %(default)s)",
    )
    parser.add_argument(
        "--orchestrator-ca-cert",
        default=None,
        metavar="PEM",
        help="connect to the orchestrator with TLS, verified against this CA (default: plaintext)",
    )
    parser.add_argument(
        "--orchestrator-tls",
        action="store_true",
        help="connect to the orchestrator with TLS verified against the system's roots",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body, JSON or multipart (default: %(default)s); beyond, 413",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="connections and requests served at once; beyond, 503, and a new connection closes the one idle "
        "longest (default: %(default)s)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="a request's headers must be complete this long after its connection opened or its previous answer; "
        "beyond, the connection is closed (default: %(default)s)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="a request's body must be complete this long after its headers; beyond, the connection is closed "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-downloads-per-key",
        type=int,
        default=DEFAULT_MAX_DOWNLOADS_PER_KEY,
        help="video downloads one API key may have open at once; beyond, 429 (default: %(default)s)",
    )
    parser.add_argument(
        "--openapi",
        action="store_true",
        help="serve the OpenAPI document at /openapi.json, to callers with an API key (default: off; there is "
        "no /docs page)",
    )
    parser.add_argument(
        "--playground",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the web playground, a page to try prompts on, at /playground/ and redirect / to it (default: "
        "on; --no-playground, or STAGEDIFF_PLAYGROUND=false, leaves both paths unserved)",
    )
    parser.add_argument(
        "--image-wait",
        type=float,
        default=DEFAULT_IMAGE_WAIT_S,
        metavar="SECONDS",
        help="how long an image request waits for its jobs before 504 (default: %(default)s)",
    )
    parser.add_argument("--log-level", default="INFO")
    add_logging_arguments(parser)
    # HTTPS on the gateway's port: the same certificate and key flags (and secrets) as the orchestrator's port.
    add_tls_arguments(parser)
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve plain HTTP on a non-loopback --host, where API keys would cross the network in clear "
        "(default: refuse; put a TLS-terminating proxy in front, or give --tls-cert and --tls-key)",
    )


def build_parser() -> OptionParser:
    parser = OptionParser(
        prog="stagediff serve http",
        description="The HTTP gateway: OpenAI-compatible /v1/videos, /v1/images and /v1/models in front of the "
        "orchestrator, with the same tenants, keys, quotas and job ids as its gRPC API, and a web playground at "
        "/playground/.",
    )
    add_arguments(parser)
    return parser
