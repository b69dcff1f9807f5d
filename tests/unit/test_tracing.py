"""Trace context across real grpc.aio servers: client -> A -> B -> C, one trace end to end.

Each hop is a server with the tracing server interceptor whose handler calls the
next hop through a channel with the tracing client interceptors, as the
orchestrator calls its stages; the last hop answers with the traceparent it
received and the trace id current in its handler. Runs once with no SDK (the
API's no-op tracer, which must still carry the trace id through) and once with
an SDK TracerProvider and an in-memory exporter, where the spans' parent links
are checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.tracing import (
    client_interceptors,
    server_interceptor,
    set_grpc_status,
    span_exporter_names,
    span_exporters_from_env,
    start_span_under,
)
from tests.helpers.tracing import TRACE_ID, TRACEPARENT

SERVICE = "test.Chain"
KINDS = ("Unary", "ServerStream", "ClientStream", "Bidi")


def method(kind: str) -> str:
    """The full method name, which is also the name of its spans."""
    return f"/{SERVICE}/{kind}"


def current_trace_id() -> str | None:
    span_context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else None


def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """What the last hop answers: the traceparent it was sent and the trace id current in its handler."""
    seen = dict(context.invocation_metadata() or ()).get("traceparent")
    return json.dumps({"traceparent": seen, "trace_id": current_trace_id(), "request": request.decode()}).encode()


class Hop:
    """One server of the chain; forwards each call to `next_target` with the same kind, or echoes."""

    def __init__(self, next_target: str | None, provider: TracerProvider | None) -> None:
        self.next = None
        if next_target is not None:
            self.next = grpc.aio.insecure_channel(next_target, interceptors=client_interceptors(provider))
        self.server = grpc.aio.server(interceptors=[server_interceptor(provider)])
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
            "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream),
            "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if self.next is not None:
            return await self.next.unary_unary(method("Unary"))(request)
        if request == b"missing":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        if request == b"crash":
            raise RuntimeError("the handler broke")
        return echo(request, context)

    async def server_stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if self.next is not None:
            forwarded = self.next.unary_stream(method("ServerStream"))(request)
            try:
                async for response in forwarded:
                    yield response
            finally:
                forwarded.cancel()  # this call has ended: so does the one it made
            return
        yield echo(request, context)
        if request == b"hang":
            await asyncio.Event().wait()  # until the client cancels
        while request == b"flood":  # until the client cancels; sends block once flow control pushes back
            yield b"x" * (1 << 20)
        yield b"{}"

    async def client_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        received = [request async for request in requests]
        if self.next is not None:
            return await self.next.stream_unary(method("ClientStream"))(iter(received))
        return echo(b"".join(received), context)

    async def bidi(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if self.next is not None:
            forwarded = self.next.stream_stream(method("Bidi"))(requests)
            try:
                async for response in forwarded:
                    yield response
            finally:
                forwarded.cancel()
            return
        async for request in requests:
            yield echo(request, context)

    async def stop(self) -> None:
        await self.server.stop(None)
        if self.next is not None:
            await self.next.close()


@contextlib.asynccontextmanager
async def chain(length: int, provider: TracerProvider | None) -> AsyncIterator[str]:
    """Starts `length` hops, last first; yields the first hop's address."""
    hops: list[Hop] = []
    target = None
    try:
        for _ in range(length):
            hop = Hop(target, provider)
            await hop.server.start()
            hops.append(hop)
            target = hop.target
        yield target
    finally:
        for hop in reversed(hops):
            await hop.stop()


async def call(channel: grpc.aio.Channel, kind: str, payload: bytes = b"hello", metadata=None) -> dict:
    """Calls `kind` on the chain and returns the last hop's first answer."""
    if kind == "Unary":
        response = await channel.unary_unary(method(kind))(payload, metadata=metadata)
    elif kind == "ServerStream":
        responses = [r async for r in channel.unary_stream(method(kind))(payload, metadata=metadata)]
        assert len(responses) == 2
        response = responses[0]
    elif kind == "ClientStream":
        response = await channel.stream_unary(method(kind))(iter([payload[:2], payload[2:]]), metadata=metadata)
    else:
        responses = [r async for r in channel.stream_stream(method(kind))(iter([payload, payload]), metadata=metadata)]
        assert len(responses) == 2
        response = responses[0]
    return json.loads(response)


def in_memory_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def spans_when(exporter: InMemorySpanExporter, count: int, kind: SpanKind | None = None) -> list[ReadableSpan]:
    """The finished spans (of `kind`, default any) once there are `count` (a span may end just after its call)."""
    for _ in range(500):
        spans = [span for span in exporter.get_finished_spans() if kind is None or span.kind == kind]
        if len(spans) >= count:
            return spans
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {count} finished spans, got {[s.name for s in exporter.get_finished_spans()]}")


@pytest.mark.parametrize("kind", KINDS)
def test_trace_id_flows_through_three_servers_without_an_sdk(kind: str) -> None:
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider), "a test installed a global provider"

    async def main() -> dict:
        async with chain(3, provider=None) as first, grpc.aio.insecure_channel(first) as channel:
            return await call(channel, kind, metadata=(("traceparent", TRACEPARENT), ("x-other", "kept")))

    seen = asyncio.run(main())
    assert seen["trace_id"] == TRACE_ID
    # Nothing is recorded, so no hop makes a span of its own: the header reaches C as the client sent it.
    assert seen["traceparent"] == TRACEPARENT
    assert seen["request"] == "hello"


def test_without_a_traceparent_nothing_is_invented() -> None:
    async def main() -> dict:
        async with chain(2, provider=None) as first, grpc.aio.insecure_channel(first) as channel:
            return await call(channel, "Unary")

    seen = asyncio.run(main())
    assert seen["traceparent"] is None and seen["trace_id"] is None


@pytest.mark.parametrize("kind", KINDS)
def test_spans_form_one_tree_from_client_to_the_last_stage(kind: str) -> None:
    provider, exporter = in_memory_provider()

    async def main() -> tuple[dict, trace.Span, list[ReadableSpan]]:
        async with chain(3, provider) as first:
            async with grpc.aio.insecure_channel(first, interceptors=client_interceptors(provider)) as channel:
                with provider.get_tracer("test").start_as_current_span("request") as root:
                    seen = await call(channel, kind)
            return seen, root, await spans_when(exporter, 7)

    seen, root, spans = asyncio.run(main())
    assert len(spans) == 7
    trace_id = root.get_span_context().trace_id
    assert {span.context.trace_id for span in spans} == {trace_id}
    assert seen["trace_id"] == trace.format_trace_id(trace_id)

    by_id = {span.context.span_id: span for span in spans}
    children: dict[int, list[ReadableSpan]] = {}
    for span in spans:
        if span.parent is not None:
            assert span.parent.span_id in by_id, f"{span.name} has a parent outside the trace"
            children.setdefault(span.parent.span_id, []).append(span)
    # root -> client -> server -> client -> server -> client -> server: a single path, kinds alternating.
    path = [root.get_span_context().span_id]
    while path[-1] in children:
        (child,) = children[path[-1]]
        path.append(child.context.span_id)
    kinds = [by_id[span_id].kind for span_id in path]
    assert kinds == [SpanKind.INTERNAL] + [SpanKind.CLIENT, SpanKind.SERVER] * 3
    for span_id in path[1:]:
        span = by_id[span_id]
        assert span.name == method(kind)
        assert span.attributes["rpc.system"] == "grpc"
        assert (span.attributes["rpc.service"], span.attributes["rpc.method"]) == (SERVICE, kind)
        assert span.attributes["rpc.grpc.status_code"] == 0
        assert span.status.status_code == StatusCode.UNSET
    # The last client span is the parent C saw.
    last_client = by_id[path[-2]]
    parent_id = trace.format_span_id(last_client.context.span_id)
    _, seen_trace_id, seen_parent_id, flags = seen["traceparent"].split("-")
    assert (seen_trace_id, seen_parent_id) == (trace.format_trace_id(trace_id), parent_id)
    assert int(flags, 16) & 1, "sampled flag"


def test_span_status_follows_the_grpc_status() -> None:
    provider, exporter = in_memory_provider()

    async def main() -> tuple[grpc.StatusCode, grpc.StatusCode, list[ReadableSpan]]:
        codes = []
        async with chain(1, provider) as first:
            async with grpc.aio.insecure_channel(first, interceptors=client_interceptors(provider)) as channel:
                for payload in (b"missing", b"crash"):
                    with pytest.raises(grpc.aio.AioRpcError) as raised:
                        await channel.unary_unary(method("Unary"))(payload)
                    codes.append(raised.value.code())
            return *codes, await spans_when(exporter, 4)

    missing, crash, spans = asyncio.run(main())
    assert (missing, crash) == (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNKNOWN)
    client = {span.attributes["rpc.grpc.status_code"]: span for span in spans if span.kind == SpanKind.CLIENT}
    assert sorted(client) == [2, 5]
    assert all(span.status.status_code == StatusCode.ERROR for span in client.values())
    assert "no such thing" in client[5].status.description
    server = [span for span in spans if span.kind == SpanKind.SERVER]
    (aborted,) = [span for span in server if span.attributes["rpc.grpc.status_code"] == 5]
    # NOT_FOUND is the caller's doing: the server span is not an error.
    assert aborted.status.status_code == StatusCode.UNSET
    # The exception a handler did not handle is recorded on its server span.
    (crashed,) = [span for span in server if span is not aborted]
    recorded = {(e.attributes["exception.type"], e.attributes["exception.message"]) for e in crashed.events}
    assert recorded == {("RuntimeError", "the handler broke")}


@pytest.mark.parametrize("mode", ["hang", "flood"])
def test_a_cancelled_stream_ends_the_server_spans(mode: str) -> None:
    """Cancelled while the handlers await (hang) or while grpc waits to send what they yielded (flood): the
    span of every server the call reached ends. A hop that was waiting on the call it made, as the
    orchestrator waits on a stage, sees its wait cancelled, and the span of that call ends too."""
    provider, exporter = in_memory_provider()

    async def main() -> tuple[list[ReadableSpan], list[ReadableSpan]]:
        interceptors = client_interceptors(provider)
        async with chain(2, provider) as first, grpc.aio.insecure_channel(first, interceptors=interceptors) as channel:
            stream = channel.unary_stream(method("ServerStream"))(mode.encode())
            first_answer = json.loads(await stream.read())
            assert first_answer["request"] == mode
            if mode == "flood":
                await stream.read()  # the server is streaming megabytes now
            stream.cancel()
            server = await spans_when(exporter, 2, SpanKind.SERVER)
            forwarded = await spans_when(exporter, 1, SpanKind.CLIENT) if mode == "hang" else []
            return server, forwarded

    server, forwarded = asyncio.run(main())
    assert [span.name for span in server] == [method("ServerStream")] * 2
    assert len({span.context.trace_id for span in server}) == 1
    if mode == "hang":
        (call,) = forwarded
        assert (call.name, call.context.trace_id) == (method("ServerStream"), server[0].context.trace_id)


def test_health_checks_and_reflection_make_no_spans() -> None:
    """Probes run every second outside any request; traced, each would be a trace of its own."""
    provider, exporter = in_memory_provider()

    async def main() -> tuple[int, list[str]]:
        hop = Hop(None, provider)
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), hop.server)
        reflection.enable_server_reflection([SERVICE, reflection.SERVICE_NAME], hop.server)
        await hop.server.start()
        try:
            async with grpc.aio.insecure_channel(hop.target, interceptors=client_interceptors(provider)) as channel:
                response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                )
                services = [s.name async for answer in listing for s in answer.list_services_response.service]
                await call(channel, "Unary")
                await spans_when(exporter, 2)
        finally:
            await hop.stop()
        return response.status, services

    status, services = asyncio.run(main())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert SERVICE in services
    assert sorted(span.name for span in exporter.get_finished_spans()) == [method("Unary")] * 2


def test_a_job_runs_under_the_request_that_submitted_it() -> None:
    """A job task started from another job's task still joins the trace of its own request."""
    provider, exporter = in_memory_provider()
    tracer = provider.get_tracer("test")

    async def job(parent: otel_context.Context, job_id: str, fail: bool) -> None:
        with start_span_under(parent, "job", attributes={"stagediff.job_id": job_id}, tracer_provider=provider) as span:
            with tracer.start_as_current_span("stage call"):
                pass
            if fail:
                raise RuntimeError("stage broke")
            set_grpc_status(span, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded in dit")

    async def main() -> tuple[trace.Span, trace.Span]:
        with tracer.start_as_current_span("request A") as request_a:
            context_a = otel_context.get_current()
        with tracer.start_as_current_span("request B") as request_b:
            context_b = otel_context.get_current()
        with trace.use_span(request_a):  # job B's task is created while A's context is current
            first = asyncio.create_task(job(context_a, "a", fail=True))
            second = asyncio.create_task(job(context_b, "b", fail=False))
        with pytest.raises(RuntimeError):
            await first
        await second
        return request_a, request_b

    request_a, request_b = asyncio.run(main())
    spans = exporter.get_finished_spans()
    jobs = {span.attributes["stagediff.job_id"]: span for span in spans if span.name == "job"}
    assert jobs["a"].parent.span_id == request_a.get_span_context().span_id
    assert jobs["b"].parent.span_id == request_b.get_span_context().span_id
    assert jobs["b"].context.trace_id == request_b.get_span_context().trace_id
    stage_parents = sorted(span.parent.span_id for span in spans if span.name == "stage call")
    assert stage_parents == sorted(job.context.span_id for job in jobs.values())
    assert jobs["a"].status.status_code == StatusCode.ERROR and "stage broke" in jobs["a"].status.description
    assert jobs["b"].status.status_code == StatusCode.ERROR
    assert jobs["b"].attributes["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


def test_exporters_named_by_the_environment() -> None:
    assert span_exporter_names({}) == []
    assert span_exporter_names({"OTEL_TRACES_EXPORTER": "otlp, console"}) == ["otlp", "console"]
    assert span_exporter_names({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}) == ["otlp"]
    assert span_exporter_names({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}) == []
    assert span_exporter_names({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}) == []
    (exporter,) = span_exporters_from_env({"OTEL_TRACES_EXPORTER": "console"})
    assert isinstance(exporter, ConsoleSpanExporter)
    with pytest.raises(ValueError, match="no span exporter named 'nosuch'.*console"):
        span_exporters_from_env({"OTEL_TRACES_EXPORTER": "nosuch"})
