"""`stagediff serve orchestrator` (`python -m services.orchestrator.service`): the orchestrator's process.

`main` parses the options, builds one checked OrchestratorConfig (config.py) and refuses to start where the
deployment would leak API keys or lack the cluster secret (`check_exposure`, unless --insecure); `_serve`
wires the stage pool, pipeline, scheduler, job manager and Generation servicer (servicer.py) from it and
serves the public port. The public port takes small requests only (PUBLIC_PORT_OPTIONS).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

import grpc

from services.allocator import return_large_buffers_to_the_system
from services.auth import (
    CLUSTER_SECRET_ENV,
    ClusterSecretError,
    TLSConfigError,
    load_cluster_secret,
    server_credentials_for,
    stage_channel_credentials,
)
from services.environment_options import parse_args
from services.metrics import OrchestratorMetrics, ServerMetrics, start_metrics_server
from services.orchestrator.adapter_rate import AdapterRate
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.deadlines import DeadlineAdmission
from services.orchestrator.demand import PoolDemandCollector
from services.orchestrator.dit_gate import DitGate
from services.orchestrator.janitor import BlobJanitor
from services.orchestrator.jobs import JobManager
from services.orchestrator.membership import PostgresMembership
from services.orchestrator.model_catalog import ModelCatalog
from services.orchestrator.options import batch_per_tenant, build_parser
from services.orchestrator.pipeline import Pipeline, restore_intermediates
from services.orchestrator.relay import Relay
from services.orchestrator.request_bounds import RequestBoundsInterceptor
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.servicer import GenerationServicer
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.step_times import StepTimes
from services.orchestrator.store import JobStore
from services.orchestrator.store_errors import StoreError
from services.orchestrator.store_location import PostgresLocation, open_blobs, replica_owner
from services.orchestrator.tenant_auth import TenantAuthInterceptor
from services.orchestrator.tenant_usage import TenantUsageCollector
from services.orchestrator.tenants import TenantConfigError, TenantRegistry
from services.server import configure_logging, is_loopback, serve
from services.server_config import ServerConfig
from services.tracing import configure_tracing
from stagediff.v1 import generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)

PROG = "stagediff serve orchestrator"
# The public port receives small requests only: the bounded fields of a GenerateRequest need well under
# 1 MiB, and an image file larger than fits beside them arrives through UploadImage in 1 MiB chunks
# (services/orchestrator/image_uploads.py), so a larger message is refused by grpc (RESOURCE_EXHAUSTED)
# before it is parsed, and without BDP probing the receive window stays at its default, so grpc does not
# take in megabytes of a message it will refuse (bench/hostile.py measures both). Responses, where the
# frames are, flow under the client's window and are unaffected.
MAX_REQUEST_BYTES = 4 << 20
PUBLIC_PORT_OPTIONS = (("grpc.max_receive_message_length", MAX_REQUEST_BYTES), ("grpc.http2.bdp_probe", 0))


def check_exposure(
    server: ServerConfig,
    tenants: TenantRegistry,
    secret: str | None,
    credentials: grpc.ServerCredentials | None,
) -> None:
    """Refuses, unless --insecure, to send API keys in clear beyond this machine, or to run without the
    cluster secret; a SystemExit naming the flags that fix it. Reads `server.host` and `server.insecure`.

    Without the secret the orchestrator is not exposed itself, but stages refuse
    its calls unless they too run --insecure: failing here says so at once,
    rather than leaving a cluster that never turns SERVING.
    """
    if not tenants.is_open and credentials is None and not is_loopback(server.host):
        if not server.insecure:
            raise SystemExit(
                f"{PROG}: --tenants on --host {server.host} without TLS would send API keys in clear: give "
                "--tls-cert and --tls-key, bind a loopback --host, or pass --insecure (when a proxy in front of "
                "this port ends TLS)"
            )
        logger.warning("--insecure: API keys reach --host %s in clear; a proxy in front must end TLS", server.host)
    if secret is None:
        if not server.insecure:
            raise SystemExit(
                f"{PROG}: no cluster secret: stages answer only callers holding theirs; give it with "
                f"--cluster-secret-file FILE or ${CLUSTER_SECRET_ENV}, or pass --insecure to call stages that run "
                "--insecure"
            )
        logger.warning("--insecure and no cluster secret: only stages started with --insecure will answer")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        config = OrchestratorConfig.from_options(args)
    except ValueError as error:
        parser.error(str(error))
    configure_logging(config.server.logging.level, config.server.logging.format)
    return_large_buffers_to_the_system()  # clients' images and uploads pass through here
    configure_tracing("stagediff-orchestrator")
    try:
        tenants = TenantRegistry.from_file(config.tenants_file) if config.tenants_file else TenantRegistry.open()
        secret = load_cluster_secret(config.server.cluster_secret_file)
        credentials = server_credentials_for(config.server.tls)
        stage_credentials = stage_channel_credentials(args.stage_tls_ca, args.stage_tls_cert, args.stage_tls_key)
    except (TenantConfigError, ClusterSecretError, TLSConfigError) as error:
        raise SystemExit(f"{PROG}: {error}") from None
    check_exposure(config.server, tenants, secret, credentials)
    if isinstance(config.store, PostgresLocation) and not secret:
        raise SystemExit(
            f"{PROG}: --store postgresql://: replicas relay calls to each other under the cluster secret; "
            "give --cluster-secret-file or $STAGEDIFF_CLUSTER_SECRET"
        )
    if tenants.is_open:
        logger.warning("no --tenants file: every caller is the open tenant 'default', with no key and no quota")
    if config.store_password_file:
        try:  # libpq reads it from the environment, for the store's connection and the membership's
            os.environ["PGPASSWORD"] = Path(config.store_password_file).read_text().strip()
        except OSError as error:
            raise SystemExit(f"{PROG}: --store-password-file {config.store_password_file}: {error.strerror}") from None
    try:
        store = JobStore.open(
            config.state_dir,
            database_url=config.store.dsn if isinstance(config.store, PostgresLocation) else None,
            blobs=open_blobs(config.blobs),
            owner=replica_owner(config.store),
            lease_ttl_s=config.job_lease_s,
        )
    except StoreError as error:
        where = "--store: " if isinstance(config.store, PostgresLocation) else f"--state-dir {config.state_dir}: "
        raise SystemExit(f"{PROG}: {where if not str(error).startswith('--') else ''}{error}") from None
    try:
        asyncio.run(_serve(config, tenants, secret, credentials, store, stage_credentials))
    finally:
        store.close()


async def _serve(
    config: OrchestratorConfig,
    tenants: TenantRegistry,
    secret: str | None,
    credentials: grpc.ServerCredentials | None,
    store: JobStore,
    stage_credentials: grpc.ChannelCredentials | None = None,
) -> None:
    server_metrics = ServerMetrics()
    metrics = OrchestratorMetrics(server_metrics.registry)
    try:
        start_metrics_server(config.server.metrics_port, metrics.registry, addr=config.server.host)
    except (OSError, ValueError) as error:
        raise SystemExit(f"{PROG}: --metrics-port {config.server.metrics_port}: {error}") from None
    stages = StagePool(
        config.stage_endpoints,
        probe_interval_s=config.health_interval_s,
        replica_wait_s=config.replica_wait_s,
        secret=secret,
        metrics=metrics,
        credentials=stage_credentials,
        cold_start_s=config.cold_start_timeout_s,
    )
    # With pools that may be at zero, the models the DiT replicas reported are kept in the store, so that a model
    # whose DiT pool is at zero stays served; without, every pool serves at startup and says its models itself.
    catalog = ModelCatalog(store, stages.routes)
    if config.cold_start_timeout_s:
        try:
            await catalog.load()
        except StoreError as error:
            logger.warning("the models kept in the job store could not be read (%s): the DiT replicas will say", error)
        stages.on_models = catalog.saw
    # Step-level scheduling: jobs take DiT slots at the gate in priority and slack order, a higher class may have a
    # lower one yield at a step boundary, and deadlines are checked against the DiT's recent step times.
    step_times = StepTimes()

    def tenant_info(name: str) -> tuple[float, bool]:
        scheduling = tenants.scheduling(name)
        return scheduling.weight, scheduling.preemptible

    gate = DitGate(stages["dit"], config.preemption, tenant_info)
    deadlines = DeadlineAdmission(step_times, gate, stages.routes, preemption=config.preemption.enabled)
    gate.estimate = deadlines.remaining_s  # the slack of a waiting job with a deadline
    pipeline = Pipeline(
        stages,
        stage_retries=config.stage_retries,
        store=store,
        metrics=metrics,
        cluster_secret=secret,
        batch_per_tenant=batch_per_tenant(config.batch_per_tenant, has_tenants=not tenants.is_open),
        keep_outputs_after_s=config.keep_outputs_after_s,
        gate=gate,
        checkpoints=config.checkpoint,
        step_times=step_times,
    )
    scheduler = FairScheduler(
        max_queued=config.max_queued_jobs,
        max_running=config.max_running_jobs,
        # With preemption, lower classes waiting at the DiT gate never keep a higher class from reaching it.
        max_running_from_the_top=config.preemption.enabled,
    )
    metrics.registry.register(PoolDemandCollector(stages, scheduler.queued_by_model))  # demand.py
    metrics.registry.register(TenantUsageCollector(tenants.tenants, scheduler.tenants))
    jobs = JobManager(
        pipeline.run,
        scheduler,
        store,
        restore_job=restore_intermediates,
        max_kept=config.max_kept_jobs,
        max_stored_bytes=config.max_stored_bytes_per_tenant,
        retention_s=config.job_retention_s or None,
        min_free=config.min_free,
        max_attempts=config.max_job_attempts,
        tenants=tenants.tenants,
        metrics=metrics,
        deadlines=deadlines,
    )
    membership, relay = None, None
    if isinstance(config.store, PostgresLocation):
        endpoint = config.advertise or f"{socket.gethostname()}:{config.server.port}"
        membership = PostgresMembership(config.store.dsn, store.owner, endpoint, lease_s=config.leader_lease_s)
        relay = Relay(secret, stage_credentials)
    servicer = GenerationServicer(
        stages,
        jobs,
        tenants,
        metrics,
        detach_grace_s=config.detach_grace_s,
        adapter_rate=AdapterRate(config.adapters_per_minute),
        membership=membership,
        relay=relay,
        job_lease_s=config.job_lease_s,
        presign_downloads_s=config.presign_downloads_s,
    )

    janitor = BlobJanitor(store)

    def register(server: grpc.aio.Server) -> list[str]:
        janitor.start()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name]

    async def drain() -> None:
        await servicer.leave(config.drain_grace_s)

    async def shutdown() -> None:
        await janitor.stop()
        await servicer.followers.close()
        await jobs.shutdown()
        await catalog.close()
        await stages.close()

    await serve(
        name="orchestrator",
        host=config.server.host,
        port=config.server.port,
        register=register,
        load=servicer.start,
        on_shutdown=shutdown,
        on_drain=drain,
        interceptors=[
            TenantAuthInterceptor(tenants),
            RequestBoundsInterceptor([generation_pb2.DESCRIPTOR.services_by_name["Generation"]]),
        ],
        credentials=credentials,
        metrics=server_metrics,
        max_concurrent_rpcs=config.server.max_concurrent_rpcs,
        max_health_watchers=config.server.max_health_watchers,
        options=PUBLIC_PORT_OPTIONS,
    )


if __name__ == "__main__":
    main()
