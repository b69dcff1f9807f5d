"""The Authorization header, checked before anything else reads the request.

The gateway forwards `Authorization` to the orchestrator as the call's gRPC metadata, and gRPC takes only
printable ASCII there, within its metadata size limit (8 KiB with every other header). So a header that could
not be a key is answered here, before a route reads the body or calls the orchestrator: one longer than
MAX_AUTHORIZATION_BYTES is 431, one with a byte outside printable ASCII (a control byte, a non-ASCII
character) is 401, both with `Connection: close`. Keys are about 50 characters
(services/orchestrator/tenants/keys.py `new_api_key`).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import ApiError

MAX_AUTHORIZATION_BYTES = 1024
_PRINTABLE_ASCII = re.compile(rb"[\x20-\x7e]*")
# The body of a refused request is not read: the connection ends with the answer.
_CLOSE = {"Connection": "close"}


def authorization_problem(value: bytes) -> ApiError | None:
    """Why `value` (the header's raw bytes) cannot be a key's header, as the answer to give; None if it can."""
    if len(value) > MAX_AUTHORIZATION_BYTES:
        return ApiError(
            431,
            f"Authorization: {len(value)} bytes; at most {MAX_AUTHORIZATION_BYTES} are taken ('Bearer <key>')",
            type="authentication_error",
            param="Authorization",
            code="header_too_large",
            headers=_CLOSE,
        )
    if not _PRINTABLE_ASCII.fullmatch(value):
        return ApiError(
            401,
            "Authorization: only printable ASCII is taken; send 'Bearer <key>'",
            type="authentication_error",
            param="Authorization",
            code="invalid_api_key",
            headers=_CLOSE,
        )
    return None


class AuthorizationCheck:
    """ASGI middleware: every HTTP request's Authorization headers pass `authorization_problem`, or the request
    is answered with its error before the app sees it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                problem = authorization_problem(value) if name.lower() == b"authorization" else None
                if problem is not None:
                    await problem.response()(scope, receive, send)
                    return
        await self.app(scope, receive, send)
