"""`stagediff serve http`: the HTTP gateway (app.py) on uvicorn, in front of the orchestrator's gRPC API."""

from __future__ import annotations

import argparse
import contextlib
import logging
import ssl

import uvicorn

from services.allocator import return_large_buffers_to_the_system
from services.environment_options import parse_args
from services.gateway.app import create_app
from services.gateway.connections import guarded_protocol
from services.gateway.options import build_parser
from services.gateway.orchestrator import Orchestrator
from services.ports import bind_problem
from services.server import configure_logging, is_loopback

logger = logging.getLogger(__name__)
PROG = "stagediff serve http"


def startup_problem(args: argparse.Namespace) -> str | None:
    """Why the gateway refuses to start with `args`, or None: a certificate without its key, or plain HTTP where
    other machines reach it (Bearer keys in clear) without --insecure."""
    if (args.tls_cert is None) != (args.tls_key is None):
        return "--tls-cert and --tls-key go together"
    if args.tls_cert is None and not args.insecure and not is_loopback(args.host):
        return (
            f"--host {args.host} without --tls-cert and --tls-key would carry API keys in clear; serve HTTPS, "
            "or put a TLS-terminating proxy in front and pass --insecure"
        )
    return None


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    for flag, value in (
        ("--max-body-bytes", args.max_body_bytes),
        ("--max-concurrent-requests", args.max_concurrent_requests),
        ("--max-downloads-per-key", args.max_downloads_per_key),
    ):
        if value < 1:
            parser.error(f"{flag} {value}: use 1 or more")
    for flag, seconds in (
        ("--image-wait", args.image_wait),
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
    ):
        if not 0 < seconds <= 86400:
            parser.error(f"{flag} {seconds}: use more than 0 and at most 86400 seconds")
    problem = startup_problem(args) or bind_problem(args.host, args.port, "--port")
    if problem is not None:
        raise SystemExit(f"{PROG}: {problem}")
    configure_logging(args.log_level, args.log_format)
    return_large_buffers_to_the_system()  # clients' images and uploads pass through here
    orchestrator = Orchestrator(args.orchestrator, ca_cert=args.orchestrator_ca_cert, tls=args.orchestrator_tls)
    app = create_app(
        orchestrator,
        max_body_bytes=args.max_body_bytes,
        image_wait_s=args.image_wait,
        max_downloads_per_key=args.max_downloads_per_key,
        openapi=args.openapi,
    )
    tls = {}
    if args.tls_cert is not None:
        tls = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key}
        if args.tls_client_ca is not None:
            tls |= {"ssl_ca_certs": args.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    logger.info("serving HTTP on %s:%d in front of the orchestrator at %s", args.host, args.port, args.orchestrator)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            limit_concurrency=args.max_concurrent_requests,
            http=guarded_protocol(args.header_timeout, args.body_timeout),
            log_config=None,
            access_log=False,
            **tls,
        )
