"""The SDK's errors: one class per kind of failure, chosen by the call's gRPC status code.

    try:
        client.generate("a fox", height=63)
    except InvalidArgument as error:
        print(error.field, error.message)      # "height", "height: 63 is not a multiple of 16 ..."
    except RateLimitError as error:
        print(error.retry_after)               # seconds the server asked us to wait
    except StageDiffError as error:            # every other failure
        print(error.code.name, error.message)

Every class derives from `StageDiffError`, which keeps the status `code`, the server's `message` and its
`retry_after`. `StageDiffError.from_rpc_error` reads a failed call, including the rich details the server
may attach in its `grpc-status-details-bin` trailer (google.rpc.BadRequest, ErrorInfo, RetryInfo).

A call that reached no StageDiff server at all (nothing listening, an unknown host, an HTTP server on that
port) raises `ConnectionFailed`, an `Unavailable` whose message names the endpoint and says what to do
(`connection_failure`); an endpoint written as a URL (`http://host:port`) is refused before any call with
`InvalidEndpoint`, a ValueError.
"""

from __future__ import annotations

import re
from typing import TypeVar
from urllib.parse import urlsplit

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

from stagediff.status_details import rich_status

_Detail = TypeVar("_Detail", bound=Message)

# The orchestrator's refusals start with the path of the field they are about ("height: 63 is not ...",
# "loras[0].name: 'x' is named twice ..."): stagekit/errors.py RequestError.
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])*(?:\.[A-Za-z_][A-Za-z0-9_]*(?:\[\d+\])*)*): ")
# How the orchestrator names a stage that failed or is unreachable: "stage 'vae' at host:port is unavailable: ...".
_STAGE_IN_MESSAGE = re.compile(r"\bstage '([^']+)'")
# The ErrorInfo metadata key that names a stage, where a server sends one.
STAGE_METADATA_KEY = "stage"
# Where `stagediff up` serves by default: the gRPC API (the orchestrator) and the HTTP gateway.
DEFAULT_ENDPOINT = "localhost:50051"
DEFAULT_HTTP_PORT = 8000
# What gRPC's own messages say when a call reached no server: nothing listening (or a host that does not
# answer), a host name that does not resolve, and a server that answered in HTTP/1 (a web server).
_NOTHING_LISTENING = ("failed to connect to all addresses", "Connection refused")
_UNKNOWN_HOST = ("Domain name not found", "DNS resolution failed", "errors resolving")
_HTTP1_SERVER = ("http1.x server", "Failed parsing HTTP/2")


class StageDiffError(Exception):
    """A call failed; `code` is the gRPC status, `message` the server's explanation.

    `retry_after` is the server's RetryInfo in seconds (RESOURCE_EXHAUSTED: a full queue, a quota, a
    rate limit), or None when it gave none. The subclasses below say which kind of failure it was.
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> StageDiffError:
        """The error for a failed call (grpc.aio.AioRpcError, or grpc.RpcError of a blocking call), of the class
        its status code maps to, with what its rich status details say."""
        return error_for_status(error.code(), error.details() or "", rich_status(error))

    @classmethod
    def _from_status(cls, code: grpc.StatusCode, message: str, status: status_pb2.Status | None) -> StageDiffError:
        return cls(code, message, _retry_after(status))


class InvalidArgument(StageDiffError):
    """INVALID_ARGUMENT: the request was refused as it is; `field` is the path of the field at fault
    ("height", "loras[0].name", "images[1].data"), or None when the server named none."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after: float | None = None, field: str | None = None
    ) -> None:
        super().__init__(code, message, retry_after)
        self.field = field

    @classmethod
    def _from_status(cls, code: grpc.StatusCode, message: str, status: status_pb2.Status | None) -> StageDiffError:
        """The field comes from the first google.rpc.BadRequest field violation, or else from the message, whose
        first word the orchestrator makes the field's path ("height: 63 is not allowed; ...")."""
        bad_request = _detail(status, error_details_pb2.BadRequest)
        if bad_request is not None and bad_request.field_violations:
            field = bad_request.field_violations[0].field or None
        else:
            match = _FIELD_PREFIX.match(message)
            field = match.group(1) if match else None
        return cls(code, message, None, field)


class AuthenticationError(StageDiffError):
    """UNAUTHENTICATED: no API key, or one the server does not know."""


class PermissionDenied(StageDiffError):
    """PERMISSION_DENIED: the tenant may not do this (a size beyond its limits, an adapter it may not use)."""


class NotFound(StageDiffError):
    """NOT_FOUND: no such job, model or LoRA adapter (for this tenant)."""


class RateLimitError(StageDiffError):
    """RESOURCE_EXHAUSTED: a rate limit, a full queue or a quota; `retry_after` is how long the server asked
    the client to wait, in seconds, or None when it did not say. The clients retry these a few times
    (RetryPolicy.rate_limit_retries) before raising one."""


class Unavailable(StageDiffError):
    """UNAVAILABLE: the orchestrator or one of its stages cannot be reached; `stage` names the stage
    ("text-encoder", "dit", "vae", "interp") when the server said which, else None."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after: float | None = None, stage: str | None = None
    ) -> None:
        super().__init__(code, message, retry_after)
        self.stage = stage

    @classmethod
    def _from_status(cls, code: grpc.StatusCode, message: str, status: status_pb2.Status | None) -> StageDiffError:
        """The stage comes from an ErrorInfo's `stage` metadata, or else from the message ("stage 'vae' at ...")."""
        info = _detail(status, error_details_pb2.ErrorInfo)
        stage = info.metadata.get(STAGE_METADATA_KEY) if info is not None else None
        if stage is None:
            match = _STAGE_IN_MESSAGE.search(message)
            stage = match.group(1) if match else None
        return cls(code, message, _retry_after(status), stage)


class ConnectionFailed(Unavailable):
    """UNAVAILABLE before any StageDiff server answered: nothing listens at `endpoint`, its host is unknown, or
    an HTTP server answered there (the HTTP gateway's port given for the gRPC API's). The message names the
    endpoint and says what to do; `stage` is None."""

    def __init__(self, message: str, endpoint: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)
        self.endpoint = endpoint


class InvalidEndpoint(ValueError):
    """An endpoint that is not a gRPC target: a URL such as `http://host:port`. Raised by the clients'
    constructors, before any call; the message says which HOST:PORT to give instead."""


class DeadlineExceeded(StageDiffError):
    """DEADLINE_EXCEEDED: the call's timeout passed before the job finished (the job is cancelled)."""


class Cancelled(StageDiffError):
    """CANCELLED: the job was cancelled (CancelJob, or a client that went away)."""


class FailedPrecondition(StageDiffError):
    """FAILED_PRECONDITION: the cluster cannot run this request as deployed (e.g. a stage its model needs is
    not deployed), or the job is not in a state that allows the call."""


class InternalError(StageDiffError):
    """INTERNAL, UNKNOWN or DATA_LOSS: the server (or the result's transfer) failed; not the request's fault."""


ERROR_CLASSES: dict[grpc.StatusCode, type[StageDiffError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimitError,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}
"""The class of each status code; other codes (ALREADY_EXISTS, ABORTED, OUT_OF_RANGE, UNIMPLEMENTED) raise the
base StageDiffError."""


def error_for_status(code: grpc.StatusCode, message: str, status: status_pb2.Status | None = None) -> StageDiffError:
    """The error of the class `code` maps to; `status` is the call's google.rpc.Status with its details, if any."""
    return ERROR_CLASSES.get(code, StageDiffError)._from_status(code, message, status)


def _retry_after(status: status_pb2.Status | None) -> float | None:
    """The seconds of the status's RetryInfo, or None when it has none."""
    retry_info = _detail(status, error_details_pb2.RetryInfo)
    return None if retry_info is None else retry_info.retry_delay.ToNanoseconds() / 1e9


def _detail(status: status_pb2.Status | None, kind: type[_Detail]) -> _Detail | None:
    """The first detail of type `kind` in a google.rpc.Status, unpacked; None when there is none."""
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(kind.DESCRIPTOR):
            message = kind()
            detail.Unpack(message)
            return message
    return None


def connection_failure(error: grpc.RpcError, endpoint: str) -> ConnectionFailed | None:
    """The ConnectionFailed for a call to `endpoint` that reached no StageDiff server, saying what to do; None
    for any other failure (the server's own UNAVAILABLE, e.g. a stage it cannot reach, is left as it is)."""
    if error.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    details = error.details() or ""
    if _STAGE_IN_MESSAGE.search(details):
        return None  # the orchestrator answered: one of its stages is unreachable, which its message names
    if any(sign in details for sign in _HTTP1_SERVER):
        message = (
            f"{endpoint} answers HTTP/1, not gRPC: that is the HTTP gateway (default port {DEFAULT_HTTP_PORT}) or "
            f"another web server; the gRPC API is on the orchestrator's port (default {DEFAULT_ENDPOINT})"
        )
    elif any(sign in details for sign in _UNKNOWN_HOST):
        message = f"cannot resolve the host of {endpoint}: check --endpoint (HOST:PORT, default {DEFAULT_ENDPOINT})"
    elif any(sign in details for sign in _NOTHING_LISTENING):
        message = (
            f"nothing answers at {endpoint}: start a cluster with `stagediff up --model DIR`, or check "
            f"--endpoint (default {DEFAULT_ENDPOINT})"
        )
    else:
        return None
    return ConnectionFailed(message, endpoint)


def check_endpoint(address: str) -> None:
    """Raises InvalidEndpoint when `address` is an http:// or https:// URL rather than a gRPC target (HOST:PORT,
    or a target URI such as unix:///path), naming the HOST:PORT to give instead."""
    url = urlsplit(address)
    if url.scheme not in ("http", "https"):
        return
    host_port = url.netloc or DEFAULT_ENDPOINT
    tls = " with TLS (--tls, or tls=True)" if url.scheme == "https" else ""
    raise InvalidEndpoint(
        f"endpoint {address!r}: a gRPC endpoint is HOST:PORT, not a URL; try {host_port}{tls}. URLs are for the "
        f"HTTP gateway (e.g. http://localhost:{DEFAULT_HTTP_PORT}/v1/models), on another port than the gRPC API "
        f"(default {DEFAULT_ENDPOINT})"
    )
