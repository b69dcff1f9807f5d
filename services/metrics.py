"""Prometheus metrics of the orchestrator and of every gRPC server, with prometheus-client.

Names follow what users know from vLLM (`vllm:num_requests_running`,
`vllm:e2e_request_latency_seconds`) and Triton, with the prefix `stagediff_`.
An underscore rather than vLLM's colon: Prometheus reserves colons for
recording rules, and an underscore name needs no quoting in any PromQL or
OpenMetrics tool. Durations are in seconds, counters end in `_total`, and gRPC
statuses are the code names (`OK`, `UNAVAILABLE`) in a `grpc_code` label, as in
go-grpc-prometheus.

Each metrics object owns a CollectorRegistry (never the process-wide default),
so several servers in one process, and tests, never collide;
`start_metrics_server(port, registry)` serves one registry at /metrics.
Recording methods may be called from any thread: prometheus-client locks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from families.base import CACHE_METHODS
from services.call_scope import PROBE_SERVICES, observed_call, wrap_rpc_handler
from stagediff.v1 import stages_pb2

PREFIX = "stagediff_"
DEFAULT_LABEL = "default"  # for a tenant or priority class the request does not name

# A diffusion job waits and runs for seconds to many minutes: buckets reach an hour.
JOB_LATENCY_BUCKETS = (1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 240, 300, 450, 600, 900, 1200, 1800, 2700, 3600)
QUEUE_TIME_BUCKETS = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# Stage calls range from a text encoding (tens of milliseconds) to a full denoising run (minutes).
CALL_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)


def _label(value: str | None) -> str:
    return value or DEFAULT_LABEL


def status_of(error: BaseException | None) -> grpc.StatusCode:
    """The gRPC status an exception stands for: an RPC error's own, a StageError's `code`, else UNKNOWN."""
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        return error.code()
    code = getattr(error, "code", None)
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.UNKNOWN


class OrchestratorMetrics:
    """The orchestrator's view: requests, the queue, jobs in flight, each stage replica, work done.

    The metric objects are public for anything the helpers do not cover; the
    helpers keep label names and values consistent.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "Requests that ended, by tenant, model and final gRPC status.",
            ["tenant", "model", "grpc_code"],
            registry=r,
        )
        self.requests_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Jobs queued, by priority class.", ["priority"], registry=r
        )
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time jobs waited in the queue before they started, by priority class.",
            ["priority"],
            buckets=QUEUE_TIME_BUCKETS,
            registry=r,
        )
        self.requests_running = Gauge(PREFIX + "num_requests_running", "Jobs running in the stages.", registry=r)
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from admission to the last result of jobs that succeeded, by tenant and model.",
            ["tenant", "model"],
            buckets=JOB_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_call_latency = Histogram(
            PREFIX + "stage_call_latency_seconds",
            "Duration of the orchestrator's calls to a stage replica, whatever their outcome.",
            ["stage", "replica"],
            buckets=CALL_LATENCY_BUCKETS,
            registry=r,
        )
        self.model_stage_latency = Histogram(
            PREFIX + "model_stage_call_latency_seconds",
            "Duration of the orchestrator's calls to a stage for one model, whatever their outcome and replica.",
            ["model", "stage"],
            buckets=CALL_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_calls = Counter(
            PREFIX + "stage_calls",
            "Calls to a stage replica, by gRPC status.",
            ["stage", "replica", "grpc_code"],
            registry=r,
        )
        self.stage_healthy = Gauge(
            PREFIX + "stage_healthy",
            "1 while a stage replica reports SERVING, 0 otherwise.",
            ["stage", "replica"],
            registry=r,
        )
        self.stage_retries = Counter(
            PREFIX + "stage_retries", "Stage calls retried after an UNAVAILABLE stage.", ["stage"], registry=r
        )
        self.stage_failovers = Counter(
            PREFIX + "stage_failovers",
            "Stage calls moved to another replica, by the replica that failed.",
            ["stage", "replica"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens the text encoder encoded, by tenant.", ["tenant"], registry=r
        )
        self.denoising_steps = Counter(
            PREFIX + "denoising_steps", "Denoising steps the DiT completed, by tenant.", ["tenant"], registry=r
        )
        self.denoising_pauses = Counter(
            PREFIX + "denoising_pauses",
            "Jobs whose denoising stopped at a step boundary with its state kept, by tenant and reason (preempted: "
            "for a job of a higher class; handoff: its DiT replica drained).",
            ["tenant", "reason"],
            registry=r,
        )
        self.frames_generated = Counter(
            PREFIX + "frames_generated", "Frames sent to clients, by tenant.", ["tenant"], registry=r
        )
        self.transformer_passes = Counter(
            PREFIX + "transformer_passes",
            "Transformer passes (one per step and guidance branch) the DiT ran in full or its step cache skipped, "
            "by tenant and cache method.",
            ["tenant", "method", "result"],
            registry=r,
        )

    # ------------------------------------------------------------ requests --

    def request_finished(
        self, *, tenant: str, model: str, code: grpc.StatusCode, latency_s: float | None = None
    ) -> None:
        """Counts a job that reached its final state; an OK job's `latency_s` feeds the e2e histogram."""
        self.requests.labels(_label(tenant), model, code.name).inc()
        if code == grpc.StatusCode.OK and latency_s is not None:
            self.e2e_latency.labels(_label(tenant), model).observe(latency_s)

    def set_queue_depth(self, depth: int, priority: str = DEFAULT_LABEL) -> None:
        """Sets the depth of one priority class's queue; call after every change, it is idempotent."""
        self.requests_waiting.labels(_label(priority)).set(depth)

    def observe_queue_time(self, seconds: float, priority: str = DEFAULT_LABEL) -> None:
        self.queue_time.labels(_label(priority)).observe(seconds)

    def set_running(self, count: int) -> None:
        self.requests_running.set(count)

    # -------------------------------------------------------------- stages --

    @contextlib.contextmanager
    def time_stage_call(self, stage: str, replica: str, model: str = "") -> Iterator[None]:
        """Times a stage call made inside the block, and counts it by the status it ended with.

        The status comes from the exception leaving the block (an AioRpcError, a
        StageError's `code`, a cancellation); a block that ends normally is OK.
        """
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            yield
        except BaseException as raised:
            error = raised
            raise
        finally:
            seconds = time.perf_counter() - started
            self.observe_stage_call(stage, replica, seconds, status_of(error))
            if model:  # one of the served models (routes.py bounds them)
                self.model_stage_latency.labels(model, stage).observe(seconds)

    def observe_stage_call(self, stage: str, replica: str, seconds: float, code: grpc.StatusCode) -> None:
        self.stage_call_latency.labels(stage, replica).observe(seconds)
        self.stage_calls.labels(stage, replica, code.name).inc()

    def set_stage_health(self, stage: str, replica: str, serving: bool) -> None:
        self.stage_healthy.labels(stage, replica).set(1 if serving else 0)

    def stage_retry(self, stage: str) -> None:
        self.stage_retries.labels(stage).inc()

    def forget_stage_replica(self, stage: str, replica: str) -> None:
        """Drops the series of a replica no longer listed (discovery), so that a pool whose members come and go
        keeps a bounded set of label values."""
        for metric in (self.stage_call_latency, self.stage_healthy, self.stage_failovers):
            with contextlib.suppress(KeyError):
                metric.remove(stage, replica)
        for code in grpc.StatusCode:
            with contextlib.suppress(KeyError):
                self.stage_calls.remove(stage, replica, code.name)

    def stage_failover(self, stage: str, failed_replica: str) -> None:
        self.stage_failovers.labels(stage, failed_replica).inc()

    # ----------------------------------------------------------------- work --

    def add_prompt_tokens(self, tenant: str, count: int) -> None:
        self.prompt_tokens.labels(_label(tenant)).inc(count)

    def add_denoising_steps(self, tenant: str, count: int = 1) -> None:
        self.denoising_steps.labels(_label(tenant)).inc(count)

    def add_denoising_pause(self, tenant: str, reason: str) -> None:
        """Counts a pause; `reason` is "preempted" or "handoff"."""
        self.denoising_pauses.labels(_label(tenant), reason).inc()

    def add_transformer_passes(self, tenant: str, method: str, passes: stages_pb2.TransformerPasses) -> None:
        """Counts a request's passes (a TransformerPasses); `method` is one the request was checked to name."""
        method = method if method in CACHE_METHODS else "none"
        self.transformer_passes.labels(_label(tenant), method, "run").inc(passes.run)
        self.transformer_passes.labels(_label(tenant), method, "skipped").inc(passes.skipped)

    def add_frames(self, tenant: str, count: int) -> None:
        self.frames_generated.labels(_label(tenant)).inc(count)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format, as /metrics serves it."""
        return generate_latest(self.registry)


class ServerMetrics:
    """Any gRPC server's own view of the calls it serves: latency by RPC and status, calls in flight.

    Every stage service and the orchestrator can keep one, recorded by
    `MetricsServerInterceptor`.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.latency = Histogram(
            PREFIX + "server_request_latency_seconds",
            "Duration of the RPCs this server handled, by service, method and gRPC status.",
            ["grpc_service", "grpc_method", "grpc_code"],
            buckets=CALL_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            PREFIX + "server_requests_in_flight",
            "RPCs this server is handling now, by service and method.",
            ["grpc_service", "grpc_method"],
            registry=self.registry,
        )

    @contextlib.contextmanager
    def track(self, method: str, context: grpc.aio.ServicerContext) -> Iterator[None]:
        """Counts one call of `method` ('/pkg.Service/Method') in flight and times it."""
        service, _, name = method.lstrip("/").rpartition("/")
        in_flight = self.in_flight.labels(service, name)
        in_flight.inc()

        def ended(code: grpc.StatusCode, seconds: float) -> None:
            in_flight.dec()
            self.latency.labels(service, name, code.name).observe(seconds)

        with observed_call(context, ended):
            yield

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServerInterceptor(grpc.aio.ServerInterceptor):
    """Records every RPC of a grpc.aio server in a ServerMetrics.

    Health checks and reflection are left out unless `skip_services` says otherwise.
    """

    def __init__(self, metrics: ServerMetrics, skip_services: tuple[str, ...] = PROBE_SERVICES) -> None:
        self.metrics = metrics
        self.skip_services = skip_services

    async def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.lstrip("/").rpartition("/")[0] in self.skip_services:
            return handler
        return wrap_rpc_handler(handler, lambda context: self.metrics.track(method, context))


# ---------------------------------------------------------------- serving --


def add_metrics_arguments(parser: argparse.ArgumentParser, default_port: int = 0) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=default_port,
        help="serve Prometheus metrics at http://HOST:PORT/metrics, on the server's --host "
        f"(0: off; default {default_port})",
    )


def start_metrics_server(
    port: int, registry: CollectorRegistry, addr: str = "127.0.0.1"
) -> tuple[WSGIServer, threading.Thread] | None:
    """Serves `registry` at /metrics on a daemon thread; returns (server, thread), or None when port is 0.

    `addr` is the address to bind: servers pass their own --host, so metrics
    are exposed exactly where the gRPC port is, and loopback by default.
    Stop it with `server.shutdown(); server.server_close()`; a process that
    exits needs neither.
    """
    if port == 0:
        return None
    if not 0 < port < 65536:
        raise ValueError(f"--metrics-port {port}: use 1-65535, or 0 for no metrics")
    return start_http_server(port, addr=addr, registry=registry)
