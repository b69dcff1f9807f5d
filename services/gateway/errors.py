"""Errors in OpenAI's shape, with the HTTP status a client of OpenAI's API expects.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "height", "code": "invalid_argument"}}

The orchestrator's gRPC status decides the HTTP status (`STATUS_OF`): a refused field is 400 naming it in
`param`, a key 401, a tenant's missing right 403, an unknown job or model 404, a quota or a full queue 429
with `Retry-After` from the orchestrator's RetryInfo, a stage that is down 503 (the message names it).
"""

from __future__ import annotations

import math

import grpc
from fastapi.responses import JSONResponse

from stagediff.errors import InvalidArgument, StageDiffError, Unavailable

# gRPC status -> (HTTP status, OpenAI error type)
STATUS_OF: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.CANCELLED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
DEFAULT_STATUS = (500, "server_error")


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape; `param` names the field at fault, where there is one."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def invalid(param: str, message: str) -> ApiError:
    """400 for a field of the HTTP request (the message starts with the field, as the orchestrator's do)."""
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_argument")


def from_stagediff_error(error: StageDiffError) -> ApiError:
    """The HTTP error of a failed orchestrator call."""
    status, kind = STATUS_OF.get(error.code, DEFAULT_STATUS)
    headers = {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    param = error.field if isinstance(error, InvalidArgument) else None
    if isinstance(error, Unavailable) and error.stage:
        param = error.stage
    return ApiError(status, error.message, type=kind, param=param, code=error.code.name.lower(), headers=headers)
