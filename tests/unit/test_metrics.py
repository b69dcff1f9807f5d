"""Prometheus metrics: private registries, the orchestrator's helpers, /metrics over HTTP, the server interceptor."""

from __future__ import annotations

import argparse
import asyncio
import socket
import urllib.request
from collections.abc import AsyncIterator

import grpc
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry

from services.metrics import (
    MetricsServerInterceptor,
    OrchestratorMetrics,
    ServerMetrics,
    add_metrics_arguments,
    start_metrics_server,
)
from services.orchestrator.scheduler import TenantCounts
from services.orchestrator.stage_clients import StageError
from services.orchestrator.tenant_usage import TenantUsageCollector
from services.orchestrator.tenants import Quotas, Tenant
from services.tracing import server_interceptor as tracing_server_interceptor
from stagediff.v1 import stages_pb2

SERVICE = "test.Work"


def sample(metrics: OrchestratorMetrics | ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_each_metrics_object_has_its_own_registry() -> None:
    first, second = OrchestratorMetrics(), OrchestratorMetrics()  # the same names twice: no collision
    first.request_finished(tenant="acme", model="wan", code=grpc.StatusCode.OK, latency_s=12.0)
    assert sample(first, "stagediff_requests_total", tenant="acme", model="wan", grpc_code="OK") == 1
    assert sample(second, "stagediff_requests_total", tenant="acme", model="wan", grpc_code="OK") is None
    assert prometheus_client.REGISTRY.get_sample_value("stagediff_num_requests_running") is None
    ServerMetrics(), ServerMetrics()


def test_request_and_queue_helpers() -> None:
    metrics = OrchestratorMetrics()
    metrics.set_queue_depth(3)
    metrics.set_queue_depth(1, priority="high")
    metrics.set_queue_depth(2)  # idempotent: the latest depth wins
    metrics.observe_queue_time(4.0)
    metrics.observe_queue_time(0.2, priority="high")
    metrics.set_running(2)
    metrics.request_finished(tenant="", model="wan", code=grpc.StatusCode.OK, latency_s=75.0)
    metrics.request_finished(tenant="acme", model="wan", code=grpc.StatusCode.OK, latency_s=900.0)
    metrics.request_finished(tenant="acme", model="wan", code=grpc.StatusCode.DEADLINE_EXCEEDED, latency_s=30.0)
    metrics.request_finished(tenant="acme", model="wan", code=grpc.StatusCode.CANCELLED)

    assert sample(metrics, "stagediff_num_requests_waiting", priority="default") == 2
    assert sample(metrics, "stagediff_num_requests_waiting", priority="high") == 1
    assert sample(metrics, "stagediff_request_queue_time_seconds_count", priority="default") == 1
    assert sample(metrics, "stagediff_request_queue_time_seconds_bucket", priority="high", le="0.5") == 1
    assert sample(metrics, "stagediff_num_requests_running") == 2
    assert sample(metrics, "stagediff_requests_total", tenant="default", model="wan", grpc_code="OK") == 1
    for code in ("OK", "DEADLINE_EXCEEDED", "CANCELLED"):
        assert sample(metrics, "stagediff_requests_total", tenant="acme", model="wan", grpc_code=code) == 1
    # Only jobs that succeeded count towards the end-to-end latency; buckets reach an hour.
    e2e = "stagediff_e2e_request_latency_seconds"
    assert sample(metrics, f"{e2e}_count", tenant="acme", model="wan") == 1
    assert sample(metrics, f"{e2e}_bucket", tenant="acme", model="wan", le="600.0") == 0
    assert sample(metrics, f"{e2e}_bucket", tenant="acme", model="wan", le="900.0") == 1
    assert sample(metrics, f"{e2e}_bucket", tenant="default", model="wan", le="60.0") == 0
    assert sample(metrics, f"{e2e}_bucket", tenant="default", model="wan", le="3600.0") == 1


def test_stage_calls_are_timed_and_counted_by_how_they_ended() -> None:
    metrics = OrchestratorMetrics()
    with metrics.time_stage_call("dit", "10.0.0.5:50053"):
        pass
    with pytest.raises(StageError), metrics.time_stage_call("dit", "10.0.0.5:50053"):
        raise StageError("dit", "10.0.0.5:50053", grpc.StatusCode.UNAVAILABLE, "connection refused")
    rpc_error = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata())
    with pytest.raises(grpc.aio.AioRpcError), metrics.time_stage_call("dit", "10.0.0.5:50053"):
        raise rpc_error

    async def cancelled() -> None:
        with metrics.time_stage_call("vae", "10.0.0.6:50054"):
            await asyncio.Event().wait()

    async def cancel_one() -> None:
        task = asyncio.create_task(cancelled())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_one())
    dit = {"stage": "dit", "replica": "10.0.0.5:50053"}
    assert sample(metrics, "stagediff_stage_call_latency_seconds_count", **dit) == 3
    for code in ("OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"):
        assert sample(metrics, "stagediff_stage_calls_total", **dit, grpc_code=code) == 1
    assert sample(metrics, "stagediff_stage_calls_total", stage="vae", replica="10.0.0.6:50054", grpc_code="CANCELLED")


def test_health_retries_and_work_counters() -> None:
    metrics = OrchestratorMetrics()
    metrics.set_stage_health("vae", "a:1", True)
    metrics.set_stage_health("vae", "b:1", True)
    metrics.set_stage_health("vae", "b:1", False)
    metrics.stage_retry("vae")
    metrics.stage_failover("vae", "b:1")
    metrics.add_prompt_tokens("acme", 77)
    metrics.add_denoising_steps("acme")
    metrics.add_denoising_steps("acme", 3)
    metrics.add_denoising_pause("acme", "preempted")
    metrics.add_denoising_pause("acme", "preempted")
    metrics.add_denoising_pause("acme", "handoff")
    metrics.add_frames("acme", 33)
    metrics.add_frames("", 9)
    assert sample(metrics, "stagediff_stage_healthy", stage="vae", replica="a:1") == 1
    assert sample(metrics, "stagediff_stage_healthy", stage="vae", replica="b:1") == 0
    assert sample(metrics, "stagediff_stage_retries_total", stage="vae") == 1
    assert sample(metrics, "stagediff_stage_failovers_total", stage="vae", replica="b:1") == 1
    assert sample(metrics, "stagediff_prompt_tokens_total", tenant="acme") == 77
    assert sample(metrics, "stagediff_denoising_steps_total", tenant="acme") == 4
    assert sample(metrics, "stagediff_denoising_pauses_total", tenant="acme", reason="preempted") == 2
    assert sample(metrics, "stagediff_denoising_pauses_total", tenant="acme", reason="handoff") == 1
    assert sample(metrics, "stagediff_frames_generated_total", tenant="acme") == 33
    assert sample(metrics, "stagediff_frames_generated_total", tenant="default") == 9
    text = metrics.exposition().decode()
    assert "# TYPE stagediff_stage_healthy gauge" in text
    assert "# HELP stagediff_requests_total Requests that ended" in text


def test_transformer_passes_are_counted_by_tenant_method_and_result() -> None:
    metrics = OrchestratorMetrics()
    metrics.add_transformer_passes("acme", "teacache", stages_pb2.TransformerPasses(run=12, skipped=8))
    metrics.add_transformer_passes("acme", "teacache", stages_pb2.TransformerPasses(run=20, skipped=0))
    metrics.add_transformer_passes("acme", "none", stages_pb2.TransformerPasses(run=40))
    # A method no request can name (the orchestrator checked it) never becomes a label of its own.
    metrics.add_transformer_passes("acme", "x" * 64, stages_pb2.TransformerPasses(run=2))
    name = "stagediff_transformer_passes_total"
    assert sample(metrics, name, tenant="acme", method="teacache", result="run") == 32
    assert sample(metrics, name, tenant="acme", method="teacache", result="skipped") == 8
    assert sample(metrics, name, tenant="acme", method="none", result="run") == 42
    assert "x" * 64 not in metrics.exposition().decode()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_metrics_server_serves_only_its_registry() -> None:
    metrics = OrchestratorMetrics()
    metrics.set_running(3)
    assert start_metrics_server(0, metrics.registry) is None
    with pytest.raises(ValueError, match="--metrics-port 70000"):
        start_metrics_server(70000, metrics.registry)
    port = free_port()
    server, thread = start_metrics_server(port, metrics.registry, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            body = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert "stagediff_num_requests_running 3.0" in body
    assert "python_gc_objects_collected_total" not in body  # the process-wide default registry is not served

    parser = argparse.ArgumentParser()
    add_metrics_arguments(parser, default_port=9400)
    assert parser.parse_args([]).metrics_port == 9400
    assert parser.parse_args(["--metrics-port", "0"]).metrics_port == 0


class WorkServer:
    """A grpc.aio server with both interceptors, health, and handlers whose ends the test controls."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.server = grpc.aio.server(interceptors=[tracing_server_interceptor(), MetricsServerInterceptor(metrics)])
        handlers = {
            "Run": grpc.unary_unary_rpc_method_handler(self.run),
            "Watch": grpc.unary_stream_rpc_method_handler(self.watch),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), self.server)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def run(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"missing":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such job")
        if request == b"crash":
            raise RuntimeError("broken")
        if request in (b"wait", b"forever"):
            self.entered.set()
            await (self.release.wait() if request == b"wait" else asyncio.Event().wait())
        return b"done"

    async def watch(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"first"
        await asyncio.Event().wait()  # until the client cancels


async def until(condition, what: str) -> None:
    """Waits for a condition the server reaches on its own, after the client already has its answer."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def test_server_interceptor_records_latency_status_and_calls_in_flight() -> None:
    metrics = ServerMetrics()

    def calls(method: str, code: str) -> float:
        labels = {"grpc_service": SERVICE, "grpc_method": method, "grpc_code": code}
        return sample(metrics, "stagediff_server_request_latency_seconds_count", **labels) or 0

    def in_flight(method: str) -> float | None:
        return sample(metrics, "stagediff_server_requests_in_flight", grpc_service=SERVICE, grpc_method=method)

    async def main() -> None:
        work = WorkServer(metrics)
        await work.server.start()
        try:
            async with grpc.aio.insecure_channel(work.target) as channel:
                run = channel.unary_unary(f"/{SERVICE}/Run")
                assert await run(b"x") == b"done"
                for payload, code in ((b"missing", grpc.StatusCode.NOT_FOUND), (b"crash", grpc.StatusCode.UNKNOWN)):
                    with pytest.raises(grpc.aio.AioRpcError) as raised:
                        await run(payload)
                    assert raised.value.code() == code

                waiting = asyncio.ensure_future(run(b"wait"))
                await work.entered.wait()
                assert in_flight("Run") == 1
                work.release.set()
                assert await waiting == b"done"
                assert in_flight("Run") == 0

                work.entered.clear()
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await run(b"forever", timeout=0.5)
                assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await until(lambda: calls("Run", "DEADLINE_EXCEEDED") == 1, "the deadline recorded")

                stream = channel.unary_stream(f"/{SERVICE}/Watch")(b"")
                assert await stream.read() == b"first"
                assert in_flight("Watch") == 1
                stream.cancel()
                await until(lambda: calls("Watch", "CANCELLED") == 1, "the cancellation recorded")
                assert in_flight("Watch") == 0

                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        finally:
            await work.server.stop(None)

    asyncio.run(main())
    assert (calls("Run", "OK"), calls("Run", "NOT_FOUND"), calls("Run", "UNKNOWN")) == (2, 1, 1)
    assert in_flight("Run") == 0
    text = metrics.exposition().decode()
    assert "grpc.health.v1.Health" not in text  # probes are left out


def test_each_tenants_jobs_are_exported_beside_its_quota() -> None:
    limited = Tenant(name="acme", api_keys=(), quotas=Quotas(max_running_jobs=2, max_queued_jobs=8))
    registry = CollectorRegistry()
    counts = {"acme": TenantCounts(queued=3, running=2), "default": TenantCounts(queued=0, running=1)}
    registry.register(TenantUsageCollector({"acme": limited, "free": Tenant(name="free")}, lambda: counts))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("stagediff_tenant_jobs", tenant="acme", state="queued") == 3
    assert value("stagediff_tenant_jobs", tenant="acme", state="running") == 2
    assert value("stagediff_tenant_job_limit", tenant="acme", limit="max_running_jobs") == 2
    assert value("stagediff_tenant_job_limit", tenant="acme", limit="max_queued_jobs") == 8
    # A tenant without jobs shows none; one without limits has no limit series.
    assert value("stagediff_tenant_jobs", tenant="free", state="running") == 0
    assert value("stagediff_tenant_job_limit", tenant="free", limit="max_running_jobs") is None
    assert value("stagediff_tenant_jobs", tenant="default", state="running") == 1
