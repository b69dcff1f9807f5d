"""The orchestrator service: the public Generation API of a StageDiff cluster.

Every call is authenticated (`authorization: Bearer <key>`, see services/auth.py) and
belongs to a tenant; a tenant sees, fetches and cancels only its own jobs (another
tenant's job id answers NOT_FOUND, so ids reveal nothing). Admission checks, in order:
the tenant's request rate, the request itself (INVALID_ARGUMENT), the tenant's size
limits (PERMISSION_DENIED), then the queue and the tenant's share of it
(RESOURCE_EXHAUSTED with a RetryInfo saying when to come back).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
from pathlib import Path

import grpc

from services.auth import (
    ClusterSecretError,
    TenantAuthInterceptor,
    TLSConfigError,
    add_cluster_secret_argument,
    add_tls_arguments,
    current_tenant,
    load_cluster_secret,
    server_credentials_from_args,
)
from services.environment_options import parse_args
from services.errors import RequestError, bounded
from services.logging_setup import add_logging_arguments
from services.metrics import OrchestratorMetrics, ServerMetrics, add_metrics_arguments, start_metrics_server
from services.orchestrator.jobs import AdmissionRefused, Job, JobManager, JobState
from services.orchestrator.pipeline import Pipeline, restore_intermediates
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.stage_clients import PROBE_INTERVAL_S, REPLICA_WAIT_S, STAGE_ORDER, StagePool
from services.orchestrator.store import JobStore, StoreError
from services.orchestrator.tenants import LimitExceeded, RateLimited, TenantConfigError, TenantRegistry
from services.server import configure_logging, serve
from services.status_details import abort_with_retry
from services.tracing import configure_tracing
from services.validation import validate_sampling, validate_seed, validate_size
from stagediff import __version__
from stagediff.protocol import JOB_FAILED_METADATA_KEY
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2

logger = logging.getLogger(__name__)

MAX_INTERP_EXP = 4
ALLOWED_INTERP_SCALES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
MAX_FPS = 240.0
MAX_REQUEST_ID_CHARS = 128
MAX_LIST_LIMIT = 1000
DEFAULT_STATE_DIR = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "stagediff"


class ModelNotFound(LookupError):
    """The request names a model no stage serves (NOT_FOUND)."""


class ClusterNotReady(Exception):
    """Some stage has not reported SERVING since the orchestrator started."""


def _abort_code(job: Job) -> grpc.StatusCode:
    if job.error_code is not None:
        return job.error_code
    return grpc.StatusCode.CANCELLED if job.state == JobState.JOB_STATE_CANCELLED else grpc.StatusCode.UNKNOWN


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        stages: StagePool,
        jobs: JobManager,
        tenants: TenantRegistry | None = None,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
        self.stages = stages
        self.jobs = jobs
        self.tenants = tenants if tenants is not None else TenantRegistry.open()
        self.metrics = metrics
        # Set once every stage has answered SERVING; requests before that get UNAVAILABLE.
        self.ready = asyncio.Event()

    # ------------------------------------------------------------ requests --

    def _models(self) -> dict[str, stages_pb2.StageInfo]:
        info = self.stages["dit"].info
        return {info.model: info} if info is not None else {}

    def complete_request(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
        """Validates a request and fills in every default; raises RequestError or ModelNotFound."""
        if not self.ready.is_set():
            waiting = [name for name in STAGE_ORDER if self.stages[name].info is None]
            raise ClusterNotReady(f"the cluster is starting; waiting for stage(s) {', '.join(waiting)} to serve")
        models = self._models()
        model = request.model or next(iter(models))
        if model not in models:
            raise ModelNotFound(f"model '{model}' is not served here; available: {', '.join(models)}")
        limits = stages_pb2.ModelLimits()
        limits.CopyFrom(models[model].limits)
        # A patch-parallel VAE needs enough rows for its ranks: the larger minimum wins.
        vae = self.stages["vae"].info
        if vae is not None and vae.limits.min_height > limits.min_height:
            limits.min_height = vae.limits.min_height
        full = generation_pb2.GenerateRequest()
        full.CopyFrom(request)
        full.model = model
        if not request.prompt.strip():
            raise RequestError("prompt: must not be empty")
        for field in ("prompt", "negative_prompt"):
            length = len(getattr(request, field))
            if length > limits.max_prompt_chars:
                raise RequestError(f"{field}: {length} characters; at most {limits.max_prompt_chars} are allowed")
        full.height = request.height if request.HasField("height") else limits.default_height
        full.width = request.width if request.HasField("width") else limits.default_width
        full.num_frames = request.num_frames if request.HasField("num_frames") else limits.default_num_frames
        full.num_inference_steps = (
            request.num_inference_steps if request.HasField("num_inference_steps") else limits.default_inference_steps
        )
        full.guidance_scale = (
            request.guidance_scale if request.HasField("guidance_scale") else limits.default_guidance_scale
        )
        full.seed = request.seed if request.HasField("seed") else random.randrange(2**31)
        full.fps = request.fps if request.HasField("fps") else limits.default_fps
        validate_size(limits, full.height, full.width, full.num_frames)
        validate_sampling(limits, full.num_inference_steps, full.guidance_scale)
        validate_seed(full.seed)
        if not math.isfinite(full.fps) or not 0 < full.fps <= MAX_FPS:
            raise RequestError(f"fps: {full.fps} is not allowed; use a value in (0, {MAX_FPS:g}]")
        interpolation = full.interpolation
        if interpolation.enable and interpolation.exp > 0 and models[model].family == "qwen-image":
            raise RequestError(
                f"interpolation: model '{model}' makes single images, so there is nothing to interpolate; "
                "leave interpolation off"
            )
        if interpolation.enable and not 0 <= interpolation.exp <= MAX_INTERP_EXP:
            raise RequestError(
                f"interpolation.exp: {interpolation.exp} is not allowed; use 0 (off) to {MAX_INTERP_EXP} (2**exp x fps)"
            )
        if interpolation.scale not in ALLOWED_INTERP_SCALES:
            raise RequestError(
                f"interpolation.scale: {interpolation.scale} is not allowed; use one of "
                f"{list(ALLOWED_INTERP_SCALES[1:])}, or 0 for 1"
            )
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise RequestError(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters")
        return full

    async def _refuse(self, context, tenant: str, model: str, code: grpc.StatusCode, message: str) -> None:
        if self.metrics is not None:
            self.metrics.request_finished(tenant=tenant, model=model, code=code)
        await context.abort(code, bounded(message))

    async def _admit(self, request, context) -> Job:
        tenant = current_tenant()
        model = request.model
        # A retry of a known request id attaches to its job without spending the tenant's rate.
        existing = await self.jobs.find_request(tenant.name, request.request_id)
        if existing is not None:
            return existing
        try:
            self.tenants.check_rate(tenant)
            full = self.complete_request(request)
            model = full.model
            self.tenants.check_request_limits(tenant, full)
            remaining = context.time_remaining()
            deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
            job, created = await self.jobs.submit(full, tenant, deadline)
        except RateLimited as error:
            if self.metrics is not None:
                self.metrics.request_finished(tenant=tenant.name, model=model, code=grpc.StatusCode.RESOURCE_EXHAUSTED)
            await abort_with_retry(context, error.message, error.retry_after)
        except AdmissionRefused as error:
            if self.metrics is not None:
                self.metrics.request_finished(tenant=tenant.name, model=model, code=grpc.StatusCode.RESOURCE_EXHAUSTED)
            await abort_with_retry(context, str(error), error.retry_after_s)
        except LimitExceeded as error:
            await self._refuse(context, tenant.name, model, error.code, error.message)
        except RequestError as error:
            await self._refuse(context, tenant.name, model, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except ModelNotFound as error:
            await self._refuse(context, tenant.name, model, grpc.StatusCode.NOT_FOUND, str(error))
        except ClusterNotReady as error:
            await self._refuse(context, tenant.name, model, grpc.StatusCode.UNAVAILABLE, str(error))
        except StoreError as error:
            logger.exception("the job store refused a job")
            await self._refuse(
                context, tenant.name, model, grpc.StatusCode.INTERNAL, f"could not store the job: {error}"
            )
        if created:
            logger.info(
                "job %s queued for tenant %s: %dx%d, %d frames, %d steps",
                job.job_id,
                tenant.name,
                full.height,
                full.width,
                full.num_frames,
                full.num_inference_steps,
            )
        return job

    async def _find(self, job_id: str, context) -> Job:
        """The caller's job; another tenant's job is as unknown as one that never existed."""
        job = await self.jobs.get(job_id, current_tenant().name) if job_id else None
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, bounded(f"job_id: no job '{job_id}'"))
        return job

    async def _stream(self, job: Job, context):
        async for event in job.follow():
            yield event
        if job.state != JobState.JOB_STATE_SUCCEEDED:
            context.set_trailing_metadata(((JOB_FAILED_METADATA_KEY, "1"),))
            await context.abort(_abort_code(job), bounded(job.error_message or "job did not succeed"))

    # ---------------------------------------------------------------- rpcs --

    async def Generate(self, request, context):
        job = await self._admit(request, context)
        finished = False
        try:
            async for event in self._stream(job, context):
                yield event
            finished = True
        finally:
            # The client went away or its deadline passed: stop the work in every stage.
            if not finished and not job.finished:
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    await self.jobs.cancel(job, grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed")
                else:
                    await self.jobs.cancel(job, grpc.StatusCode.CANCELLED, "the client cancelled or disconnected")

    async def Submit(self, request, context):
        job = await self._admit(request, context)
        return job.to_proto(self.jobs.position(job))

    async def WatchJob(self, request, context):
        job = await self._find(request.job_id, context)
        async for event in self._stream(job, context):
            yield event

    async def GetJob(self, request, context):
        job = await self._find(request.job_id, context)
        return job.to_proto(self.jobs.position(job))

    async def CancelJob(self, request, context):
        job = await self._find(request.job_id, context)
        await self.jobs.cancel(job)
        return job.to_proto()

    async def ListJobs(self, request, context):
        limit = request.limit or 100
        if not 0 < limit <= MAX_LIST_LIMIT:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"limit: must be between 0 and {MAX_LIST_LIMIT} (0 means 100)"
            )
        if request.state not in JobState.values():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"state: {request.state} is not one of {list(JobState.keys())}"
            )
        jobs = self.jobs.list_jobs(current_tenant().name, request.state, limit)
        return generation_pb2.ListJobsResponse(jobs=jobs)

    async def ListModels(self, request, context):
        return generation_pb2.ListModelsResponse(
            models=[
                generation_pb2.ModelDescription(id=model, family=info.family, limits=info.limits)
                for model, info in self._models().items()
            ]
        )

    async def GetClusterInfo(self, request, context):
        # Probe every replica now, so the answer is current rather than up to a probe interval old.
        await self.stages.probe_all()
        stages = []
        for name in STAGE_ORDER:
            stage = self.stages[name]
            replicas = [
                generation_pb2.ReplicaStatus(
                    endpoint=replica.endpoint,
                    health=replica.health,
                    detail=replica.detail,
                    in_flight=replica.in_flight,
                    calls=replica.calls,
                    info=replica.info,
                )
                for replica in stage.replicas
            ]
            stages.append(
                generation_pb2.StageStatus(
                    info=stage.info or stages_pb2.StageInfo(stage=name),
                    endpoint=stage.endpoint,
                    health=stage.health,
                    detail=stage.detail,
                    replicas=replicas,
                )
            )
        return generation_pb2.ClusterInfo(stages=stages, version=__version__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stagediff serve orchestrator", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=50051)
    for stage in STAGE_ORDER:
        parser.add_argument(
            f"--{stage}",
            required=True,
            metavar="HOST:PORT[,HOST:PORT...]",
            help=f"endpoints of the {stage} stage's replicas, comma-separated",
        )
    parser.add_argument("--max-running-jobs", type=int, default=4, help="jobs in flight across the stages")
    parser.add_argument("--max-queued-jobs", type=int, default=256, help="jobs waiting, all tenants together")
    parser.add_argument(
        "--stage-retries",
        type=int,
        default=1,
        help="retries of a stage that is UNAVAILABLE with no other serving replica "
        "(failing over to another serving replica spends none)",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=PROBE_INTERVAL_S,
        help="seconds between health probes of every stage replica (default: %(default)s)",
    )
    parser.add_argument(
        "--replica-wait",
        type=float,
        default=REPLICA_WAIT_S,
        help="seconds a call waits for a replica of its stage to serve again before failing (default: %(default)s)",
    )
    parser.add_argument("--tenants", metavar="FILE", help="tenants YAML (API keys, priorities, quotas); default: open")
    parser.add_argument(
        "--state-dir",
        default=str(DEFAULT_STATE_DIR),
        help="where job records (SQLite) and results live, so that a restart loses no job (default: %(default)s)",
    )
    parser.add_argument("--max-kept-jobs", type=int, default=1000, help="finished jobs (and results) kept")
    parser.add_argument(
        "--job-retention", type=float, default=None, help="seconds finished jobs are kept (default: no limit)"
    )
    parser.add_argument(
        "--max-job-attempts", type=int, default=3, help="restarts of a job interrupted by orchestrator restarts"
    )
    parser.add_argument("--log-level", default="INFO")
    add_logging_arguments(parser)
    add_metrics_arguments(parser)
    add_tls_arguments(parser)
    add_cluster_secret_argument(parser)
    args = parse_args(parser, argv)
    for flag, value, least in (
        ("--max-running-jobs", args.max_running_jobs, 1),
        ("--max-queued-jobs", args.max_queued_jobs, 1),
        ("--stage-retries", args.stage_retries, 0),
        ("--max-kept-jobs", args.max_kept_jobs, 1),
        ("--max-job-attempts", args.max_job_attempts, 1),
    ):
        if value < least:
            parser.error(f"{flag} {value}: use {least} or more")
    configure_logging(args.log_level, args.log_format)
    configure_tracing("stagediff-orchestrator")
    try:
        tenants = TenantRegistry.from_file(args.tenants) if args.tenants else TenantRegistry.open()
        secret = load_cluster_secret(args.cluster_secret_file)
        credentials = server_credentials_from_args(args)
    except (TenantConfigError, ClusterSecretError, TLSConfigError) as error:
        raise SystemExit(f"stagediff serve orchestrator: {error}") from None
    if tenants.is_open:
        logger.warning("no --tenants file: every caller is the open tenant 'default', with no key and no quota")
    if secret is None:
        logger.warning("no cluster secret: the stages must run without one too")
    try:
        store = JobStore.open(args.state_dir)
    except StoreError as error:
        raise SystemExit(f"stagediff serve orchestrator: --state-dir {args.state_dir}: {error}") from None
    try:
        asyncio.run(_serve(args, tenants, secret, credentials, store))
    finally:
        store.close()


async def _serve(
    args: argparse.Namespace,
    tenants: TenantRegistry,
    secret: str | None,
    credentials: grpc.ServerCredentials | None,
    store: JobStore,
) -> None:
    server_metrics = ServerMetrics()
    metrics = OrchestratorMetrics(server_metrics.registry)
    try:
        start_metrics_server(args.metrics_port, metrics.registry)
    except (OSError, ValueError) as error:
        raise SystemExit(f"stagediff serve orchestrator: --metrics-port {args.metrics_port}: {error}") from None
    stages = StagePool(
        {stage: getattr(args, stage.replace("-", "_")) for stage in STAGE_ORDER},
        probe_interval_s=args.health_interval,
        replica_wait_s=args.replica_wait,
        secret=secret,
        metrics=metrics,
    )
    pipeline = Pipeline(stages, stage_retries=args.stage_retries, store=store, metrics=metrics)
    scheduler = FairScheduler(max_queued=args.max_queued_jobs, max_running=args.max_running_jobs)
    jobs = JobManager(
        pipeline.run,
        scheduler,
        store,
        restore_job=restore_intermediates,
        max_kept=args.max_kept_jobs,
        retention_s=args.job_retention,
        max_attempts=args.max_job_attempts,
        tenants=tenants.tenants,
        metrics=metrics,
    )
    servicer = GenerationServicer(stages, jobs, tenants, metrics)

    def register(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name]

    async def load() -> None:
        await stages.wait_until_serving()
        # Jobs accepted before a restart run first, in their order, before any new request is admitted.
        await jobs.recover()
        servicer.ready.set()

    async def shutdown() -> None:
        await jobs.shutdown()
        await stages.close()

    await serve(
        name="orchestrator",
        host=args.host,
        port=args.port,
        register=register,
        load=load,
        on_shutdown=shutdown,
        interceptors=[TenantAuthInterceptor(tenants)],
        credentials=credentials,
        metrics=server_metrics,
    )


if __name__ == "__main__":
    main()
