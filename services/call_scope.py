"""Running each call of a grpc.aio server inside a scope that sees how the call ended.

For what a server records about its own calls (metrics, access logs): `wrap_rpc_handler`
returns a handler that enters a scope before the handler starts and leaves it once the call
has ended, and `observed_call` is such a scope, reporting the call's status and duration.
Probes (health checks, reflection) run every second or so outside any request: what is
recorded per call leaves them out (`PROBE_SERVICES`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

PROBE_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")

RpcScope = Callable[[grpc.aio.ServicerContext], contextlib.AbstractContextManager[Any]]


def rpc_status(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status a handler's call ends with, given the exception it raised (None when it returned)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode) and (error is None or isinstance(error, grpc.aio.AbortError)):
        return code
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN  # what grpc answers for an exception a handler did not map


@contextlib.contextmanager
def observed_call(
    context: grpc.aio.ServicerContext, on_end: Callable[[grpc.StatusCode, float], None]
) -> Iterator[None]:
    """Runs a call's block, then reports how it ended: `on_end(status, seconds)` (metrics, access logs)."""
    started = time.perf_counter()
    error: BaseException | None = None
    try:
        yield
    except BaseException as raised:
        error = raised
        raise
    finally:
        on_end(rpc_status(context, error), time.perf_counter() - started)


def wrap_rpc_handler(handler: grpc.RpcMethodHandler, scope: RpcScope) -> grpc.RpcMethodHandler:
    """Returns a handler that runs each call of `handler` inside `scope(context)`.

    For grpc.aio handlers: coroutines, and for streamed responses async
    generators or coroutines that write with `context.write`. The scope is
    entered before the handler starts and left when the call has ended, with the
    handler's exception, if any, so a scope can time the call and see how it ended.
    """
    deserialize, serialize = handler.request_deserializer, handler.response_serializer
    # grpc-stubs type the behaviours as sync functions; a grpc.aio server's are coroutines and async generators.
    unary_unary: Callable[..., Any] | None = handler.unary_unary
    unary_stream: Callable[..., Any] | None = handler.unary_stream
    stream_unary: Callable[..., Any] | None = handler.stream_unary
    stream_stream: Callable[..., Any] | None = handler.stream_stream
    if unary_unary is not None:

        async def wrapped_unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with scope(context):
                return await unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(wrapped_unary_unary, deserialize, serialize)
    if unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_wrap_streaming(unary_stream, scope), deserialize, serialize)
    if stream_unary is not None:

        async def wrapped_stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            with scope(context):
                return await stream_unary(requests, context)

        return grpc.stream_unary_rpc_method_handler(wrapped_stream_unary, deserialize, serialize)
    if stream_stream is None:
        raise ValueError("the handler has no behaviour")
    return grpc.stream_stream_rpc_method_handler(_wrap_streaming(stream_stream, scope), deserialize, serialize)


def _wrap_streaming(behavior: Callable[..., Any], scope: RpcScope) -> Callable[..., Any]:
    """Wraps a response-streaming behaviour, keeping its kind: grpc.aio runs each kind differently."""
    if not inspect.isasyncgenfunction(behavior):  # a coroutine that writes with context.write

        async def wrapped_writer(request_or_requests: Any, context: grpc.aio.ServicerContext) -> None:
            with scope(context):
                await behavior(request_or_requests, context)

        return wrapped_writer

    async def wrapped_generator(request_or_requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        with scope(context):
            # Closing this generator closes the handler's at once, so its cleanup runs inside the scope.
            async with contextlib.aclosing(behavior(request_or_requests, context)) as responses:
                async for response in responses:
                    yield response

    return wrapped_generator
