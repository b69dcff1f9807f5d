"""Traces across the cluster, with OpenTelemetry's gRPC instrumentation.

One trace spans the client, the orchestrator and every stage it calls:
- the client sends the caller's W3C `traceparent` with each call (stagediff/_tracing.py);
- every server runs each call in a SERVER span named after the RPC, a child of the incoming trace context
  (`server_interceptor`), so any call the handler makes carries the same trace id onwards;
- the orchestrator's channels to the stages give each stage call a CLIENT span (`client_interceptors`);
- a job's task runs under a span whose parent is the submitting request's context (`start_span_under`).
Health checks and reflection (`PROBE_SERVICES`) run outside any request and are left out of traces.

Propagation needs only opentelemetry-api: without an SDK nothing is recorded, but the trace id still reaches
every stage unchanged. The propagators are OpenTelemetry's (`OTEL_PROPAGATORS`, W3C trace context and baggage
by default). Spans are exported only when the process configures an exporter through the standard variables
(`configure_tracing`):
- `OTEL_TRACES_EXPORTER`: comma-separated exporter names, e.g. `otlp` (needs opentelemetry-exporter-otlp) or
  `console`; `none` turns exporting off;
- `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` alone imply `otlp`;
- `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]` and `OTEL_SDK_DISABLED` mean what
  the OpenTelemetry specification says.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import Attributes

from services.call_scope import PROBE_SERVICES

TRACER_NAME = "stagediff"
EXPORTER_ENTRY_POINT_GROUP = "opentelemetry_traces_exporter"

# Every call but the probes'.
_TRACED = filters.negate(filters.any_of(*(filters.service_name(service) for service in PROBE_SERVICES)))


def server_interceptor(tracer_provider: trace.TracerProvider | None = None) -> grpc.aio.ServerInterceptor:
    """Runs every call but the probes' inside a SERVER span whose parent is the caller's trace context.

    Put it first in the server's interceptor list, so that everything after it
    (other interceptors, the handler, its logs and outgoing calls) sees the span.
    """
    return aio_server_interceptor(tracer_provider, filter_=_TRACED)


def client_interceptors(tracer_provider: trace.TracerProvider | None = None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a grpc.aio channel: every call but the probes' gets a CLIENT span and sends its
    traceparent."""
    return aio_client_interceptors(tracer_provider, filter_=_TRACED)


def get_tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """StageDiff's tracer: from `tracer_provider`, else from the global provider (no-op until configured)."""
    return trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)


def start_span_under(
    parent: Context | None,
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> contextlib.AbstractContextManager[Span]:
    """Starts a span whose parent is `parent`, a context captured elsewhere (None: a new trace), and makes it
    current for the block.

    For work that runs in a task created outside the request that asked for it:
    a job's task may be started while another job's context is current, so the
    job keeps the context of the request that submitted it and runs under it.
    An exception marks the span as failed and propagates; a cancellation does not.
    """
    return get_tracer(tracer_provider).start_as_current_span(
        name, context=parent if parent is not None else Context(), kind=kind, attributes=attributes
    )


def set_grpc_status(span: Span, code: grpc.StatusCode, description: str = "") -> None:
    """Records how the work of a span ended as a gRPC status (`rpc.grpc.status_code`); anything but OK
    marks the span as failed."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {description}" if description else code.name))


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
