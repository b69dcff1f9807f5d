"""The HTTP gateway's configuration: built once in `main` from its parsed options, checked, then handed down.

`GatewayConfig.from_options` reads the parsed `stagediff serve http` options (options.py); `__post_init__`
refuses counts and timeouts that leave no room to work, with the message `main` gives the parser's error.
Whether the gateway may serve where it is asked to (TLS, exposure) is `service.startup_problem`'s decision,
made after the options are valid. Nothing below `main` reads the parsed options.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.server_config import LoggingConfig, TlsConfig

# Longest any of the gateway's timeouts may be.
MAX_TIMEOUT_S = 86400


@dataclass(frozen=True)
class GatewayConfig:
    """What `stagediff serve http` runs with (options.py has each flag's help)."""

    host: str
    """Address bound (--host)."""
    port: int
    """Port bound (--port)."""
    insecure: bool
    """Serve plain HTTP beyond loopback (--insecure)."""
    tls: TlsConfig
    """HTTPS certificate, key and client CA (--tls-cert, --tls-key, --tls-client-ca)."""
    logging: LoggingConfig
    """How the gateway logs."""
    orchestrator: str
    """The orchestrator's public gRPC endpoint, HOST:PORT (--orchestrator)."""
    orchestrator_ca_cert: str | None
    """CA that the orchestrator's TLS certificate is verified against (--orchestrator-ca-cert); None: none."""
    orchestrator_tls: bool
    """Connect to the orchestrator with TLS verified against the system's roots (--orchestrator-tls)."""
    max_body_bytes: int
    """Largest request body, 1 or more (--max-body-bytes)."""
    max_concurrent_requests: int
    """Connections and requests served at once, 1 or more (--max-concurrent-requests)."""
    max_downloads_per_key: int
    """Video downloads one API key may have open at once, 1 or more (--max-downloads-per-key)."""
    image_wait_s: float
    """How long an image request waits for its jobs (--image-wait)."""
    header_timeout_s: float
    """Time for a request's headers to arrive (--header-timeout)."""
    body_timeout_s: float
    """Time for a request's body to arrive after its headers (--body-timeout)."""
    openapi: bool
    """Serve /openapi.json to callers with an API key (--openapi)."""
    playground: bool
    """Serve the web playground at /playground/ and redirect / to it (--playground, --no-playground)."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--max-body-bytes", self.max_body_bytes),
            ("--max-concurrent-requests", self.max_concurrent_requests),
            ("--max-downloads-per-key", self.max_downloads_per_key),
        ):
            if value < 1:
                raise ValueError(f"{flag} {value}: use 1 or more")
        for flag, seconds in (
            ("--image-wait", self.image_wait_s),
            ("--header-timeout", self.header_timeout_s),
            ("--body-timeout", self.body_timeout_s),
        ):
            if not 0 < seconds <= MAX_TIMEOUT_S:
                raise ValueError(f"{flag} {seconds}: use more than 0 and at most {MAX_TIMEOUT_S} seconds")

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> GatewayConfig:
        """The configuration the parsed options give; raises ValueError naming the first flag out of bounds."""
        return cls(
            host=args.host,
            port=args.port,
            insecure=args.insecure,
            tls=TlsConfig.from_options(args),
            logging=LoggingConfig.from_options(args),
            orchestrator=args.orchestrator,
            orchestrator_ca_cert=args.orchestrator_ca_cert,
            orchestrator_tls=args.orchestrator_tls,
            max_body_bytes=args.max_body_bytes,
            max_concurrent_requests=args.max_concurrent_requests,
            max_downloads_per_key=args.max_downloads_per_key,
            image_wait_s=args.image_wait,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            openapi=args.openapi,
            playground=args.playground,
        )
