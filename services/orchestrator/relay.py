"""Relaying a public call to the orchestrator replica that must answer it: the leader for admissions, a job's
holder for a job that is queued or running there.

A relayed call is the client's own call, sent on from this replica to the peer's gRPC port with the client's
metadata (its API key: the peer authenticates the tenant itself) and the cluster secret, which marks it as
relayed: a relayed call is never relayed again (`is_relayed`), so a replica that no longer holds what it was
asked for answers UNAVAILABLE and the client retries, rather than calls going round. The peer's answer,
status and trailing metadata (a RetryInfo, the job-failed marker) reach the client as the peer sent them.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import grpc

from services.auth import CLUSTER_SECRET_METADATA_KEY, cluster_channel
from stagediff.status_details import abort_with_retry
from stagediff.v1 import generation_pb2_grpc

# Metadata that belongs to one hop, never relayed: gRPC's own, HTTP/2's, and the cluster secret.
_HOP_KEYS = frozenset({CLUSTER_SECRET_METADATA_KEY, "user-agent", "content-type", "te", "grpc-accept-encoding"})
PEER_UNREACHABLE_RETRY_S = 1.0
MAX_PEER_CHANNELS = 64  # peers are few; a bound keeps a churning cluster's channels from piling up


@dataclass(frozen=True)
class _Status(grpc.Status):
    """A peer's final status as grpc.aio's `abort_with_status` takes it."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, Any], ...]


def is_relayed(context: grpc.aio.ServicerContext[Any, Any], secret: str | None) -> bool:
    """Whether this call came from a peer replica (it carries the cluster secret)."""
    if not secret:
        return False
    for key, value in cast(Sequence[tuple[str, Any]], context.invocation_metadata() or ()):
        if key == CLUSTER_SECRET_METADATA_KEY and isinstance(value, str):
            return hmac.compare_digest(value.encode(), secret.encode())
    return False


class Relay:
    """Channels to peer replicas, and the relaying of each kind of call over them."""

    def __init__(self, secret: str | None, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.secret = secret
        self.credentials = credentials
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, endpoint: str) -> generation_pb2_grpc.GenerationStub:
        channel = self._channels.get(endpoint)
        if channel is None:
            if len(self._channels) >= MAX_PEER_CHANNELS:
                oldest = next(iter(self._channels))
                self._channels.pop(oldest)
            channel = self._channels[endpoint] = cluster_channel(endpoint, self.secret, credentials=self.credentials)
        return generation_pb2_grpc.GenerationStub(channel)

    async def unary(self, endpoint: str, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Relays a call with one answer (`method` as the stub names it, e.g. "Submit"): `request` is its message,
        or for a client-streamed call (UploadImage) an async iterator of them. The peer's answer or its error."""
        call = getattr(self._stub(endpoint), method)(
            request, metadata=_relayed_metadata(context), timeout=context.time_remaining()
        )
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            await _abort_as(context, error)

    async def stream(
        self, endpoint: str, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        """Relays a server-streaming call, message by message; cancelled with the client's call."""
        call = getattr(self._stub(endpoint), method)(
            request, metadata=_relayed_metadata(context), timeout=context.time_remaining()
        )
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as error:
            await _abort_as(context, error)
        finally:
            call.cancel()  # the client left: the peer stops sending

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close(None)


def _relayed_metadata(context: grpc.aio.ServicerContext[Any, Any]) -> Sequence[tuple[str, str | bytes]]:
    # grpc gives (key, value) pairs; grpc-stubs type a metadatum as an object with attributes.
    pairs = cast(Sequence[tuple[str, str | bytes]], context.invocation_metadata() or ())
    return [(key, value) for key, value in pairs if key not in _HOP_KEYS and not key.startswith((":", "grpc-"))]


async def _abort_as(context: grpc.aio.ServicerContext[Any, Any], error: grpc.aio.AioRpcError) -> NoReturn:
    """Ends this call with the peer's status, details and trailing metadata; a peer that could not be reached
    (its details would name its address) is UNAVAILABLE with a retry delay."""
    trailing = tuple(cast(Sequence[tuple[str, Any]], error.trailing_metadata() or ()))
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not trailing:
        await abort_with_retry(
            context,
            "the orchestrator replica holding this work cannot be reached now (a takeover or a restart); retry",
            PEER_UNREACHABLE_RETRY_S,
            code=grpc.StatusCode.UNAVAILABLE,
        )
    status = _Status(error.code(), error.details() or "", trailing)
    # grpc-stubs omit grpc.aio.ServicerContext.abort_with_status, which grpc has.
    await context.abort_with_status(status)  # type: ignore[attr-defined]
    raise AssertionError("abort_with_status returned")
