"""The orchestrator service: the public Generation API of a StageDiff cluster.

Every call is authenticated (`authorization: Bearer <key>`, see tenant_auth.py) and
belongs to a tenant; a tenant sees, fetches and cancels only its own jobs (another
tenant's job id answers NOT_FOUND, so ids reveal nothing). Admission checks, in order:
the tenant's request rate, the request itself (INVALID_ARGUMENT), the tenant's size
limits (PERMISSION_DENIED), then the queue and the tenant's share of it
(RESOURCE_EXHAUSTED with a RetryInfo saying when to come back).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import math
import random
from collections.abc import Sequence

import grpc

from services.allocator import return_large_buffers_to_the_system
from services.auth import (
    CLUSTER_SECRET_ENV,
    ClusterSecretError,
    TLSConfigError,
    load_cluster_secret,
    server_credentials_from_args,
    stage_channel_credentials_from_args,
)
from services.encoding import check_output
from services.environment_options import parse_args
from services.errors import RequestError, bounded
from services.image_work import ImageWorkers
from services.images import ImageInfo
from services.metrics import OrchestratorMetrics, ServerMetrics, start_metrics_server
from services.orchestrator.adapter_rate import AdapterRate
from services.orchestrator.chain import StageNotDeployed, chain_problem, check_request, missing_stages, served_family
from services.orchestrator.error_redaction import for_tenant, job_for_tenant
from services.orchestrator.followers import JobFollowers, TooManyWatchers
from services.orchestrator.image_uploads import UPLOADS_DIR, ImageUploads, UploadRefused
from services.orchestrator.jobs import AdmissionRefused, Job, JobManager, JobState
from services.orchestrator.lora_access import LoraNotAllowed, LoraNotFound, check_loras, visible
from services.orchestrator.options import DEFAULT_DETACH_GRACE_S, batch_per_tenant, build_parser
from services.orchestrator.pipeline import Pipeline, restore_intermediates
from services.orchestrator.request_bounds import RequestBoundsInterceptor
from services.orchestrator.request_images import (
    check_image_budget,
    complete_images,
    probe_images,
    size_from_images,
    verify_images,
)
from services.orchestrator.scheduler import FairScheduler
from services.orchestrator.stage_clients import NOT_SERVING, STAGE_ORDER, StagePool
from services.orchestrator.store import JobStore, ResultGone, StoreError
from services.orchestrator.tenant_auth import TenantAuthInterceptor, current_tenant
from services.orchestrator.tenants import LimitExceeded, RateLimited, TenantConfigError, TenantRegistry, output_frames
from services.server import check_server_arguments, configure_logging, is_loopback, serve
from services.tracing import configure_tracing
from services.validation import (
    ALLOWED_INTERP_SCALES,
    MAX_FPS,
    MAX_INTERP_EXP,
    resolve_cache,
    resolve_loras,
    validate_sampling,
    validate_seed,
    validate_size,
)
from stagediff import __version__
from stagediff.protocol import JOB_FAILED_METADATA_KEY
from stagediff.status_details import abort_with_retry
from stagediff.v1 import generation_pb2, generation_pb2_grpc, image_pb2, stages_pb2

logger = logging.getLogger(__name__)

MAX_LIST_LIMIT = 1000
# The model label of a request refused before it named a served model: metric labels come from bounded sets.
UNKNOWN_MODEL_LABEL = "unknown"
# When a tenant at its max_watch_streams may try again.
WATCH_RETRY_AFTER_S = 1.0
# The public port receives small requests only: the bounded fields of a GenerateRequest need well under
# 1 MiB, and an image file larger than fits beside them arrives through UploadImage in 1 MiB chunks
# (services/orchestrator/image_uploads.py), so a larger message is refused by grpc (RESOURCE_EXHAUSTED)
# before it is parsed, and without BDP probing the receive window stays at its default, so grpc does not
# take in megabytes of a message it will refuse (bench/hostile.py measures both). Responses, where the
# frames are, flow under the client's window and are unaffected.
MAX_REQUEST_BYTES = 4 << 20
PUBLIC_PORT_OPTIONS = (("grpc.max_receive_message_length", MAX_REQUEST_BYTES), ("grpc.http2.bdp_probe", 0))


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
        detach_grace_s: float = DEFAULT_DETACH_GRACE_S,
        image_workers: ImageWorkers | None = None,
        uploads: ImageUploads | None = None,
        adapter_rate: AdapterRate | None = None,
    ) -> None:
        self.stages = stages
        self.jobs = jobs
        self.tenants = tenants if tenants is not None else TenantRegistry.open()
        self.metrics = metrics
        # Who follows which job, and the grace period of a lost Generate stream (services/orchestrator/followers.py).
        self.followers = JobFollowers(jobs, detach_grace_s)
        # The distinct adapters each tenant names per minute (services/orchestrator/adapter_rate.py).
        self.adapter_rate = adapter_rate if adapter_rate is not None else AdapterRate()
        # Set once every stage has answered SERVING; requests before that get UNAVAILABLE.
        self.ready = asyncio.Event()
        # Clients' image files are parsed and decoded there, never on the event loop.
        self.image_workers = image_workers if image_workers is not None else ImageWorkers()
        # Image files sent ahead of their request (UploadImage), held until a request names them.
        self.uploads = uploads if uploads is not None else ImageUploads(jobs.store.state_dir / UPLOADS_DIR)

    async def start(self) -> None:
        """Readies the orchestrator while its health says NOT_SERVING (the `load` of services.server.serve).

        Waits until every stage it has endpoints for serves, then checks that the served family's chain
        has every stage it cannot do without: if not, it logs why and stays NOT_SERVING (refusing requests
        with FAILED_PRECONDITION naming the missing flag) until it is stopped. Then the jobs accepted before a
        restart are queued again, in their order, before any new request is admitted.
        """
        await self.stages.wait_until_serving()
        problem = self.chain_problem()
        if problem is not None:
            logger.error("%s; health stays NOT_SERVING", problem)
            await asyncio.get_running_loop().create_future()  # never set: serve() stops waiting on SIGTERM
        await self.jobs.recover()
        self.ready.set()

    # ------------------------------------------------------------ requests --

    def _stage_info(self, name: str) -> stages_pb2.StageInfo | None:
        """The StageInfo of a stage this orchestrator has endpoints for; None without them, or before one answered."""
        stage = self.stages.stages.get(name)
        return stage.info if stage is not None else None

    def chain_problem(self) -> str | None:
        """Why the served model's chain cannot run here (a stage without endpoints), or None."""
        return chain_problem(self.stages.stages, self._stage_info("dit"))

    def _models(self) -> dict[str, stages_pb2.StageInfo]:
        info = self._stage_info("dit")
        return {info.model: info} if info is not None else {}

    async def _probe_images(self, request: generation_pb2.GenerateRequest) -> list[ImageInfo] | None:
        """The headers of the request's images, read on the image workers once their count and bytes are
        within the model's limits; None when the request names no served model (complete_request says so)."""
        info = self._models().get(request.model or next(iter(self._models()), ""))
        if info is None or not request.images or not self.ready.is_set():
            return None
        check_image_budget(request.images, info.limits)
        return await self.image_workers.run(
            functools.partial(probe_images, request.images, info.limits.max_image_pixels)
        )

    def complete_request(
        self, request: generation_pb2.GenerateRequest, probed: Sequence[ImageInfo] | None = None
    ) -> generation_pb2.GenerateRequest:
        """Validates a request and fills in every default; raises RequestError, ModelNotFound, StageNotDeployed
        or ClusterNotReady. `probed` is what `_probe_images` read of the request's images."""
        problem = self.chain_problem()
        if problem is not None:
            raise StageNotDeployed(problem)
        if not self.ready.is_set():
            waiting = [name for name, stage in self.stages.stages.items() if stage.info is None]
            raise ClusterNotReady(
                f"the cluster is starting; waiting for stage(s) {', '.join(waiting)} to serve"
                if waiting
                else "the cluster is starting; the jobs accepted before a restart are being queued again"
            )
        models = self._models()
        model = request.model or next(iter(models))
        if model not in models:
            raise ModelNotFound(f"model '{model}' is not served here; available: {', '.join(models)}")
        family = served_family(models[model])
        limits = stages_pb2.ModelLimits()
        limits.CopyFrom(models[model].limits)
        # A patch-parallel VAE needs enough rows for its ranks: the larger minimum wins.
        vae = self._stage_info("vae")
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
        complete_images(full, limits, probed)
        # A family that takes the output size from an input image (Qwen-Image-Edit) does so for each side the
        # request leaves unset, as its pipeline does (`height = height or calculated_height`); the job
        # records the size it used.
        from_image = size_from_images(full, limits, family.images)
        default_width, default_height = from_image[2] if from_image else (limits.default_width, limits.default_height)
        full.height = request.height if request.HasField("height") else default_height
        full.width = request.width if request.HasField("width") else default_width
        full.num_frames = request.num_frames if request.HasField("num_frames") else limits.default_num_frames
        full.num_inference_steps = (
            request.num_inference_steps if request.HasField("num_inference_steps") else limits.default_inference_steps
        )
        full.guidance_scale = (
            request.guidance_scale if request.HasField("guidance_scale") else limits.default_guidance_scale
        )
        full.seed = request.seed if request.HasField("seed") else random.randrange(2**31)
        full.fps = request.fps if request.HasField("fps") else limits.default_fps
        try:
            validate_size(limits, full.height, full.width, full.num_frames)
        except RequestError as error:
            side = str(error).partition(":")[0]
            if from_image is None or side not in ("height", "width") or request.HasField(side):
                raise
            index, image, (width, height) = from_image
            raise RequestError(
                f"images[{index}]: the output size {width}x{height} made from this {image.width}x{image.height} "
                f"image is not allowed ({error}); send height and width"
            ) from None
        validate_sampling(limits, full.num_inference_steps, full.guidance_scale)
        validate_seed(full.seed)
        # The job records the cache it ran with, the model's default filled in.
        full.cache.CopyFrom(resolve_cache(limits, request.cache if request.HasField("cache") else None))
        # And the adapters with their scales (whether the tenant may use them is checked by _admit).
        del full.loras[:]
        full.loras.extend(resolve_loras(limits, list(request.loras)))
        if not math.isfinite(full.fps) or not 0 < full.fps <= MAX_FPS:
            raise RequestError(f"fps: {full.fps} is not allowed; use a value in (0, {MAX_FPS:g}]")
        interpolation = full.interpolation
        if not interpolation.enable:
            # Ignored fields are not kept: the stored and echoed request holds only what runs.
            full.ClearField("interpolation")
            interpolation = full.interpolation
        if interpolation.enable and not 0 <= interpolation.exp <= MAX_INTERP_EXP:
            raise RequestError(
                f"interpolation.exp: {interpolation.exp} is not allowed; use 0 (off) to {MAX_INTERP_EXP} (2**exp x fps)"
            )
        if interpolation.scale not in ALLOWED_INTERP_SCALES:
            raise RequestError(
                f"interpolation.scale: {interpolation.scale} is not allowed; use one of "
                f"{list(ALLOWED_INTERP_SCALES[1:])}, or 0 for 1"
            )
        # The result's format: the job records the format and quality it was encoded with.
        quality = request.output_quality if request.HasField("output_quality") else None
        try:
            output = check_output(request.output_format, quality, request.keep_raw_frames, output_frames(full))
        except ValueError as error:
            raise RequestError(str(error)) from None
        full.output_format = output.name
        if quality is None and output.default_quality is not None:
            full.output_quality = output.default_quality
        # The family's chain and this deployment's stages: a stage the request asks for must be in both.
        check_request(family, self.stages.stages, full)
        interp = self._stage_info("interp")
        if interpolation.model_path and (interp is None or interpolation.model_path != interp.weights_path):
            # Checked here, before the DiT runs; the interpolator's own path is not for tenants to read.
            raise RequestError(
                "interpolation.model_path: the interpolator does not serve these weights; "
                "leave it empty to use the weights it serves"
            )
        return full

    def _model_label(self, model: str) -> str:
        """`model` as a metric label: a served model id, or a fixed value for anything else."""
        models = self._models()
        if not model and len(models) == 1:
            return next(iter(models))
        return model if model in models else UNKNOWN_MODEL_LABEL

    async def _refuse(
        self, context, tenant: str, model: str, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
    ) -> None:
        """Counts a refused request and ends its call; with `retry_after_s`, a RetryInfo says when to retry."""
        if self.metrics is not None:
            self.metrics.request_finished(tenant=tenant, model=self._model_label(model), code=code)
        if retry_after_s is not None:
            await abort_with_retry(context, bounded(message), retry_after_s, code=code)
        await context.abort(code, bounded(message))

    async def _admit(self, request, context) -> tuple[Job, bool]:
        """The job for `request`, and whether it is new (False: its request id names a job already there)."""
        tenant = current_tenant()
        model = request.model
        # A retry of a known request id attaches to its job without spending the tenant's rate.
        existing = await self.jobs.find_request(tenant.name, request.request_id)
        if existing is not None:
            return existing, False
        # An upload serves one request: the job that takes it, or a refusal that a retry of the same request
        # would meet again; a refusal for load (rate, queue, a starting cluster) leaves it for the retry.
        upload_ids = [image.upload_id for image in request.images if image.upload_id]
        refusal: tuple[grpc.StatusCode, str, float | None] | None = None
        full = None
        try:
            self.tenants.check_rate(tenant)
            request = await self.uploads.resolve(tenant.name, request)
            # The images count in the tenant's stored bytes before a byte of them is parsed.
            self.jobs.check_stored_bytes(tenant, sum(len(image.data) for image in request.images))
            full = self.complete_request(request, await self._probe_images(request))
            model = full.model
            if full.images:
                # Decoding proves the images whole (a truncated file is refused here, not by a stage later).
                limits = self._models()[full.model].limits
                await self.image_workers.run(functools.partial(verify_images, full, limits))
            self.tenants.check_request_limits(tenant, full)
            check_loras(tenant, full.loras, self._models()[full.model].limits)
            self.adapter_rate.take(tenant, [lora.name for lora in full.loras])
            remaining = context.time_remaining()
            deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
            job, created = await self.jobs.submit(full, tenant, deadline)
            self.uploads.discard(tenant.name, upload_ids)
        except RateLimited as error:
            refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED, error.message, error.retry_after)
        except AdmissionRefused as error:
            refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), error.retry_after_s)
        except (LimitExceeded, LoraNotFound, LoraNotAllowed) as error:
            self.uploads.discard(tenant.name, upload_ids)
            refusal = (error.code, error.message, None)
        except RequestError as error:
            self.uploads.discard(tenant.name, upload_ids)
            refusal = (grpc.StatusCode.INVALID_ARGUMENT, str(error), None)
        except ModelNotFound as error:
            self.uploads.discard(tenant.name, upload_ids)
            refusal = (grpc.StatusCode.NOT_FOUND, str(error), None)
        except StageNotDeployed as error:
            self.uploads.discard(tenant.name, upload_ids)
            refusal = (grpc.StatusCode.FAILED_PRECONDITION, str(error), None)
        except ClusterNotReady as error:
            refusal = (grpc.StatusCode.UNAVAILABLE, str(error), None)
        except StoreError as error:
            logger.exception("the job store refused a job")
            refusal = (grpc.StatusCode.INTERNAL, f"could not store the job: {error}", None)
        if refusal is not None:
            # Answered outside the except blocks, the request's copies dropped: an abort raised inside one would
            # chain the refusal, whose traceback holds the frames that held the image bytes, to this call's
            # context, a cycle that keeps 16 MiB per refused request until the cyclic collector runs.
            request = full = None
            await self._refuse(context, tenant.name, model, *refusal)
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
        return job, created

    async def _find(self, job_id: str, context) -> Job:
        """The caller's job; another tenant's job is as unknown as one that never existed."""
        job = await self.jobs.get(job_id, current_tenant().name) if job_id else None
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, bounded(f"job_id: no job '{job_id}'"))
        return job

    async def _stream(self, job: Job, context):
        """The job's events; a stored result is read from disk one chunk at a time as the client takes them."""
        try:
            async for event in job.follow():
                yield event
        except ResultGone:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                bounded(f"job_id: the result of job '{job.job_id}' was deleted (its tenant's retention limits)"),
            )
        except StoreError as error:
            logger.error("job %s: its result cannot be read: %s", job.job_id, error)
            await context.abort(grpc.StatusCode.INTERNAL, bounded(f"the result of job '{job.job_id}' cannot be read"))
        if job.state != JobState.JOB_STATE_SUCCEEDED:
            context.set_trailing_metadata(((JOB_FAILED_METADATA_KEY, "1"),))
            message = for_tenant(current_tenant(), job.error_message, self._endpoints())
            await context.abort(_abort_code(job), bounded(message or "job did not succeed"))

    async def _replaying(self, context) -> contextlib.AbstractContextManager[None]:
        """Counts a replay stream of the caller's tenant, or refuses it with RESOURCE_EXHAUSTED."""
        try:
            return self.followers.replaying(current_tenant())
        except TooManyWatchers as error:
            await abort_with_retry(context, str(error), WATCH_RETRY_AFTER_S)

    # ---------------------------------------------------------------- rpcs --

    async def Generate(self, request, context):
        job, created = await self._admit(request, context)
        # A retry that attaches to a known job replays it, as WatchJob does, and counts as a watcher.
        replaying = contextlib.nullcontext() if created else await self._replaying(context)
        finished = False
        try:
            with self.followers.following(job), replaying:
                async for event in self._stream(job, context):
                    yield event
            finished = True
        finally:
            if not finished and not job.finished:
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    await self.jobs.cancel(job, grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline passed")
                elif job.request.request_id and self.followers.detach_grace_s > 0:
                    # A lost connection, or a client that stopped listening: its retry may attach again.
                    self.followers.detach(job)
                else:
                    await self.jobs.cancel(job, grpc.StatusCode.CANCELLED, "the client cancelled or disconnected")

    def _endpoints(self) -> list[str]:
        """Every stage replica's endpoint: what a job's error shows only admins (error_redaction.py)."""
        return [replica.endpoint for stage in self.stages.stages.values() for replica in stage.replicas]

    def _shown(self, job: generation_pb2.Job) -> generation_pb2.Job:
        """`job` as the caller may read it: its error names no stage endpoint unless the caller is an admin."""
        return job_for_tenant(current_tenant(), job, self._endpoints())

    async def Submit(self, request, context):
        job, _ = await self._admit(request, context)
        return self._shown(job.to_proto(self.jobs.position(job)))

    async def WatchJob(self, request, context):
        job = await self._find(request.job_id, context)
        with self.followers.following(job), await self._replaying(context):
            async for event in self._stream(job, context):
                yield event

    async def GetJob(self, request, context):
        job = await self._find(request.job_id, context)
        return self._shown(job.to_proto(self.jobs.position(job)))

    async def CancelJob(self, request, context):
        job = await self._find(request.job_id, context)
        await self.jobs.cancel(job)
        return self._shown(job.to_proto())

    async def DeleteJob(self, request, context):
        job = await self._find(request.job_id, context)
        try:
            deleted = await self.jobs.delete(job)
        except StoreError as error:
            logger.error("job %s: deleting it failed: %s", job.job_id, error)
            await context.abort(grpc.StatusCode.INTERNAL, bounded(f"could not delete job '{job.job_id}': {error}"))
        return generation_pb2.DeleteJobResponse(job_id=job.job_id, deleted=deleted)

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
        jobs = await self.jobs.list_jobs(current_tenant().name, request.state, limit)
        return generation_pb2.ListJobsResponse(jobs=[self._shown(job) for job in jobs])

    async def ListModels(self, request, context):
        tenant = current_tenant()
        models = []
        for model, info in self._models().items():
            limits = stages_pb2.ModelLimits()
            limits.CopyFrom(info.limits)
            # Each tenant sees the adapters it may use, never another tenant's.
            del limits.loras[:]
            limits.loras.extend(visible(tenant, info.limits.loras))
            models.append(generation_pb2.ModelDescription(id=model, family=info.family, limits=limits))
        return generation_pb2.ListModelsResponse(models=models)

    async def UploadImage(self, request_iterator, context):
        tenant = current_tenant()

        async def chunks():
            async for chunk in request_iterator:
                yield chunk.data

        try:
            uploaded = await self.uploads.receive(tenant.name, chunks())
        except UploadRefused as error:
            if error.retry_after_s is not None:
                await abort_with_retry(context, error.message, error.retry_after_s)
            await context.abort(error.code, error.message)
        except RequestError as error:  # a chunk over its size, from the bounds check
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return image_pb2.UploadedImage(
            upload_id=uploaded.upload_id,
            size_bytes=uploaded.size_bytes,
            sha256=uploaded.sha256,
            expires_in_s=uploaded.expires_in_s,
        )

    async def GetClusterInfo(self, request, context):
        # Endpoints, devices, weights and every tenant's load are for operators only.
        tenant = current_tenant()
        if not tenant.admin:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"GetClusterInfo: tenant '{tenant.name}' is not an admin tenant (admin: true in the tenants file)",
            )
        # From the pool's periodic probes (every --health-interval), never a probe per call. The stages listed
        # are those this orchestrator has endpoints for, and any its served chain needs but lacks.
        missing = missing_stages(self.stages.stages, self._stage_info("dit"))
        stages = []
        for name in STAGE_ORDER:
            stage = self.stages.stages.get(name)
            if stage is None:
                if name in missing:
                    stages.append(
                        generation_pb2.StageStatus(
                            info=stages_pb2.StageInfo(stage=name),
                            health=NOT_SERVING,
                            detail=f"no endpoint: the served chain needs it; give the orchestrator --{name} HOST:PORT",
                        )
                    )
                continue
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


def check_exposure(
    args: argparse.Namespace,
    tenants: TenantRegistry,
    secret: str | None,
    credentials: grpc.ServerCredentials | None,
) -> None:
    """Refuses, unless --insecure, to send API keys in clear beyond this machine, or to run without the
    cluster secret; a SystemExit naming the flags that fix it.

    Without the secret the orchestrator is not exposed itself, but stages refuse
    its calls unless they too run --insecure: failing here says so at once,
    rather than leaving a cluster that never turns SERVING.
    """
    prog = "stagediff serve orchestrator"
    if not tenants.is_open and credentials is None and not is_loopback(args.host):
        if not args.insecure:
            raise SystemExit(
                f"{prog}: --tenants on --host {args.host} without TLS would send API keys in clear: give "
                "--tls-cert and --tls-key, bind a loopback --host, or pass --insecure (when a proxy in front of "
                "this port ends TLS)"
            )
        logger.warning("--insecure: API keys reach --host %s in clear; a proxy in front must end TLS", args.host)
    if secret is None:
        if not args.insecure:
            raise SystemExit(
                f"{prog}: no cluster secret: stages answer only callers holding theirs; give it with "
                f"--cluster-secret-file FILE or ${CLUSTER_SECRET_ENV}, or pass --insecure to call stages that run "
                "--insecure"
            )
        logger.warning("--insecure and no cluster secret: only stages started with --insecure will answer")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    for flag, value, least in (
        ("--max-running-jobs", args.max_running_jobs, 1),
        ("--max-queued-jobs", args.max_queued_jobs, 1),
        ("--stage-retries", args.stage_retries, 0),
        ("--max-kept-jobs", args.max_kept_jobs, 1),
        ("--max-job-attempts", args.max_job_attempts, 1),
        ("--adapters-per-minute", args.adapters_per_minute, 0),
    ):
        if value < least:
            parser.error(f"{flag} {value}: use {least} or more")
    if not (math.isfinite(args.job_retention) and args.job_retention >= 0):
        parser.error(f"--job-retention {args.job_retention}: use 0 (no age limit) or more seconds")
    if args.max_stored_bytes_per_tenant < 1:
        parser.error(f"--max-stored-bytes-per-tenant {args.max_stored_bytes_per_tenant}: use 1 byte or more")
    if not (math.isfinite(args.detach_grace) and 0 <= args.detach_grace <= 3600):
        parser.error(f"--detach-grace {args.detach_grace}: use 0 to 3600 seconds")
    configure_logging(args.log_level, args.log_format)
    return_large_buffers_to_the_system()  # clients' images and uploads pass through here
    configure_tracing("stagediff-orchestrator")
    try:
        tenants = TenantRegistry.from_file(args.tenants) if args.tenants else TenantRegistry.open()
        secret = load_cluster_secret(args.cluster_secret_file)
        credentials = server_credentials_from_args(args)
        stage_credentials = stage_channel_credentials_from_args(args)
    except (TenantConfigError, ClusterSecretError, TLSConfigError) as error:
        raise SystemExit(f"stagediff serve orchestrator: {error}") from None
    check_server_arguments("stagediff serve orchestrator", args)
    check_exposure(args, tenants, secret, credentials)
    if tenants.is_open:
        logger.warning("no --tenants file: every caller is the open tenant 'default', with no key and no quota")
    try:
        store = JobStore.open(args.state_dir)
    except StoreError as error:
        raise SystemExit(f"stagediff serve orchestrator: --state-dir {args.state_dir}: {error}") from None
    try:
        asyncio.run(_serve(args, tenants, secret, credentials, store, stage_credentials))
    finally:
        store.close()


async def _serve(
    args: argparse.Namespace,
    tenants: TenantRegistry,
    secret: str | None,
    credentials: grpc.ServerCredentials | None,
    store: JobStore,
    stage_credentials: grpc.ChannelCredentials | None = None,
) -> None:
    server_metrics = ServerMetrics()
    metrics = OrchestratorMetrics(server_metrics.registry)
    try:
        start_metrics_server(args.metrics_port, metrics.registry, addr=args.host)
    except (OSError, ValueError) as error:
        raise SystemExit(f"stagediff serve orchestrator: --metrics-port {args.metrics_port}: {error}") from None
    stages = StagePool(
        {stage: getattr(args, stage.replace("-", "_")) for stage in STAGE_ORDER},
        probe_interval_s=args.health_interval,
        replica_wait_s=args.replica_wait,
        secret=secret,
        metrics=metrics,
        credentials=stage_credentials,
    )
    pipeline = Pipeline(
        stages,
        stage_retries=args.stage_retries,
        store=store,
        metrics=metrics,
        cluster_secret=secret,
        batch_per_tenant=batch_per_tenant(args, has_tenants=not tenants.is_open),
    )
    scheduler = FairScheduler(max_queued=args.max_queued_jobs, max_running=args.max_running_jobs)
    jobs = JobManager(
        pipeline.run,
        scheduler,
        store,
        restore_job=restore_intermediates,
        max_kept=args.max_kept_jobs,
        max_stored_bytes=args.max_stored_bytes_per_tenant,
        retention_s=args.job_retention or None,
        min_free=args.min_free_bytes,
        max_attempts=args.max_job_attempts,
        tenants=tenants.tenants,
        metrics=metrics,
    )
    servicer = GenerationServicer(
        stages,
        jobs,
        tenants,
        metrics,
        detach_grace_s=args.detach_grace,
        adapter_rate=AdapterRate(args.adapters_per_minute),
    )

    def register(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name]

    async def shutdown() -> None:
        await servicer.followers.close()
        await jobs.shutdown()
        await stages.close()

    await serve(
        name="orchestrator",
        host=args.host,
        port=args.port,
        register=register,
        load=servicer.start,
        on_shutdown=shutdown,
        interceptors=[
            TenantAuthInterceptor(tenants),
            RequestBoundsInterceptor([generation_pb2.DESCRIPTOR.services_by_name["Generation"]]),
        ],
        credentials=credentials,
        metrics=server_metrics,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_health_watchers=args.max_health_watchers,
        options=PUBLIC_PORT_OPTIONS,
    )


if __name__ == "__main__":
    main()
