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

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tracing import TRACE_ID, TRACEPARENT

ROOT = Path(__file__).resolve().parents[2]
CONFIGURE_SCRIPT = f"""
from opentelemetry import trace
from opentelemetry.propagate import extract
from services.tracing import configure_tracing, start_span_under
provider = configure_tracing("stagediff-test")
print("provider:", type(provider).__name__, type(trace.get_tracer_provider()).__name__)
with start_span_under(extract({{"traceparent": "{TRACEPARENT}"}}), "job") as span:
    print("recording:", span.is_recording())
if provider is not None:
    provider.shutdown()
"""


@pytest.mark.parametrize("exporter", ["console", None])
def test_configure_tracing_installs_the_sdk_only_when_asked(exporter: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if exporter is not None:
        env["OTEL_TRACES_EXPORTER"] = exporter
    result = subprocess.run(
        [sys.executable, "-c", CONFIGURE_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    if exporter is None:
        assert "provider: NoneType ProxyTracerProvider" in result.stdout
        assert "recording: False" in result.stdout
    else:
        assert "provider: TracerProvider TracerProvider" in result.stdout
        assert "recording: True" in result.stdout
        # The console exporter prints the span: a child of the extracted parent, named for the service.
        assert f'"trace_id": "0x{TRACE_ID}"' in result.stdout
        assert '"parent_id": "0x00f067aa0ba902b7"' in result.stdout
        assert '"service.name": "stagediff-test"' in result.stdout
