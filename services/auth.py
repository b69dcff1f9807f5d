"""Who may call a cluster's services: the cluster's shared secret between services, and TLS.

Two independent pieces, each opt-in (tenants' API keys on the orchestrator's public port are
services/orchestrator/tenant_auth.py, which builds on this):

* `ClusterSecretInterceptor` (stage ports) and `cluster_channel` or `cluster_secret_interceptors` (the
  orchestrator's channels to them): internal calls carry the cluster's shared secret in
  `x-stagediff-cluster-secret` metadata, so a stage answers only its own cluster. Health stays open: docker and
  Kubernetes probes carry no secret. The secret comes from `--cluster-secret-file` (docker secrets) or the
  STAGEDIFF_CLUSTER_SECRET environment variable.
* `server_credentials` / `channel_credentials`: TLS for the public port and the stage ports, with client
  certificates required when a client CA is given; `stage_channel_credentials` for the orchestrator's channels to
  TLS stages (`--stage-tls-ca`, and `--stage-tls-cert/--stage-tls-key` for mutual TLS).

Refusals are logged at a bounded rate (`RateLimitedLog`): a caller without credentials decides how often it is
refused, not how much the server logs. So is grpc's own line for metadata that is not UTF-8
(`MetadataEncodingFilter`). Interceptors follow grpc's aio examples: they find the real handler with
`continuation`, then either return it wrapped or return a handler of the same kind that aborts.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import grpc

from services.server import GRPC_OPTIONS
from services.server_config import TlsConfig

logger = logging.getLogger(__name__)

CLUSTER_SECRET_METADATA_KEY = "x-stagediff-cluster-secret"
CLUSTER_SECRET_ENV = "STAGEDIFF_CLUSTER_SECRET"
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICES = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")
# Metadata values must be printable ASCII; spaces are excluded so that a secret
# file's trailing newline or padding can never be part of the secret.
_SECRET_CHARS = re.compile(r"^[\x21-\x7e]+$")

# A refusal of each kind is logged at most this often; the next line says how many were not.
REFUSAL_LOG_INTERVAL_S = 1.0
# The logger and message start of grpc's line for a metadata value that is not UTF-8.
GRPC_LOGGER = "grpc._cython.cygrpc"
GRPC_INVALID_ENCODING = "Invalid encoding on"


class RateLimitedLog:
    """Logs at most one line per `interval_s` for each kind of event, and counts the lines it held back.

    For events a caller causes at will, such as a refused call: logged one line
    each, anyone who reaches the port would decide how much the server writes.
    The first event of a kind is logged at once; the next ones within
    `interval_s` are only counted, and the next line logged for that kind ends
    with how many were held back. Kinds must come from a fixed set chosen by
    the code, never from a request, or the counters themselves would grow.
    """

    def __init__(
        self,
        logger: logging.Logger,
        level: int,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.level = level
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, kind: str, message: str, *args: object) -> bool:
        """Logs `message % args` unless a line of `kind` was logged less than `interval_s` ago; True if logged."""
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return False
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            message += " (and %d more since the last such line, not logged one by one)"
            args = (*args, held)
        self.logger.log(self.level, message, *args)
        return True


class MetadataEncodingFilter(logging.Filter):
    """Replaces grpc's own ERROR line for a metadata value that is not UTF-8 (grpc's `_decode` logs it with a
    traceback and the raw bytes, then hands the handler its latin-1 reading, which the interceptors refuse):
    one line, without the bytes, at a bounded rate. A caller would otherwise decide how much the server logs."""

    def __init__(self) -> None:
        super().__init__()
        self.lines = RateLimitedLog(logger, logging.INFO)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(GRPC_INVALID_ENCODING):
            return True
        self.lines.log("metadata-encoding", "received metadata that is not UTF-8 (read as latin-1)")
        return False


def install_metadata_encoding_filter() -> None:
    """Puts a MetadataEncodingFilter on grpc's logger, once per process."""
    grpc_logger = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(existing, MetadataEncodingFilter) for existing in grpc_logger.filters):
        grpc_logger.addFilter(MetadataEncodingFilter())


def service_of(method: str) -> str:
    """'/pkg.Service/Method' -> 'pkg.Service'."""
    return method.lstrip("/").partition("/")[0]


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts at once, without parsing the request.

    Streamed responses come from an async generator, as in every servicer here: the interceptors
    that wrap it (tracing among them) iterate what a response-streaming handler returns.
    """

    async def abort(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def abort_stream(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield  # never reached: abort raises; the yield makes this an async generator

    serializer = handler.response_serializer
    # No deserializer: the bytes of a refused call are never parsed.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, None, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, None, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, None, serializer)
    return grpc.unary_unary_rpc_method_handler(abort, None, serializer)


# -------------------------------------------------------- cluster secret --


class ClusterSecretError(ValueError):
    """The cluster secret cannot be read or is not usable as metadata."""


def load_cluster_secret(path: str | os.PathLike[str] | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The cluster secret from `path` (a docker secret file), else from STAGEDIFF_CLUSTER_SECRET, else None.

    Surrounding whitespace (a file's trailing newline) is dropped. Raises
    ClusterSecretError for an unreadable or empty file, or a secret with
    characters metadata cannot carry.
    """
    if path is not None:
        try:
            secret = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as error:
            raise ClusterSecretError(f"--cluster-secret-file {path}: cannot read it ({error})") from None
        source = f"--cluster-secret-file {path}"
    else:
        secret = environ.get(CLUSTER_SECRET_ENV, "").strip()
        source = CLUSTER_SECRET_ENV
        if not secret:
            return None
    if not secret:
        raise ClusterSecretError(f"{source}: the file is empty")
    if not _SECRET_CHARS.match(secret):
        raise ClusterSecretError(f"{source}: the secret must be printable ASCII without spaces")
    return secret


def add_cluster_secret_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster-secret-file",
        default=None,
        metavar="FILE",
        help=f"file holding the secret shared by the cluster's services (default: ${CLUSTER_SECRET_ENV}, else none)",
    )


class ClusterSecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, calls that do not carry the cluster's secret.

    For stage services, which only the orchestrator should call. Health stays
    open for probes (`exempt_services`). The comparison takes the same time
    however much of the secret a caller got right.
    """

    def __init__(self, secret: str, exempt_services: Iterable[str] = (HEALTH_SERVICE,)) -> None:
        if not secret:
            raise ValueError("secret: must not be empty")
        self._secret = secret.encode()
        self.exempt_services = frozenset(exempt_services)
        self.refusals = RateLimitedLog(logger, logging.WARNING)
        install_metadata_encoding_filter()

    def _refusal_reason(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        values = [value for key, value in (metadata or ()) if key == CLUSTER_SECRET_METADATA_KEY]
        if not values:
            return (
                f"missing cluster secret: stage services answer only calls carrying '{CLUSTER_SECRET_METADATA_KEY}' "
                "(give the orchestrator the same --cluster-secret-file)"
            )
        presented = values[0].encode() if isinstance(values[0], str) else values[0]
        if len(values) > 1 or not hmac.compare_digest(presented, self._secret):
            return "wrong cluster secret: the caller's secret differs from this service's"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        # None for a method no servicer has (grpc-stubs leave None out).
        handler: grpc.RpcMethodHandler | None = await continuation(handler_call_details)
        if handler is None or service_of(handler_call_details.method) in self.exempt_services:
            return handler  # type: ignore[return-value]  # grpc takes None: no such method
        reason = self._refusal_reason(handler_call_details.invocation_metadata)
        if reason is None:
            return handler
        self.refusals.log("cluster-secret", "refused %s: %s", handler_call_details.method, reason)
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, reason)


class _SecretMetadata:
    """Adds the cluster secret to a call's metadata."""

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("secret: must not be empty")
        self._secret = secret

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata[CLUSTER_SECRET_METADATA_KEY] = self._secret
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnarySecret(_SecretMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamSecret(_SecretMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnarySecret(_SecretMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamSecret(_SecretMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def cluster_secret_interceptors(secret: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that add the cluster secret to every call on an aio channel.

    One per kind of call: an aio channel files each interceptor under the first
    kind it implements only. Interceptors rather than call credentials, since
    gRPC sends call credentials only over TLS, and traffic between stages may
    be plaintext on a private network.
    """
    # grpc-stubs leave the aio interceptor kinds untyped and ask for a cast.
    kinds = (_UnaryUnarySecret, _UnaryStreamSecret, _StreamUnarySecret, _StreamStreamSecret)
    return [cast(grpc.aio.ClientInterceptor, kind(secret)) for kind in kinds]


def cluster_channel(
    endpoint: str,
    secret: str | None,
    *,
    options: Sequence[tuple[str, Any]] = GRPC_OPTIONS,
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.aio.Channel:
    """An aio channel to a cluster service that sends `secret` with every call (none when None)."""
    interceptors = cluster_secret_interceptors(secret) if secret else None
    if credentials is not None:
        return grpc.aio.secure_channel(endpoint, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(endpoint, options=options, interceptors=interceptors)


# -------------------------------------------------------------------- tls --


class TLSConfigError(ValueError):
    """A TLS flag names a file that cannot be read, or the flags do not go together."""


def _read(flag: str, path: str | os.PathLike[str]) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise TLSConfigError(f"{flag} {path}: cannot read it ({error.strerror})") from None


def server_credentials(
    cert_file: str | os.PathLike[str],
    key_file: str | os.PathLike[str],
    client_ca_file: str | os.PathLike[str] | None = None,
) -> grpc.ServerCredentials:
    """TLS credentials for a server port; with `client_ca_file`, clients must present a certificate it signed."""
    certificate = _read("--tls-cert", cert_file)
    private_key = _read("--tls-key", key_file)
    client_ca = _read("--tls-client-ca", client_ca_file) if client_ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(private_key, certificate)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def channel_credentials(
    ca_file: str | os.PathLike[str] | None = None,
    cert_file: str | os.PathLike[str] | None = None,
    key_file: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials:
    """TLS credentials for a client: trust `ca_file` (default: the system's roots); present a certificate if given."""
    if (cert_file is None) != (key_file is None):
        raise TLSConfigError("a client certificate needs both its certificate and its key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read("--tls-ca", ca_file) if ca_file is not None else None,
        private_key=_read("--tls-key", key_file) if key_file is not None else None,
        certificate_chain=_read("--tls-cert", cert_file) if cert_file is not None else None,
    )


def add_stage_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """The orchestrator's side of TLS to the stages (the stages take add_tls_arguments)."""
    parser.add_argument(
        "--stage-tls-ca",
        default=None,
        metavar="PEM",
        help="call the stages over TLS, trusting certificates signed by this CA (default: plaintext)",
    )
    parser.add_argument(
        "--stage-tls-cert",
        default=None,
        metavar="PEM",
        help="client certificate presented to stages that require one (--tls-client-ca on the stage)",
    )
    parser.add_argument("--stage-tls-key", default=None, metavar="PEM", help="private key of --stage-tls-cert")


def stage_channel_credentials(
    ca_file: str | None, cert_file: str | None, key_file: str | None
) -> grpc.ChannelCredentials | None:
    """Credentials for the channels to the stages (`--stage-tls-ca`, `--stage-tls-cert`, `--stage-tls-key`), or
    None for plaintext (no CA)."""
    if ca_file is None:
        if cert_file is not None or key_file is not None:
            raise TLSConfigError("--stage-tls-cert and --stage-tls-key need --stage-tls-ca (the stages' CA)")
        return None
    if (cert_file is None) != (key_file is None):
        raise TLSConfigError("--stage-tls-cert and --stage-tls-key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read("--stage-tls-ca", ca_file),
        private_key=_read("--stage-tls-key", key_file) if key_file is not None else None,
        certificate_chain=_read("--stage-tls-cert", cert_file) if cert_file is not None else None,
    )


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate chain")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    parser.add_argument(
        "--tls-client-ca", default=None, metavar="PEM", help="require client certificates signed by this CA"
    )


def server_credentials_for(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """The credentials `add_tls_arguments` asked for, or None for plaintext (no --tls-cert)."""
    if tls.cert_file is None and tls.key_file is None:
        if tls.client_ca_file is not None:
            raise TLSConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if tls.cert_file is None or tls.key_file is None:
        raise TLSConfigError("--tls-cert and --tls-key go together")
    return server_credentials(tls.cert_file, tls.key_file, tls.client_ca_file)
