"""What an operator sees of a running cluster: Prometheus metrics, one trace across every stage, JSON logs.

One cluster with the orchestrator's metrics port open and every service logging JSON. A request sent
under a trace context must leave log lines carrying that trace id in the orchestrator and in each
stage it went through, and the orchestrator's /metrics must count it.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from stagediff import Client
from stagediff.local.supervisor import LocalCluster
from tests.helpers.serving import THREADS_PER_STAGE

pytestmark = pytest.mark.e2e

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
REQUEST = dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=5.0, seed=3, interp_exp=1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def observed_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    metrics_port = _free_port()
    json_logs = ["--log-format", "json"]
    cluster = LocalCluster(
        tiny_model,
        threads_per_stage=THREADS_PER_STAGE,
        log_dir=tmp_path_factory.mktemp("observed-logs"),
        extra_args={
            "orchestrator": [*json_logs, "--metrics-port", str(metrics_port)],
            **{stage: json_logs for stage in ("text-encoder", "dit", "vae", "interp")},
        },
    )
    with cluster:
        yield cluster, metrics_port


def _json_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def _scrape_until_present(metrics_port: int, names: list[str], deadline_s: float = 10.0) -> str:
    """Scrapes /metrics until every name shows, or the deadline passes (then the caller's asserts say which).

    A server records a streamed call's latency when the stream closes, which can be just after the
    client has read the last event; the other series are written before the client gets its answer.
    """
    deadline = time.monotonic() + deadline_s
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            exposition = response.read().decode()
        if all(name in exposition for name in names) or time.monotonic() > deadline:
            return exposition
        time.sleep(0.05)


def test_one_trace_spans_the_client_and_every_stage_and_metrics_count_the_job(observed_cluster) -> None:
    cluster, metrics_port = observed_cluster
    parent = SpanContext(trace_id=TRACE_ID, span_id=0x00F067AA0BA902B7, is_remote=False, trace_flags=TraceFlags(1))
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(parent)))
    try:
        with Client(cluster.endpoint) as client:
            result = client.generate("a kite over the dunes", **REQUEST)
    finally:
        otel_context.detach(token)
    assert result.frames.shape[0] == 9

    trace_hex = f"{TRACE_ID:032x}"
    for name in ("orchestrator", "text-encoder", "dit", "vae", "interp"):
        records = _json_lines(cluster.services[name].log_path)
        assert records, f"{name} wrote no JSON log lines"
        traced = [record for record in records if record.get("trace_id") == trace_hex]
        print(f"{name}: {len(traced)} of {len(records)} log lines carry the client's trace id")
        assert traced, f"{name} logged nothing under the client's trace"
    orchestrator = _json_lines(cluster.services["orchestrator"].log_path)
    job_lines = [record for record in orchestrator if record.get("job_id") == result.job_id]
    assert job_lines and all(record.get("tenant") == "default" for record in job_lines)

    expected = [
        'stagediff_requests_total{grpc_code="OK",model="tiny",tenant="default"}',
        'stagediff_frames_generated_total{tenant="default"}',
        'stagediff_denoising_steps_total{tenant="default"}',
        "stagediff_stage_call_latency_seconds_count",
        "stagediff_stage_healthy",
        "stagediff_request_queue_time_seconds_count",
        "stagediff_server_request_latency_seconds_count",
    ]
    exposition = _scrape_until_present(metrics_port, expected)
    for name in expected:
        assert name in exposition, f"{name} missing from /metrics"
    counted = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in exposition.splitlines()
        if line.startswith(("stagediff_requests_total", "stagediff_frames_generated_total"))
    }
    print(counted)
    assert counted['stagediff_requests_total{grpc_code="OK",model="tiny",tenant="default"}'] >= 1
    assert counted['stagediff_frames_generated_total{tenant="default"}'] >= 9
