"""The client's part of tracing: each call carries the caller's trace context.

When the caller runs inside an OpenTelemetry span, every call sends the W3C
`traceparent` (and `tracestate`) of that span in its metadata, so that the
cluster's trace of the job continues the caller's. The wire format is W3C trace
context whatever `OTEL_PROPAGATORS` says: it is what StageDiff servers read.

OpenTelemetry is optional here: only its API package is used, and where it is
not installed the client adds no interceptors. The client records no spans of
its own; a caller that wants one wraps the call in its own span.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc


class _Propagating:
    def __init__(self, propagator: Any) -> None:
        self._propagator = propagator

    def _with_trace_context(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)  # nothing when no span is current
        if not carrier:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in carrier.items():
            metadata.add(key, value)
        # grpc.aio.ClientCallDetails is a namedtuple; grpc-stubs declare a plain class.
        return details._replace(metadata=metadata)  # type: ignore[attr-defined]

    async def _intercept(self, continuation: Callable[..., Awaitable[Any]], details: Any, request: Any) -> Any:
        return await continuation(self._with_trace_context(details), request)


class _UnaryUnary(_Propagating, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_Propagating, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnary(_Propagating, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[..., Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStream(_Propagating, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[..., Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request_iterator)


def trace_context_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a grpc.aio channel that add the current trace context to every call's metadata;
    none when opentelemetry-api is not installed. grpc.aio files each interceptor under one kind of call
    only, hence one per kind."""
    try:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return []
    propagator = TraceContextTextMapPropagator()
    # grpc-stubs leave the aio interceptor kinds untyped and ask for a cast.
    kinds = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    return [cast(grpc.aio.ClientInterceptor, kind(propagator)) for kind in kinds]
