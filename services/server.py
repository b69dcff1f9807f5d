"""Server bootstrap shared by every StageDiff service.

Follows grpc's Python aio examples: one `grpc.aio.server` with explicit message
size limits, grpc.health.v1 (NOT_SERVING while the model loads and while the
server drains), server reflection, and graceful shutdown on SIGTERM/SIGINT.
Authentication (services.auth) plugs in as interceptors and TLS credentials.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import inspect
import ipaddress
import logging
import signal
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # grpc-stubs lack aio
from grpc_reflection.v1alpha import reflection

from services.call_scope import PROBE_SERVICES, observed_call, wrap_rpc_handler
from services.launch_id import LaunchIdInterceptor, launch_id
from services.logging_setup import configure_logging as _configure_logging
from services.metrics import MetricsServerInterceptor, ServerMetrics
from services.ports import bind_problem
from services.tracing import server_interceptor as tracing_server_interceptor
from stagediff.status_details import abort_with_retry
from stagekit.errors import RequestError

logger = logging.getLogger(__name__)

# Tensors travel in chunks of 1 MiB, so 64 MiB leaves room for any message we
# send while still refusing a runaway peer.
MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # A port is this server's alone: a second server on it fails to start instead of sharing its callers.
    ("grpc.so_reuseport", 0),
]
DEFAULT_GRACE_SECONDS = 10.0
WATCHDOG_POLL_S = 0.5
# Servers bind loopback unless told otherwise: exposing a port is the operator's decision.
DEFAULT_HOST = "127.0.0.1"
# Calls a server runs at once; grpc answers RESOURCE_EXHAUSTED beyond. Generous for a stage, which the
# orchestrator calls a few at a time; the orchestrator's default covers a full queue of Generate streams.
DEFAULT_MAX_CONCURRENT_RPCS = 256
DEFAULT_MAX_HEALTH_WATCHERS = 32
HEALTH_WATCH_METHOD = "/grpc.health.v1.Health/Watch"
HEALTH_WATCH_RETRY_S = 10.0

Register = Callable[[grpc.aio.Server], list[str]]


class _Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, method: str, error: Exception) -> None:
        self.message = f"request: the bytes sent to {method} are not a valid message ({error})"


def _tolerant(deserializer: Callable[[bytes], object] | None, method: str) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return deserializer(data) if deserializer is not None else data
        except Exception as error:  # protobuf raises DecodeError, but a custom deserializer may raise anything
            return _Undecodable(method, error)

    return parse


# A handler as grpc.aio calls it: grpc-stubs type the behaviours as sync functions, a grpc.aio server's are
# coroutines or async generators.
_Behaviour = Callable[..., Any]
_Context = grpc.aio.ServicerContext[Any, Any]
_Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


async def _checked_stream(requests: AsyncIterable[Any], method: str) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise RequestError(request.message)
        yield request


async def _responses(result: Any) -> AsyncIterator[Any]:
    """The responses of a streaming handler: an async generator's items, or none from a coroutine that
    answers with context.write() (as grpc's aio HealthServicer.Watch does) once it has run."""
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    else:
        await result


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to bytes that are not a valid request message.

    Left alone, grpc answers UNKNOWN or INTERNAL when a request fails to parse,
    which tells a client the server is at fault. Parsing is made tolerant here,
    and an unparsable message is refused like any other invalid argument: at
    once for unary requests, and through RequestError (which every servicer maps
    to INVALID_ARGUMENT) for request streams.
    """

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        # None for a method no servicer has (grpc-stubs leave None out).
        handler: grpc.RpcMethodHandler | None = await continuation(handler_call_details)
        if handler is None:
            return None  # type: ignore[return-value]  # grpc takes None: no such method
        method = handler_call_details.method
        logger.debug("call %s", method)
        parse = _tolerant(handler.request_deserializer, method)
        serialize = handler.response_serializer
        if not handler.request_streaming:
            inner: _Behaviour | None = handler.unary_unary or handler.unary_stream
            assert inner is not None  # a handler that does not stream requests has one of the two
            if handler.unary_unary:

                async def unary_unary(request: Any, context: _Context) -> Any:
                    if isinstance(request, _Undecodable):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                    return await inner(request, context)

                return grpc.unary_unary_rpc_method_handler(unary_unary, parse, serialize)

            async def unary_stream(request: Any, context: _Context) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for response in _responses(inner(request, context)):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, parse, serialize)
        if handler.stream_unary:
            inner_su: _Behaviour = handler.stream_unary

            async def stream_unary(requests: AsyncIterable[Any], context: _Context) -> Any:
                return await inner_su(_checked_stream(requests, method), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, parse, serialize)
        inner_ss: _Behaviour | None = handler.stream_stream
        assert inner_ss is not None  # the one kind left

        async def stream_stream(requests: AsyncIterable[Any], context: _Context) -> AsyncIterator[Any]:
            async for response in _responses(inner_ss(_checked_stream(requests, method), context)):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream, parse, serialize)


class HealthWatchLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with RESOURCE_EXHAUSTED, a grpc.health.v1 Watch stream beyond `limit` open at once.

    Health needs no credentials (probes carry none), and a Watch stream stays
    open for as long as its caller likes. Without a cap, anyone who reaches the
    port could hold every slot of `--max-concurrent-rpcs` and leave none for
    the calls the server exists for. Probes use Check, which this leaves alone.
    """

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"--max-health-watchers {limit}: use 0 or more")
        self.limit = limit
        self.open = 0

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler: grpc.RpcMethodHandler | None = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != HEALTH_WATCH_METHOD or not handler.unary_stream:
            return handler  # type: ignore[return-value]  # grpc takes None: no such method
        inner: _Behaviour = handler.unary_stream

        async def watch(request: Any, context: _Context) -> AsyncIterator[Any]:
            if self.open >= self.limit:
                await abort_with_retry(
                    context,
                    f"grpc.health.v1.Health/Watch: {self.open} streams are open, the most this server allows "
                    f"(--max-health-watchers {self.limit}); poll with Check instead",
                    HEALTH_WATCH_RETRY_S,
                )
            self.open += 1
            try:
                async for response in _responses(inner(request, context)):
                    yield response
            finally:
                self.open -= 1

        return grpc.unary_stream_rpc_method_handler(watch, handler.request_deserializer, handler.response_serializer)


def is_loopback(host: str) -> bool:
    """Whether `host` binds only this machine's loopback (127.0.0.0/8, ::1, localhost), reachable from no other."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost, or a wildcard spelled as ""
        return False


def add_server_arguments(parser: argparse.ArgumentParser, default_max_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS) -> None:
    """--host and the limits on concurrent calls that every `stagediff serve` takes."""
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address to bind (default %(default)s: this machine only; 0.0.0.0 for every interface, as in a container)",
    )
    parser.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=default_max_rpcs,
        help="calls served at once; beyond, RESOURCE_EXHAUSTED (default %(default)s)",
    )
    parser.add_argument(
        "--max-health-watchers",
        type=int,
        default=DEFAULT_MAX_HEALTH_WATCHERS,
        help="grpc.health.v1 Watch streams open at once, which need no credentials; "
        "beyond, RESOURCE_EXHAUSTED (default %(default)s)",
    )


async def _set_serving(health: health_aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health.set(name, status)


async def _watch(
    name: str,
    watchdog: Callable[[], str | None],
    stop: asyncio.Event,
    health: health_aio.HealthServicer,
    service_names: list[str],
) -> None:
    while not stop.is_set():
        reason = watchdog()
        if reason is not None:
            logger.error("%s cannot serve any more: %s; health is NOT_SERVING until restarted", name, reason)
            await _set_serving(health, service_names, False)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=WATCHDOG_POLL_S)


async def serve(
    *,
    name: str,
    host: str,
    port: int,
    register: Register,
    load: Callable[[], Coroutine[Any, Any, None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    grace: float = DEFAULT_GRACE_SECONDS,
    watchdog: Callable[[], str | None] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    metrics: ServerMetrics | None = None,
    max_concurrent_rpcs: int | None = DEFAULT_MAX_CONCURRENT_RPCS,
    max_health_watchers: int = DEFAULT_MAX_HEALTH_WATCHERS,
    options: Sequence[tuple[str, int | str]] = (),
    port_flag: str = "--port",
) -> None:
    """Runs a gRPC server until SIGTERM or SIGINT.

    `register` adds the servicers and returns their full service names. `on_drain` runs at SIGTERM once
    health says NOT_SERVING, before the calls in flight are given `grace` to end; `on_shutdown` after. `load`
    runs after the port is bound, while health says NOT_SERVING, so that
    orchestrators and `stagediff up` can tell "loading" from "down". `watchdog`,
    polled while serving, returns a reason once the server can no longer do its
    work (a rank of its process group died): health turns NOT_SERVING for good.
    `interceptors` run before the request decoding, outermost first, so that an
    authentication interceptor refuses a call before its bytes are parsed.
    `credentials` serve TLS on the port; without them it is plaintext. Every call
    runs in a server span joined to the caller's trace (W3C traceparent), and with
    `metrics` is counted and timed by method and status. Beyond `max_concurrent_rpcs`
    calls at once (None: no limit), grpc answers RESOURCE_EXHAUSTED before any
    handler runs; health Watch streams, open to anyone, may hold at most
    `max_health_watchers` of those slots. `options` are grpc channel arguments that replace those of
    GRPC_OPTIONS with the same name (a public port that takes no tensors lowers its receive limit).
    A port that another process holds ends the process with SystemExit naming the port and `port_flag`,
    before anything is loaded. Health checks answer with the process's launch id (services/launch_id.py).
    """
    problem = bind_problem(host, port, port_flag)
    if problem is not None:
        raise SystemExit(f"{name}: {problem}")
    observing: list[grpc.aio.ServerInterceptor] = [tracing_server_interceptor(), AccessLogInterceptor()]
    if metrics is not None:
        observing.append(MetricsServerInterceptor(metrics))
    server = grpc.aio.server(
        options=[*((key, value) for key, value in GRPC_OPTIONS if key not in dict(options)), *options],
        interceptors=[
            *observing,
            HealthWatchLimitInterceptor(max_health_watchers),
            *([LaunchIdInterceptor(launch_id())] if launch_id() else []),
            *interceptors,
            RequestDecodingInterceptor(),
        ],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    service_names = register(server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    bound = await _bind(server, name, host, port, port_flag, credentials)
    await _set_serving(health, service_names, False)
    await server.start()
    logger.info("%s listening on %s:%d%s", name, host, bound, " (TLS)" if credentials is not None else "")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    if load is not None:
        started = time.perf_counter()
        load_task = asyncio.create_task(load())
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait({load_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if not load_task.done():
            load_task.cancel()
        else:
            stop_task.cancel()
            load_task.result()  # a failed load ends the process with its error
            logger.info("%s loaded in %.1f s", name, time.perf_counter() - started)

    if not stop.is_set():
        await _set_serving(health, service_names, True)
        logger.info("%s serving", name)
        if watchdog is not None:
            await _watch(name, watchdog, stop, health, service_names)
        await stop.wait()

    logger.info("%s draining (grace %.0f s)", name, grace)
    await health.enter_graceful_shutdown()
    if on_drain is not None:  # while the calls in flight still run
        await on_drain()
    await server.stop(grace)
    if on_shutdown is not None:
        await on_shutdown()
    logger.info("%s stopped", name)
    # The process exits next. Frozen, the heap (millions of objects torch and the model libraries made) is left
    # out of the collections of the interpreter's teardown, which would otherwise take seconds.
    gc.freeze()


async def _bind(
    server: grpc.aio.Server,
    name: str,
    host: str,
    port: int,
    port_flag: str,
    credentials: grpc.ServerCredentials | None,
) -> int:
    """Binds the port (TLS with `credentials`) and returns it; SystemExit naming the port and its flag where it
    cannot be bound (another process took it since the probe)."""
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:  # grpc's "Failed to bind to address"
        bound = 0
    if bound == 0:
        await server.stop(None)
        raise SystemExit(f"{name}: {bind_problem(host, port, port_flag) or f'could not bind {address} ({port_flag})'}")
    return bound


class AccessLogInterceptor(grpc.aio.ServerInterceptor):
    """Logs one line per finished call (method, status, seconds), inside the call's trace and log context,
    so a job's lines in every service share its trace id. Health checks and reflection are not logged."""

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler: grpc.RpcMethodHandler | None = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.lstrip("/").rpartition("/")[0] in PROBE_SERVICES:
            return handler  # type: ignore[return-value]  # grpc takes None: no such method
        return wrap_rpc_handler(handler, lambda context: _access_log(method, context))


def _access_log(method: str, context: grpc.aio.ServicerContext) -> contextlib.AbstractContextManager[None]:
    return observed_call(context, lambda code, seconds: logger.info("rpc %s %s %.3fs", method, code.name, seconds))


def configure_logging(level: str = "INFO", log_format: str = "text") -> None:
    """Logs to stderr, as text or one JSON object per line (with the job id, tenant and trace id when set)."""
    _configure_logging(level, log_format)
