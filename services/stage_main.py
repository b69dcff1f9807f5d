"""Startup shared by the stage services (their options: services/stage_options.py).

A stage refuses to start, with a one-line message and before it serves or loads anything, on a bad flag, a bad
checkpoint, or weights that do not fit in the memory available (services/memory_budget.py).
"""

from __future__ import annotations

import abc
import argparse
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
    server_credentials_from_args,
)
from services.checkpoint import CheckpointSpec, read_checkpoint
from services.logging_setup import bind_log_fields
from services.memory_budget import MemoryBudgetError, WeightNeed, check_weights_fit
from services.metrics import ServerMetrics, start_metrics_server
from services.server import check_server_arguments, configure_logging, serve
from services.stage import StageControlServicer, StageRuntime, resolve_device, resolve_dtype
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


def prepare_stage_process(
    stage: str, args: argparse.Namespace
) -> tuple[CheckpointSpec | None, torch.device, torch.dtype]:
    """Logging, intra-op threads, and the checkpoint (None for a stage started without --model, which only
    a stage that does not read it allows), device and dtype the options name; a bad one exits with a
    one-line message instead of a traceback."""
    configure_logging(args.log_level, args.log_format)
    bind_log_fields(stage=stage)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        spec = read_checkpoint(args.model, args.model_name) if args.model is not None else None
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as error:  # CheckpointError included: say what is wrong, without a traceback
        raise SystemExit(f"stagediff serve {stage}: {error}") from None
    return spec, device, dtype


def run_stage(
    stage: str, args: argparse.Namespace, make_servicer: Callable[[argparse.Namespace, StageRuntime], StageServicer]
) -> None:
    """Starts a stage: bind the port, answer NOT_SERVING while loading, then serve until SIGTERM."""
    configure_tracing(f"stagediff-{stage}")
    spec, device, dtype = prepare_stage_process(stage, args)
    runtime = StageRuntime(stage, spec, device, dtype)
    if args.num_weight_load_threads < 1:
        raise SystemExit(
            f"stagediff serve {stage}: --num-weight-load-threads {args.num_weight_load_threads}: use 1 or more"
        )
    runtime.load_threads = 1 if args.disable_multithread_weight_load else args.num_weight_load_threads
    check_server_arguments(f"stagediff serve {stage}", args)
    interceptors = _secret_interceptors(stage, args)
    try:
        credentials = server_credentials_from_args(args)
    except TLSConfigError as error:
        raise SystemExit(f"stagediff serve {stage}: {error}") from None
    metrics = ServerMetrics()
    try:
        start_metrics_server(args.metrics_port, metrics.registry, addr=args.host)
    except (OSError, ValueError) as error:
        raise SystemExit(f"stagediff serve {stage}: --metrics-port {args.metrics_port}: {error}") from None
    servicer = make_servicer(args, runtime)
    check_memory(stage, servicer)

    def register(server: grpc.aio.Server) -> list[str]:
        stages_pb2_grpc.add_StageControlServicer_to_server(StageControlServicer(runtime), server)
        servicer.add_to_server(server)
        return [stages_pb2.DESCRIPTOR.services_by_name["StageControl"].full_name, servicer.service_name]

    async def load() -> None:
        await runtime.run(servicer.load)

    async def shutdown() -> None:
        runtime.executor.shutdown(wait=False, cancel_futures=True)
        servicer.close()

    asyncio.run(
        serve(
            name=stage,
            host=args.host,
            port=args.port,
            register=register,
            load=load,
            on_shutdown=shutdown,
            watchdog=servicer.failure,
            interceptors=interceptors,
            credentials=credentials,
            metrics=metrics,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            max_health_watchers=args.max_health_watchers,
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


def _secret_interceptors(stage: str, args: argparse.Namespace) -> list[grpc.aio.ServerInterceptor]:
    """The cluster-secret check. Without a secret the stage refuses to start, unless --insecure says
    to answer anyone (then with a warning)."""
    try:
        secret = load_cluster_secret(args.cluster_secret_file)
    except ClusterSecretError as error:
        raise SystemExit(f"stagediff serve {stage}: {error}") from None
    if secret is None and not args.insecure:
        raise SystemExit(
            f"stagediff serve {stage}: no cluster secret: give the orchestrator's with --cluster-secret-file FILE "
            f"or ${CLUSTER_SECRET_ENV}, or pass --insecure to answer any caller that reaches the port"
        )
    if secret is None:
        logger.warning("%s: --insecure and no cluster secret: anyone who reaches this port can call the stage", stage)
        return []
    return [ClusterSecretInterceptor(secret)]
