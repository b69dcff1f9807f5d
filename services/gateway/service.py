"""`stagediff serve http`: the HTTP gateway (app.py) on uvicorn, in front of the orchestrator's gRPC API."""

from __future__ import annotations

import contextlib
import logging
import ssl
from typing import Any

import uvicorn

from services.allocator import return_large_buffers_to_the_system
from services.environment_options import parse_args
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.connections import guarded_protocol
from services.gateway.options import build_parser
from services.gateway.orchestrator import Orchestrator
from services.ports import bind_problem
from services.server import configure_logging, is_loopback

logger = logging.getLogger(__name__)
PROG = "stagediff serve http"


def startup_problem(config: GatewayConfig) -> str | None:
    """Why the gateway refuses to start with `config`, or None: a certificate without its key, or plain HTTP
    where other machines reach it (Bearer keys in clear) without --insecure."""
    tls = config.tls
    if (tls.cert_file is None) != (tls.key_file is None):
        return "--tls-cert and --tls-key go together"
    if tls.cert_file is None and not config.insecure and not is_loopback(config.host):
        return (
            f"--host {config.host} without --tls-cert and --tls-key would carry API keys in clear; serve HTTPS, "
            "or put a TLS-terminating proxy in front and pass --insecure"
        )
    return None


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        config = GatewayConfig.from_options(args)
    except ValueError as error:
        parser.error(str(error))
    problem = startup_problem(config) or bind_problem(config.host, config.port, "--port")
    if problem is not None:
        raise SystemExit(f"{PROG}: {problem}")
    configure_logging(config.logging.level, config.logging.format)
    return_large_buffers_to_the_system()  # clients' images and uploads pass through here
    orchestrator = Orchestrator(config.orchestrator, ca_cert=config.orchestrator_ca_cert, tls=config.orchestrator_tls)
    app = create_app(
        orchestrator,
        max_body_bytes=config.max_body_bytes,
        image_wait_s=config.image_wait_s,
        max_downloads_per_key=config.max_downloads_per_key,
        openapi=config.openapi,
        playground=config.playground,
    )
    tls: dict[str, Any] = {}
    if config.tls.cert_file is not None:
        tls = {"ssl_certfile": config.tls.cert_file, "ssl_keyfile": config.tls.key_file}
        if config.tls.client_ca_file is not None:
            tls |= {"ssl_ca_certs": config.tls.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    logger.info(
        "serving HTTP on %s:%d in front of the orchestrator at %s", config.host, config.port, config.orchestrator
    )
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(
            app,
            host=config.host,
            port=config.port,
            limit_concurrency=config.max_concurrent_requests,
            http=guarded_protocol(config.header_timeout_s, config.body_timeout_s),
            log_config=None,
            access_log=False,
            **tls,
        )
