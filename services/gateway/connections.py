"""The gateway's HTTP connections: deadlines for sending a request, and room for new callers when full.

uvicorn bounds only the quiet time between two requests (`timeout_keep_alive`): a connection that sends nothing,
or half a request, would keep its place for ever. `GuardedProtocol` is uvicorn's h11 protocol with two deadlines:
a request's headers must be complete `header_timeout_s` after the connection opened (or after the answer to its
previous request), and its body `body_timeout_s` after its headers; past either, the connection is closed (a
route waiting for the body then sees the client gone). An answer has no deadline here: a progress stream or a
download runs as long as its job.

An answer given before the request's body was read (401 without a key, 413) closes the connection gracefully:
the gateway stops sending, and reads and drops what still comes for at most LINGER_S, so that the caller reads
the answer instead of a reset (closing a socket with unread data resets it).

uvicorn answers 503 to every new request once its open connections reach `limit_concurrency`. So when a new
connection makes them reach it, the connection that has waited longest with no request under way is closed:
callers who send requests are served, however many connections others keep open and silent.

Rules: `guarded_protocol()` makes the class uvicorn's `http=` takes; the hooks run on the event loop and do
constant work, except the scan for the longest-waiting connection, which runs only when the server is full.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.auth import RateLimitedLog
from services.gateway.options import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S

logger = logging.getLogger(__name__)


# How long an early answer's connection drops the rest of the body before it is closed.
LINGER_S = 5.0

_closures = RateLimitedLog(logger, logging.INFO)


class _Transport:
    """The connection's transport as uvicorn sees it, but for close(), which the protocol decides."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedProtocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def close(self) -> None:
        self._protocol.close_after_answer()


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol, with the header and body deadlines, and room made for new connections."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: object = None  # the caller's h11 state the deadline is for
        self.waiting_since = 0.0  # when the connection last began to wait for a request
        self.lingering = False  # answered early: the rest of the body is dropped until the connection closes
        self._lost = False
        self._raw: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._raw = transport
        self.transport = _Transport(transport, self)  # type: ignore[assignment]
        self._make_room()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.lingering:
            super().data_received(data)

    def close_after_answer(self) -> None:
        """uvicorn's close(): at once, unless the request's body is still coming (then lingering, see above)."""
        raw = self._raw
        if raw is None or self.lingering or raw.is_closing():
            return
        if self._lost or self.conn.their_state is not h11.SEND_BODY or not raw.can_write_eof():
            raw.close()
            return
        self.lingering = True
        self._cancel_deadline()
        raw.resume_reading()
        raw.write_eof()
        self.loop.call_later(LINGER_S, raw.close)

    def handle_events(self) -> None:
        super().handle_events()
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def is_waiting(self) -> bool:
        """Whether no request is under way: the connection is silent, or sending a request's headers."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def close_waiting(self) -> None:
        """Closes this waiting connection, and stops counting it at once (its `connection_lost` comes later)."""
        self.connections.discard(self)
        self._cancel_deadline()
        if self._raw is not None:
            self._raw.close()

    def _follow(self) -> None:
        """Arms the deadline of what the caller must send now, when that changed."""
        state = self.conn.their_state
        if state is self._phase or self._raw is None:
            return
        self._phase = state
        self._cancel_deadline()
        if self.transport.is_closing():
            return
        if state is h11.IDLE:
            self.waiting_since = self.loop.time()
            self._deadline = self.loop.call_later(self.header_timeout_s, self._expire, "headers", self.header_timeout_s)
        elif state is h11.SEND_BODY:
            self._deadline = self.loop.call_later(self.body_timeout_s, self._expire, "body", self.body_timeout_s)

    def _expire(self, part: str, timeout_s: float) -> None:
        self._deadline = None
        _closures.log(part, "closed a connection whose request %s took over %g s", part, timeout_s)
        if self._raw is not None:
            self._raw.close()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _make_room(self) -> None:
        """At uvicorn's connection limit, closes the connection that has waited longest with no request."""
        limit = self.limit_concurrency
        if limit is None or len(self.connections) < limit:
            return
        waiting = [
            other
            for other in self.connections
            if other is not self and isinstance(other, GuardedProtocol) and other.is_waiting()
        ]
        if waiting:
            min(waiting, key=lambda other: other.waiting_since).close_waiting()
            _closures.log("room", "closed the longest-waiting idle connection: %d connections are open", limit)


def guarded_protocol(header_timeout_s: float, body_timeout_s: float) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's `http=`, with these deadlines."""
    return type(
        "GuardedProtocol",
        (GuardedProtocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )
