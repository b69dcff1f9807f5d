"""Errors in OpenAI's shape, with the HTTP status a client of OpenAI's API expects.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "height", "code": "invalid_argument"}}

The orchestrator's gRPC status decides the HTTP status (`STATUS_OF`): a refused field is 400 naming it in
`param`, a key 401, a tenant's missing right 403, an unknown job or model 404, a quota or a full queue 429
with `Retry-After` from the orchestrator's RetryInfo, a stage that is down 503 (the message names it).
RESOURCE_EXHAUSTED from grpc's own transport limits is no quota: a message over the size the orchestrator
takes is 413, metadata over grpc's size limit 431 (`transport_limit`). A body field that fails its schema is
400 naming the field and what is allowed (`validation_error`); starlette's own errors (an unknown route, a
malformed multipart body) keep their status (`from_http_exception`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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


# grpc's own refusals of a message or of metadata over its size limits (the server's receive limit, or this
# client's send limit), which carry RESOURCE_EXHAUSTED like a tenant's quota.
_MESSAGE_TOO_LARGE = re.compile(r"(?:Received|Sent) message larger than max \((\d+) vs\. (\d+)\)")
_METADATA_TOO_LARGE = re.compile(r"metadata size exceeds (?:soft|hard) limit")
# Parts of a pydantic error's location that are not field names: the tags of union members ("str",
# "LoraField", "list[...]") and where FastAPI found the value.
_NOT_FIELDS = re.compile(r"str|int|float|bool|body|query|path|header|.*[A-Z\[\](].*")


def transport_limit(error: StageDiffError) -> ApiError | None:
    """413 or 431 for grpc's own size limits (not a tenant's quota: no Retry-After helps), else None."""
    if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    if _METADATA_TOO_LARGE.search(error.message):
        return ApiError(431, "the request's headers are too large for the orchestrator", code="headers_too_large")
    match = _MESSAGE_TOO_LARGE.search(error.message)
    if match is None:
        return None
    size, limit = match.groups()
    message = f"the request is {size} bytes; the orchestrator takes at most {limit} (its input images included)"
    return ApiError(413, message, code="request_too_large")


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """400 for pydantic's `errors()` of a body or query: the most specific error (of a union's members, the
    one that got furthest), naming its field ("lora.scale", "lora[1]") and what is allowed."""
    if not errors:
        return invalid("body", "not a valid request")
    first = max(errors, key=lambda error: len(error["loc"]))
    field = ""
    for part in first["loc"]:
        if isinstance(part, int):
            field += f"[{part}]"
        elif not _NOT_FIELDS.fullmatch(str(part)):
            field += f".{part}" if field else str(part)
    return invalid(field or "body", first["msg"])


def from_http_exception(error: StarletteHTTPException) -> ApiError:
    """Starlette's own errors (an unknown route 404, a wrong method 405, a multipart body without its boundary
    400) in OpenAI's shape."""
    kind = next((kind for status, kind in STATUS_OF.values() if status == error.status_code), "invalid_request_error")
    code = "not_found" if error.status_code == 404 else "invalid_request"
    return ApiError(error.status_code, str(error.detail), type=kind, code=code, headers=dict(error.headers or {}))


def from_stagediff_error(error: StageDiffError) -> ApiError:
    """The HTTP error of a failed orchestrator call."""
    limit = transport_limit(error)
    if limit is not None:
        return limit
    status, kind = STATUS_OF.get(error.code, DEFAULT_STATUS)
    headers = {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    param = error.field if isinstance(error, InvalidArgument) else None
    if isinstance(error, Unavailable) and error.stage:
        param = error.stage
    return ApiError(status, error.message, type=kind, param=param, code=error.code.name.lower(), headers=headers)
