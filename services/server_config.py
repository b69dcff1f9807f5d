"""The configuration sections every `stagediff serve` shares, built once in a service's `main`.

Each section is a frozen dataclass read from the parsed options by `from_options`, which is the only place a
section touches them; `__post_init__` refuses values that leave no room to work with a ValueError naming the
flag, which `main` turns into the service's one-line refusal (`stagediff serve <target>: <message>`).
The options themselves are declared beside their helpers (services/server.py, services/auth.py,
services/logging_setup.py, services/metrics.py). TLS files are checked when their credentials are built
(services/auth.py: `server_credentials_for`), because the HTTP gateway reads the same flags its own way.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TlsConfig:
    """A server's TLS files: `--tls-cert`, `--tls-key`, `--tls-client-ca` (none given: plaintext)."""

    cert_file: str | None = None
    """PEM certificate chain served (--tls-cert)."""
    key_file: str | None = None
    """PEM private key of the certificate (--tls-key)."""
    client_ca_file: str | None = None
    """PEM CA that client certificates must be signed by (--tls-client-ca); None: no client certificates."""

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> TlsConfig:
        """The TLS files the parsed options name."""
        return cls(cert_file=args.tls_cert, key_file=args.tls_key, client_ca_file=args.tls_client_ca)


@dataclass(frozen=True)
class LoggingConfig:
    """How a service logs: `--log-level` and `--log-format` (services/logging_setup.py)."""

    level: str = "INFO"
    """Level name of the root logger (--log-level)."""
    format: str = "text"
    """`text` or `json` lines (--log-format)."""

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> LoggingConfig:
        """The logging the parsed options ask for."""
        return cls(level=args.log_level, format=args.log_format)


@dataclass(frozen=True)
class ServerConfig:
    """A gRPC server's address, limits, credentials, logging and metrics (options of every gRPC service)."""

    host: str
    """Address bound (--host)."""
    port: int
    """Port bound (--port)."""
    max_concurrent_rpcs: int
    """Calls served at once; beyond, RESOURCE_EXHAUSTED (--max-concurrent-rpcs, 1 or more)."""
    max_health_watchers: int
    """grpc.health.v1 Watch streams open at once (--max-health-watchers, 0 up to less than the calls)."""
    metrics_port: int
    """Port of the Prometheus /metrics endpoint on `host`; 0: off (--metrics-port)."""
    insecure: bool
    """Serve without a cluster secret, answering any caller (--insecure)."""
    cluster_secret_file: str | None
    """File holding the cluster's shared secret (--cluster-secret-file); None: the environment's, if any."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    """The TLS files served with."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """How the server logs."""

    def __post_init__(self) -> None:
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"--max-concurrent-rpcs {self.max_concurrent_rpcs}: use 1 or more")
        if not 0 <= self.max_health_watchers < self.max_concurrent_rpcs:
            raise ValueError(
                f"--max-health-watchers {self.max_health_watchers}: use 0 up to less than "
                f"--max-concurrent-rpcs ({self.max_concurrent_rpcs}), so that watchers leave room for calls"
            )

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> ServerConfig:
        """The server the parsed options describe; raises ValueError naming the first limit out of bounds."""
        return cls(
            host=args.host,
            port=args.port,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            max_health_watchers=args.max_health_watchers,
            metrics_port=args.metrics_port,
            insecure=args.insecure,
            cluster_secret_file=args.cluster_secret_file,
            tls=TlsConfig.from_options(args),
            logging=LoggingConfig.from_options(args),
        )
