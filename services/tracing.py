"""Trace context across gRPC: the W3C `traceparent` travels in call metadata.

One trace spans the client, the orchestrator and every stage it calls:

- clients (the SDK, the orchestrator's stage channels) inject the current
  context into each call's metadata (`tracing_client_interceptors` for
  grpc.aio channels, `TracingSyncClientInterceptor` or `inject_metadata` for
  blocking grpc);
- servers extract it from the incoming metadata and run each handler inside a
  SERVER span named after the RPC (`TracingServerInterceptor`), so that any call
  the handler makes carries the same trace id onwards;
- the orchestrator's stage calls each get a CLIENT span, a child of the span
  current in the job's task (`start_span_under` makes one for the job).

Propagation needs only opentelemetry-api. Without an SDK the API's tracer
records nothing, but a span started under an extracted context is a
NonRecordingSpan that carries the incoming trace and span ids, so the
`traceparent` a process sends on equals the one it received and the trace id
reaches every stage unchanged. Spans are recorded and exported only when the
process configures an exporter through the standard OpenTelemetry variables
(`configure_tracing`):

- `OTEL_TRACES_EXPORTER`: comma-separated exporter names, e.g. `otlp` (needs the
  opentelemetry-exporter-otlp package) or `console`; `none` turns exporting off;
- `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` alone
  imply `otlp`; the OTLP exporter reads its other `OTEL_EXPORTER_OTLP_*`
  settings (protocol, headers, timeout) itself;
- `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`
  and `OTEL_SDK_DISABLED` mean what the OpenTelemetry specification says.

The wire format is always W3C trace context, whatever `OTEL_PROPAGATORS` says:
it is the contract between StageDiff processes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

TRACER_NAME = "stagediff"
TRACE_METADATA_KEYS = ("traceparent", "tracestate")
EXPORTER_ENTRY_POINT_GROUP = "opentelemetry_traces_exporter"
# Services that answer probes, not work. Health checks run every second or so
# outside any request: traced, each would be a trace of its own.
PROBE_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")

_PROPAGATOR = TraceContextTextMapPropagator()

# Server status codes that mean the server failed (OpenTelemetry's gRPC conventions);
# the others (NOT_FOUND, INVALID_ARGUMENT, ...) are the caller's doing.
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

MetadataPairs = Iterable[tuple[str, str | bytes]]


# ----------------------------------------------------------------- propagation --


class _MetadataGetter:
    """Reads a TextMap carrier that is gRPC metadata: (key, value) pairs, keys lower case."""

    def get(self, carrier: MetadataPairs, key: str) -> list[str] | None:
        values = [value if isinstance(value, str) else value.decode() for k, value in carrier if k == key.lower()]
        return values or None

    def keys(self, carrier: MetadataPairs) -> list[str]:
        return [key for key, _ in carrier]


_GETTER = _MetadataGetter()


def inject_metadata(
    metadata: MetadataPairs | None = None, context: Context | None = None
) -> list[tuple[str, str | bytes]]:
    """Returns `metadata` plus the W3C trace headers of `context` (default: the current one).

    Trace headers already in `metadata` are replaced, so metadata reused for a
    retried call never carries two parents.
    """
    kept = [(key, value) for key, value in (metadata or ()) if key not in TRACE_METADATA_KEYS]
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers, context=context)
    return kept + sorted(headers.items())


def extract_context(metadata: MetadataPairs | None) -> Context:
    """The context carried by incoming metadata (an empty one when it has no valid traceparent)."""
    return _PROPAGATOR.extract(list(metadata or ()), getter=_GETTER)


def current_trace_id() -> str | None:
    """The current trace id as 32 hex digits, or None outside any trace."""
    span_context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else None


def get_tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """StageDiff's tracer: from `tracer_provider`, else from the global provider (no-op until configured)."""
    return trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)


@contextlib.contextmanager
def attached(context: Context) -> Iterator[None]:
    """Makes `context` current for the block.

    The context is restored only in the asyncio task that attached it. A
    streaming handler's generator may be closed from another task (asyncio's
    finalizer closes an abandoned generator in a fresh task); restoring there
    would fail, and is not needed, since the attaching task has ended.
    """
    token = otel_context.attach(context)
    task = _current_task()
    try:
        yield
    finally:
        if _current_task() is task:
            otel_context.detach(token)


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop: a plain thread
        return None


@contextlib.contextmanager
def start_span_under(
    parent: Context | None,
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> Iterator[Span]:
    """Starts a span whose parent is `parent`, a context captured elsewhere, and makes it current.

    For work that runs in a task created outside the request that asked for it:
    a job's task may be started while another job's context is current, so the
    job keeps the context of the request that submitted it and runs under it.
    Exceptions mark the span as failed and propagate.
    """
    parent = parent if parent is not None else Context()
    span = get_tracer(tracer_provider).start_span(name, context=parent, kind=kind, attributes=attributes)
    with attached(trace.set_span_in_context(span, parent)):
        try:
            yield span
        except BaseException as error:
            if not isinstance(error, (asyncio.CancelledError, GeneratorExit)):
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            raise
        finally:
            span.end()


# ------------------------------------------------------------ configuration --


def span_exporter_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """The span exporter names the OTEL_* variables ask for; empty when tracing is off or not configured."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [name.strip() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if not names and (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    return [] if "none" in names else names


def span_exporters_from_env(environ: Mapping[str, str] | None = None) -> list[Any]:
    """The span exporters that the OTEL_* variables ask for; empty when tracing is not configured.

    Exporters are found by name through the `opentelemetry_traces_exporter`
    entry points, where the SDK registers `console` and exporter packages
    register theirs (`otlp`, `otlp_proto_http`, `zipkin_json`, ...).
    """
    exporters = []
    for name in span_exporter_names(environ):
        found = list(entry_points(group=EXPORTER_ENTRY_POINT_GROUP, name=name))
        if not found:
            installed = sorted({point.name for point in entry_points(group=EXPORTER_ENTRY_POINT_GROUP)})
            hint = "; install opentelemetry-exporter-otlp for otlp" if name.startswith("otlp") else ""
            raise ValueError(
                f"OTEL_TRACES_EXPORTER: no span exporter named '{name}' is installed "
                f"(installed: {', '.join(installed) or 'none'}){hint}"
            )
        exporters.append(found[0].load()())
    return exporters


def configure_tracing(service_name: str, exporters: list[Any] | None = None) -> trace.TracerProvider | None:
    """Installs the SDK's TracerProvider when an exporter is configured; returns it, or None.

    `exporters` defaults to what the OTEL_* variables ask for. With none, the
    process keeps the API's no-op tracer, which still forwards incoming trace
    context. `service_name` names the process in traces unless OTEL_SERVICE_NAME
    is set. The provider flushes its spans when the process exits.
    """
    if exporters is None:
        exporters = span_exporters_from_env()
    if not exporters:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


# ------------------------------------------------------- server-side wrapping --


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


RpcScope = Callable[[grpc.aio.ServicerContext], contextlib.AbstractContextManager[Any]]


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
    if handler.unary_unary:
        unary_unary = handler.unary_unary

        async def wrapped_unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with scope(context):
                return await unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(wrapped_unary_unary, deserialize, serialize)
    if handler.unary_stream:
        unary_stream = handler.unary_stream
        return grpc.unary_stream_rpc_method_handler(_wrap_streaming(unary_stream, scope), deserialize, serialize)
    if handler.stream_unary:
        stream_unary = handler.stream_unary

        async def wrapped_stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            with scope(context):
                return await stream_unary(requests, context)

        return grpc.stream_unary_rpc_method_handler(wrapped_stream_unary, deserialize, serialize)
    return grpc.stream_stream_rpc_method_handler(_wrap_streaming(handler.stream_stream, scope), deserialize, serialize)


def _wrap_streaming(behavior: Callable[..., Any], scope: RpcScope) -> Callable[..., Any]:
    """Wraps a response-streaming behaviour, keeping its kind: grpc.aio runs each kind differently."""
    if not inspect.isasyncgenfunction(behavior):  # a coroutine that writes with context.write

        async def wrapped_writer(request_or_requests: Any, context: grpc.aio.ServicerContext) -> None:
            with scope(context):
                await behavior(request_or_requests, context)

        return wrapped_writer

    async def wrapped_generator(request_or_requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        # When a call ends while grpc waits to send a response, grpc drops this generator and asyncio
        # closes it from another task: the scope is left there (see `attached`).
        with scope(context):
            # Closing this generator closes the handler's at once, so its cleanup runs inside the scope.
            async with contextlib.aclosing(behavior(request_or_requests, context)) as responses:
                async for response in responses:
                    yield response

    return wrapped_generator


# ------------------------------------------------------------ interceptors --


def _names(method: str | bytes) -> tuple[str, str, str]:
    """'/pkg.Service/Method' -> (span name 'pkg.Service/Method', service, method)."""
    full = method.decode() if isinstance(method, bytes) else method
    full = full.lstrip("/")
    service, _, name = full.rpartition("/")
    return full, service, name


def _rpc_attributes(method: str | bytes, extra: Attributes = None) -> dict[str, Any]:
    _, service, name = _names(method)
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, **dict(extra or {})}


def set_grpc_status(span: Span, code: grpc.StatusCode, description: str = "", *, server: bool = False) -> None:
    """Records a gRPC status on a span (`rpc.grpc.status_code`); a failure marks the span as an error.

    On SERVER spans only codes that mean the server failed count as errors;
    a job span is like a client's: anything but OK failed.
    """
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    failed = code in _SERVER_ERROR_CODES if server else code != grpc.StatusCode.OK
    if failed:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {description}" if description else code.name))


def _end_span(span: Span, code: grpc.StatusCode, *, server: bool, description: str = "") -> None:
    set_grpc_status(span, code, description, server=server)
    span.end()


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Runs every handler inside a SERVER span whose parent is the caller's traceparent.

    Put it first in the server's interceptor list, so that everything after it
    (other interceptors, the handler, its logs and outgoing calls) sees the span.
    """

    def __init__(
        self, tracer_provider: trace.TracerProvider | None = None, skip_services: tuple[str, ...] = PROBE_SERVICES
    ) -> None:
        self._tracer = get_tracer(tracer_provider)
        self._skip_services = skip_services

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or _names(method)[1] in self._skip_services:
            return handler
        parent = extract_context(handler_call_details.invocation_metadata)
        return wrap_rpc_handler(handler, lambda context: self._server_span(method, parent, context))

    @contextlib.contextmanager
    def _server_span(self, method: str, parent: Context, context: grpc.aio.ServicerContext) -> Iterator[None]:
        name, _, _ = _names(method)
        span = self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=_rpc_attributes(method))
        with attached(trace.set_span_in_context(span, parent)):
            try:
                yield
            except BaseException as error:
                code = rpc_status(context, error)
                if code == grpc.StatusCode.UNKNOWN:
                    span.record_exception(error)
                    description = f"{type(error).__name__}: {error}"
                else:  # aborted with a status and its details, cancelled, or past the deadline
                    description = context.details() or ""
                _end_span(span, code, server=True, description=description)
                raise
            _end_span(span, rpc_status(context, None), server=True, description=context.details() or "")


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    """ClientCallDetails for blocking channels (grpc offers no concrete class for them)."""


class _ClientSpans:
    """Starts a CLIENT span per call and puts its traceparent into the call's metadata."""

    def __init__(
        self, tracer_provider: trace.TracerProvider | None, attributes: Attributes, skip_services: tuple[str, ...]
    ) -> None:
        self._tracer = get_tracer(tracer_provider)
        self._attributes = dict(attributes or {})
        self._skip_services = skip_services

    def _skips(self, details: grpc.ClientCallDetails) -> bool:
        return _names(details.method)[1] in self._skip_services

    def _start(self, details: grpc.ClientCallDetails) -> tuple[Span, list[tuple[str, str | bytes]]]:
        name, _, _ = _names(details.method)
        span = self._tracer.start_span(
            name, kind=SpanKind.CLIENT, attributes=_rpc_attributes(details.method, self._attributes)
        )
        metadata = inject_metadata(details.metadata, trace.set_span_in_context(span))
        return span, metadata


class _AioClientInterceptor(_ClientSpans):
    """The grpc.aio side: the span ends when the call's done callback reports its status."""

    def __init__(
        self, tracer_provider: trace.TracerProvider | None, attributes: Attributes, skip_services: tuple[str, ...]
    ) -> None:
        super().__init__(tracer_provider, attributes, skip_services)
        self._finishing: set[asyncio.Task] = set()

    async def _intercept(self, continuation: Callable[..., Awaitable[Any]], details: Any, request: Any) -> Any:
        if self._skips(details):
            return await continuation(details, request)
        span, metadata = self._start(details)
        try:
            call = await continuation(details._replace(metadata=grpc.aio.Metadata(*metadata)), request)
        except grpc.aio.AioRpcError as error:
            _end_span(span, error.code(), server=False, description=error.details() or "")
            raise
        except BaseException:
            _end_span(span, grpc.StatusCode.UNKNOWN, server=False)
            raise
        try:
            call.add_done_callback(lambda done: self._finish_later(span, done))
        except NotImplementedError:  # a later interceptor answered without calling the server
            _end_span(span, grpc.StatusCode.OK, server=False)
        return call

    def _finish_later(self, span: Span, call: grpc.aio.Call) -> None:
        # An aio call reports its status through coroutines, while done callbacks are plain functions.
        task = asyncio.get_running_loop().create_task(self._finish(span, call))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    @staticmethod
    async def _finish(span: Span, call: grpc.aio.Call) -> None:
        try:
            code, details = await call.code(), await call.details()
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, ""
        _end_span(span, code, server=False, description=details or "")


class _UnaryUnary(_AioClientInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_AioClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnary(_AioClientInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStream(_AioClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await self._intercept(continuation, client_call_details, request_iterator)


def tracing_client_interceptors(
    tracer_provider: trace.TracerProvider | None = None,
    attributes: Attributes = None,
    skip_services: tuple[str, ...] = PROBE_SERVICES,
) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a grpc.aio channel: every call gets a CLIENT span and carries its traceparent.

    grpc.aio files each interceptor under one kind of call only, hence one per
    kind. `attributes` go on every span, e.g. {"stagediff.stage": "dit",
    "server.address": endpoint} for a stage channel. Calls to `skip_services`
    (health checks, reflection) pass untouched.
    """
    kinds = (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)
    return [kind(tracer_provider, attributes, skip_services) for kind in kinds]


class TracingSyncClientInterceptor(
    _ClientSpans,
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """The same for blocking channels: `grpc.intercept_channel(channel, TracingSyncClientInterceptor())`."""

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        attributes: Attributes = None,
        skip_services: tuple[str, ...] = PROBE_SERVICES,
    ) -> None:
        super().__init__(tracer_provider, attributes, skip_services)

    def _intercept(self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any) -> Any:
        if self._skips(details):
            return continuation(details, request)
        span, metadata = self._start(details)
        new_details = _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )
        try:
            call = continuation(new_details, request)
        except BaseException:
            _end_span(span, grpc.StatusCode.UNKNOWN, server=False)
            raise
        call.add_done_callback(
            lambda done: _end_span(span, done.code(), server=False, description=done.details() or "")
        )
        return call

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return self._intercept(continuation, client_call_details, request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return self._intercept(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return self._intercept(continuation, client_call_details, request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return self._intercept(continuation, client_call_details, request_iterator)
