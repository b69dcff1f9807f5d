"""The API key is checked before a request's body is read: a caller without a valid key sends the gateway no body.

The gateway holds no tenants: `KeyCheck` asks the orchestrator whether a key is valid (ListModels with that key,
a cheap authenticated call; with no key, whether the cluster needs one) and keeps each answer KEY_CACHE_TTL_S
seconds, for at most KEY_CACHE_ENTRIES keys (by their SHA-256), and one question per key at a time: a flood of
requests costs the orchestrator one call per key and period. The orchestrator still checks the key of every call
it serves; the cache only decides which bodies the gateway reads and spools. An orchestrator that cannot be
reached is a 503 before the body too (the request could not be served); one that answers with another error
(a fake without ListModels) lets the request go on, for the orchestrator to decide on its call.

`KeyFirst` (ASGI middleware) answers 401 with `Connection: close` before the route runs, so the body is never
read. Every path but OPEN_PATHS (and those the app opens besides: the playground's static files) goes through it,
/openapi.json included. Refusals are logged at a bounded rate.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from services.auth import RateLimitedLog
from services.gateway.errors import ApiError, from_stagediff_error
from services.gateway.orchestrator import Orchestrator
from stagediff.errors import AuthenticationError, DeadlineExceeded, StageDiffError, Unavailable

logger = logging.getLogger(__name__)

KEY_CACHE_TTL_S = 10.0
KEY_CACHE_ENTRIES = 4096
OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def key_digest(authorization: str | None) -> bytes:
    """The cache's and the download slots' name for a key (the key itself is not kept)."""
    return hashlib.sha256((authorization or "").encode("latin-1")).digest()


def unauthenticated(message: str) -> ApiError:
    return ApiError(401, message, type="authentication_error", code="unauthenticated", headers={"Connection": "close"})


class KeyCheck:
    """Whether the orchestrator takes a key, from its cached answer."""

    def __init__(self, orchestrator: Orchestrator, ttl_s: float = KEY_CACHE_TTL_S) -> None:
        self.orchestrator = orchestrator
        self.ttl_s = ttl_s
        self._answers: OrderedDict[bytes, tuple[float, str | None]] = OrderedDict()
        self._asking: dict[bytes, asyncio.Future[str | None]] = {}

    async def refusal(self, authorization: str | None) -> str | None:
        """None when the key is taken, or none is needed, or the orchestrator gives no answer; else why not.
        Raises Unavailable or DeadlineExceeded when the orchestrator cannot be reached.

        The Authorization header is printable ASCII of a bounded length here (headers.AuthorizationCheck)."""
        digest = key_digest(authorization)
        cached = self._answers.get(digest)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        asking = self._asking.get(digest)
        if asking is None:
            asking = asyncio.ensure_future(self._ask(digest, authorization))
            self._asking[digest] = asking
            asking.add_done_callback(lambda _: self._asking.pop(digest, None))
        return await asyncio.shield(asking)

    async def _ask(self, digest: bytes, authorization: str | None) -> str | None:
        try:
            await self.orchestrator.list_models(authorization)
            answer = None
        except AuthenticationError as error:
            answer = error.message
        except (Unavailable, DeadlineExceeded):
            raise  # not cached: the next request asks again
        except StageDiffError:
            return None  # no answer (no ListModels here): the orchestrator decides on the call
        self._answers[digest] = (time.monotonic() + self.ttl_s, answer)
        self._answers.move_to_end(digest)
        while len(self._answers) > KEY_CACHE_ENTRIES:
            self._answers.popitem(last=False)
        return answer


class KeyFirst:
    """ASGI middleware: a request without a key the orchestrator takes is answered 401 before its body is read."""

    def __init__(self, app: ASGIApp, check: KeyCheck, is_open: Callable[[str], bool] = OPEN_PATHS.__contains__) -> None:
        self.app = app
        self.check = check
        self.is_open = is_open
        self.refusals = RateLimitedLog(logger, logging.INFO)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        # The first Authorization header, which the routes forward (starlette's Headers.get).
        raw = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        authorization = raw.decode("latin-1") if raw is not None else None
        try:
            refusal = await self.check.refusal(authorization)
        except StageDiffError as error:
            unreachable = from_stagediff_error(error)
            unreachable.headers["Connection"] = "close"
            await unreachable.response()(scope, receive, send)
            return
        if refusal is None:
            await self.app(scope, receive, send)
            return
        self.refusals.log("api-key", "refused an HTTP request before its body: %s", refusal)
        await unauthenticated(refusal).response()(scope, receive, send)
