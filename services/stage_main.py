"""Startup shared by the stage services, from their configuration (services/stage_config.py).

A stage refuses to start, with a one-line message and before it serves or loads anything, on a bad flag, a bad
checkpoint, or weights that do not fit in the memory available (services/memory_budget.py).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable

import grpc
import torch

from services.auth import (
    CLUSTER_SECRET_ENV,
    ClusterSecretError,
    ClusterSecretInterceptor,
    TLSConfigError,
    load_cluster_secret,
    server_credentials_for,
)
from services.logging_setup import bind_log_fields
from services.memory_budget import MemoryBudgetError, WeightNeed, check_weights_fit
from services.metrics import ServerMetrics, start_metrics_server
from services.server import configure_logging, serve
from services.stage import StageControlServicer, StageRuntime, resolve_device, resolve_dtype
from services.stage_config import StageConfig
from services.stage_priority import CallPriorityInterceptor
from services.tracing import configure_tracing
from stagediff.v1 import stages_pb2, stages_pb2_grpc

logger = logging.getLogger(__name__)


class StageServicer(abc.ABC):
    """What each stage's servicer provides besides its RPCs.

    The servicer is added to the server at once (answering UNAVAILABLE until
    loaded), then `load` runs on the compute thread while health says NOT_SERVING.
    """

    service_name: str

    @abc.abstractmethod
    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Registers the stage's gRPC service on `server`."""

    @abc.abstractmethod
    def load(self) -> None:
        """Loads the model (blocking; runs on the compute thread)."""

    def memory_need(self) -> WeightNeed | None:
        """What `load` will hold (services/memory_budget.py), checked before the stage starts; None for a stage
        whose weights are too small to matter."""
        return None

    def failure(self) -> str | None:
        """Why the stage can no longer serve (a rank of its group died), or None."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook: most stages start nothing to release
        """Releases what load() started (worker ranks); called once the server has drained."""

    async def drain(self) -> None:  # noqa: B027 - optional hook: most stages let their calls run on
        """Called at SIGTERM, once health says NOT_SERVING and before the calls in flight get the drain grace
        (the DiT yields the requests it can hand to another replica)."""


def prepare_stage_process(config: StageConfig) -> tuple[torch.device, torch.dtype]:
    """Logging, intra-op threads, and the device and dtype the configuration names; a bad one exits with a
    one-line message instead of a traceback."""
    configure_logging(config.server.logging.level, config.server.logging.format)
    bind_log_fields(stage=config.stage)
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    try:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
    except ValueError as error:
        raise SystemExit(f"{config.prog}: {error}") from None
    return device, dtype


def run_stage(config: StageConfig, make_servicer: Callable[[StageRuntime], StageServicer]) -> None:
    """Starts a stage: bind the port, answer NOT_SERVING while loading, then serve until SIGTERM."""
    configure_tracing(f"stagediff-{config.stage}")
    device, dtype = prepare_stage_process(config)
    runtime = StageRuntime(config.stage, config.checkpoint, device, dtype, config.identity)
    if len(config.identity.models) > 1:
        logger.info(
            "one %s for the models %s: their %s are the same files",
            config.stage,
            ", ".join(config.identity.models),
            ", ".join(f"{name} ({identity[:19]})" for name, identity in config.identity.components.items()),
        )
    runtime.load_threads = config.load_threads
    server = config.server
    interceptors = _secret_interceptors(config.stage, server.cluster_secret_file, insecure=server.insecure)
    try:
        credentials = server_credentials_for(server.tls)
    except TLSConfigError as error:
        raise SystemExit(f"{config.prog}: {error}") from None
    metrics = ServerMetrics()
    try:
        start_metrics_server(server.metrics_port, metrics.registry, addr=server.host)
    except (OSError, ValueError) as error:
        raise SystemExit(f"{config.prog}: --metrics-port {server.metrics_port}: {error}") from None
    servicer = make_servicer(runtime)
    check_memory(config.stage, servicer)

    def register(grpc_server: grpc.aio.Server) -> list[str]:
        stages_pb2_grpc.add_StageControlServicer_to_server(StageControlServicer(runtime), grpc_server)
        servicer.add_to_server(grpc_server)
        return [stages_pb2.DESCRIPTOR.services_by_name["StageControl"].full_name, servicer.service_name]

    async def load() -> None:
        await runtime.run(servicer.load)

    async def shutdown() -> None:
        runtime.executor.shutdown(wait=False, cancel_futures=True)
        servicer.close()

    asyncio.run(
        serve(
            name=config.stage,
            host=server.host,
            port=server.port,
            register=register,
            load=load,
            on_shutdown=shutdown,
            on_drain=servicer.drain,
            grace=config.drain_grace_s,
            watchdog=servicer.failure,
            interceptors=[*interceptors, CallPriorityInterceptor()],
            credentials=credentials,
            metrics=metrics,
            max_concurrent_rpcs=server.max_concurrent_rpcs,
            max_health_watchers=server.max_health_watchers,
        )
    )


def check_memory(stage: str, servicer: StageServicer) -> None:
    """Exits with the memory guard's message when the stage's weights do not fit where it will load them."""
    try:
        need = servicer.memory_need()
        if need is not None:
            check_weights_fit(need)
    except MemoryBudgetError as error:
        raise SystemExit(f"stagediff serve {stage}: {error}") from None


def _secret_interceptors(
    stage: str, cluster_secret_file: str | None, *, insecure: bool
) -> list[grpc.aio.ServerInterceptor]:
    """The cluster-secret check. Without a secret the stage refuses to start, unless --insecure says
    to answer anyone (then with a warning)."""
    try:
        secret = load_cluster_secret(cluster_secret_file)
    except ClusterSecretError as error:
        raise SystemExit(f"stagediff serve {stage}: {error}") from None
    if secret is None and not insecure:
        raise SystemExit(
            f"stagediff serve {stage}: no cluster secret: give the orchestrator's with --cluster-secret-file FILE "
            f"or ${CLUSTER_SECRET_ENV}, or pass --insecure to answer any caller that reaches the port"
        )
    if secret is None:
        logger.warning("%s: --insecure and no cluster secret: anyone who reaches this port can call the stage", stage)
        return []
    return [ClusterSecretInterceptor(secret)]
