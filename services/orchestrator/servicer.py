"""The orchestrator's Generation servicer: the public API's RPCs, on behalf of the caller's tenant.

Every call is authenticated (`authorization: Bearer <key>`, see tenant_auth.py) and belongs to a tenant; a
tenant sees, fetches and cancels only its own jobs (another tenant's job id answers NOT_FOUND, so ids
reveal nothing). Admission checks, in order: the tenant's request rate, the request itself
(INVALID_ARGUMENT, request_defaults.py), the tenant's size limits (PERMISSION_DENIED), then the queue and
the tenant's share of it (RESOURCE_EXHAUSTED with a RetryInfo saying when to come back); refusals.py maps
each refusal to its status. Errors shown to a tenant name no stage endpoint unless it is an admin.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from services.image_work import ImageWorkers
from services.images import ImageInfo
from services.metrics import OrchestratorMetrics
from services.orchestrator import request_defaults
from services.orchestrator.adapter_rate import AdapterRate
from services.orchestrator.chain import StageNotDeployed, chain_problem
from services.orchestrator.cluster_status import cluster_status
from services.orchestrator.error_redaction import for_tenant, job_for_tenant
from services.orchestrator.followers import JobFollowers, TooManyWatchers
from services.orchestrator.image_uploads import UPLOADS_DIR, ImageUploads, UploadRefused
from services.orchestrator.job import Job, JobState
from services.orchestrator.jobs import JobManager
from services.orchestrator.lora_access import check_loras
from services.orchestrator.membership import Membership
from services.orchestrator.model_listing import list_models
from services.orchestrator.options import DEFAULT_DETACH_GRACE_S
from services.orchestrator.placement import Placement
from services.orchestrator.refusals import (
    REFUSABLE,
    ClusterNotReady,
    Refusal,
    abort_store_unavailable,
    refusal_for,
)
from services.orchestrator.relay import Relay
from services.orchestrator.request_images import check_image_budget, probe_images, verify_images
from services.orchestrator.stage_clients import StagePool
from services.orchestrator.store.jobstore import DEFAULT_LEASE_TTL_S
from services.orchestrator.store_errors import ResultGone, StoreError, StoreUnavailable
from services.orchestrator.tenant_auth import current_tenant
from services.orchestrator.tenants import TenantRegistry, visible_models
from stagediff.protocol import JOB_FAILED_METADATA_KEY
from stagediff.status_details import abort_with_retry
from stagediff.v1 import generation_pb2, generation_pb2_grpc, image_pb2, stages_pb2
from stagekit.errors import RequestError, bounded

logger = logging.getLogger(__name__)

MAX_LIST_LIMIT = 1000
# The model label of a request refused before it named a served model: metric labels come from bounded sets.
UNKNOWN_MODEL_LABEL = "unknown"
# When a tenant at its max_watch_streams may try again.
WATCH_RETRY_AFTER_S = 1.0


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
        membership: Membership | None = None,
        relay: Relay | None = None,
        job_lease_s: float = DEFAULT_LEASE_TTL_S,
        presign_downloads_s: int = 0,
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
        # The other orchestrator replicas, when there are: where each call is answered (placement.py).
        self.placement = Placement(jobs, membership, relay, job_lease_s)
        self.relay = relay
        # Seconds a presigned download URL lives (GetJob's download_url); 0: none.
        self.presign_downloads_s = presign_downloads_s

    async def start(self) -> None:
        """Readies the orchestrator while its health says NOT_SERVING (the `load` of services.server.serve).

        Waits until every stage it has endpoints for serves, then checks that the served family's chain
        has every stage it cannot do without: if not, it logs why and stays NOT_SERVING (refusing requests
        with FAILED_PRECONDITION naming the missing flag) until it is stopped. Then it joins the replicas
        (placement.py): alone, the jobs accepted before a restart are queued again, in their order, before any
        new request is admitted; replicated, followers serve at once and the leader queues them.
        """
        await self.stages.wait_until_serving()
        problem = self.chain_problem()
        if problem is not None:
            logger.error("%s; health stays NOT_SERVING", problem)
            await asyncio.get_running_loop().create_future()  # never set: serve() stops waiting on SIGTERM
        await self.placement.join()
        self.ready.set()

    async def leave(self, drain_s: float) -> None:
        """Leaves the group of replicas at a drain (Placement.leave)."""
        await self.placement.leave(drain_s)

    def _stage_info(self, name: str) -> stages_pb2.StageInfo | None:
        """The StageInfo of a stage this orchestrator has endpoints for; None without them, or before one answered."""
        stage = self.stages.stages.get(name)
        return stage.info if stage is not None else None

    def chain_problem(self, model: str = "") -> str | None:
        """Why a served model's chain (`model`'s, or any one's) cannot run here (a stage without endpoints, a
        family this build does not know), or None."""
        dit = self.stages.stages.get("dit")
        reported = [replica.info for replica in dit.replicas if replica.info is not None] if dit is not None else []
        infos = {
            info.model: info for info in [*(route.info for route in self.stages.routes.models().values()), *reported]
        }
        return chain_problem(self.stages.stages, [info for name, info in infos.items() if name == model or not model])

    def _models(self) -> dict[str, stages_pb2.StageInfo]:
        """The served models (routes.py) and the StageInfo of a DiT replica of each."""
        return {model: route.info for model, route in self.stages.routes.models().items()}

    async def _probe_images(self, request: generation_pb2.GenerateRequest) -> list[ImageInfo] | None:
        """The headers of the request's images, read on the image workers once their count and bytes are
        within the model's limits; None when the request names no served model (complete_request says so)."""
        models = self._models()
        info = models.get(request.model or self.stages.routes.default(visible_models(current_tenant(), models)))
        if info is None or not request.images or not self.ready.is_set():
            return None
        check_image_budget(request.images, info.limits)
        return await self.image_workers.run(
            functools.partial(probe_images, request.images, info.limits.max_image_pixels)
        )

    def complete_request(
        self, request: generation_pb2.GenerateRequest, probed: Sequence[ImageInfo] | None = None
    ) -> generation_pb2.GenerateRequest:
        """Validates a request and fills in every default (request_defaults.py); raises RequestError,
        ModelNotFound, StageNotDeployed or ClusterNotReady. `probed` is what `_probe_images` read of the
        request's images."""
        problem = self.chain_problem(request.model)
        if problem is not None:
            raise StageNotDeployed(problem)
        if not self.ready.is_set():
            waiting = [name for name, stage in self.stages.stages.items() if stage.info is None]
            raise ClusterNotReady(
                f"the cluster is starting; waiting for stage(s) {', '.join(waiting)} to serve"
                if waiting
                else "the cluster is starting; the jobs accepted before a restart are being queued again"
            )
        route = self.stages.routes.resolve(request.model, visible_models(current_tenant(), self._models()))
        limits = stages_pb2.ModelLimits()
        limits.CopyFrom(route.info.limits)
        # A patch-parallel VAE needs enough rows for its ranks: the larger minimum of those serving the model wins.
        vae = self.stages.stages.get("vae")
        vae_info = vae.info_for(route.accepts("vae", "decode")) if vae is not None else None
        if vae_info is not None and vae_info.limits.min_height > limits.min_height:
            limits.min_height = vae_info.limits.min_height
        return request_defaults.complete_request(
            request, route.model, limits, route.family, self.stages.stages, self._stage_info("interp"), probed
        )

    def _model_label(self, model: str) -> str:
        """`model` as a metric label: a served model id, or a fixed value for anything else."""
        models = self._models()
        if not model:
            return self.stages.routes.default(list(models)) or UNKNOWN_MODEL_LABEL
        return model if model in models else UNKNOWN_MODEL_LABEL

    async def _refuse(self, context: grpc.aio.ServicerContext, tenant: str, model: str, refusal: Refusal) -> None:
        """Counts a refused request and ends its call; with a retry delay, a RetryInfo says when to retry."""
        code, message = refusal.code, refusal.message
        if self.metrics is not None:
            self.metrics.request_finished(tenant=tenant, model=self._model_label(model), code=code)
        if refusal.retry_after_s is not None:
            await abort_with_retry(context, bounded(message), refusal.retry_after_s, code=code)
        await context.abort(code, bounded(message))

    async def _admit(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[Job, bool]:
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
        refusal: Refusal | None = None
        full: generation_pb2.GenerateRequest | None = None
        try:
            self.tenants.check_rate(tenant)
            if request.model:  # before anything else is said of the model, so that a forbidden one stays unknown
                self.tenants.check_model(tenant, request.model)
            request = await self.uploads.resolve(tenant.name, request)
            if request.images:  # they count in the tenant's stored bytes before a byte of them is parsed
                await self.jobs.check_stored_bytes(tenant, sum(len(image.data) for image in request.images))
            full = self.complete_request(request, await self._probe_images(request))
            model = full.model
            self.tenants.check_model(tenant, model)
            if full.images:
                # Decoding proves the images whole (a truncated file is refused here, not by a stage later).
                limits = self._models()[full.model].limits
                await self.image_workers.run(functools.partial(verify_images, full, limits))
            self.tenants.check_request_limits(tenant, full)
            check_loras(tenant, full.loras, self._models()[full.model].limits)
            self.adapter_rate.take(tenant, [lora.name for lora in full.loras])
            remaining = context.time_remaining()
            if full.deadline_s > 0:  # the request's own deadline; the call's, when earlier, holds
                remaining = full.deadline_s if remaining is None else min(remaining, full.deadline_s)
            deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
            job, created = await self.jobs.submit(full, tenant, deadline)
            self.uploads.discard(tenant.name, upload_ids)
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
        except REFUSABLE as error:
            if isinstance(error, StoreError):
                logger.exception("the job store refused a job")
            refusal = refusal_for(error)
            if refusal.drops_uploads:
                self.uploads.discard(tenant.name, upload_ids)
        if refusal is not None:
            # Answered outside the except blocks, the request's copies dropped: an abort raised inside one would
            # chain the refusal, whose traceback holds the frames that held the image bytes, to this call's
            # context, a cycle that keeps 16 MiB per refused request until the cyclic collector runs.
            del request, full
            await self._refuse(context, tenant.name, model, refusal)
        return job, created

    async def _find(self, job_id: str, context: grpc.aio.ServicerContext) -> Job:
        """The caller's job; another tenant's job is as unknown as one that never existed."""
        try:
            job = await self.jobs.get(job_id, current_tenant().name) if job_id else None
        except StoreUnavailable as error:
            await abort_store_unavailable(context, error)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, bounded(f"job_id: no job '{job_id}'"))
        assert job is not None  # context.abort raised
        return job

    async def _stream(self, job: Job, context: grpc.aio.ServicerContext) -> AsyncIterator[generation_pb2.GenerateEvent]:
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

    async def _replaying(self, context: grpc.aio.ServicerContext) -> contextlib.AbstractContextManager[None]:
        """Counts a replay stream of the caller's tenant, or refuses it with RESOURCE_EXHAUSTED."""
        try:
            return self.followers.replaying(current_tenant())
        except TooManyWatchers as error:
            await abort_with_retry(context, str(error), WATCH_RETRY_AFTER_S)

    async def Generate(
        self,
        request: generation_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[generation_pb2.GenerateRequest, generation_pb2.GenerateEvent],
    ) -> AsyncIterator[generation_pb2.GenerateEvent]:
        peer = await self.placement.admission_peer(context)
        if peer is not None and self.relay is not None:
            async for event in self.relay.stream(peer, "Generate", request, context):
                yield event
            return
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

    async def Submit(
        self,
        request: generation_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[generation_pb2.GenerateRequest, generation_pb2.Job],
    ) -> generation_pb2.Job:
        peer = await self.placement.admission_peer(context)
        if peer is not None and self.relay is not None:
            relayed: generation_pb2.Job = await self.relay.unary(peer, "Submit", request, context)
            return relayed
        job, _ = await self._admit(request, context)
        return self._shown(job.to_proto(self.jobs.position(job)))

    async def WatchJob(
        self,
        request: generation_pb2.WatchJobRequest,
        context: grpc.aio.ServicerContext[generation_pb2.WatchJobRequest, generation_pb2.GenerateEvent],
    ) -> AsyncIterator[generation_pb2.GenerateEvent]:
        peer = await self.placement.job_peer(request.job_id, context)
        if peer is not None and self.relay is not None:
            async for event in self.relay.stream(peer, "WatchJob", request, context):
                yield event
            return
        job = await self._find(request.job_id, context)
        with self.followers.following(job), await self._replaying(context):
            async for event in self._stream(job, context):
                yield event

    async def GetJob(
        self,
        request: generation_pb2.GetJobRequest,
        context: grpc.aio.ServicerContext[generation_pb2.GetJobRequest, generation_pb2.Job],
    ) -> generation_pb2.Job:
        peer = await self.placement.job_peer(request.job_id, context)
        if peer is not None and self.relay is not None:
            found: generation_pb2.Job = await self.relay.unary(peer, "GetJob", request, context)
            return found
        job = await self._find(request.job_id, context)
        shown = self._shown(job.to_proto(self.jobs.position(job)))
        if self.presign_downloads_s and job.state == JobState.JOB_STATE_SUCCEEDED:
            shown.download_url = await self.jobs.download_url(job, self.presign_downloads_s) or ""
        return shown

    async def CancelJob(
        self,
        request: generation_pb2.CancelJobRequest,
        context: grpc.aio.ServicerContext[generation_pb2.CancelJobRequest, generation_pb2.Job],
    ) -> generation_pb2.Job:
        peer = await self.placement.job_peer(request.job_id, context)
        if peer is not None and self.relay is not None:
            cancelled: generation_pb2.Job = await self.relay.unary(peer, "CancelJob", request, context)
            return cancelled
        job = await self._find(request.job_id, context)
        await self.jobs.cancel(job)
        return self._shown(job.to_proto())

    async def DeleteJob(
        self,
        request: generation_pb2.DeleteJobRequest,
        context: grpc.aio.ServicerContext[generation_pb2.DeleteJobRequest, generation_pb2.DeleteJobResponse],
    ) -> generation_pb2.DeleteJobResponse:
        peer = await self.placement.job_peer(request.job_id, context)
        if peer is not None and self.relay is not None:
            answer: generation_pb2.DeleteJobResponse = await self.relay.unary(peer, "DeleteJob", request, context)
            return answer
        job = await self._find(request.job_id, context)
        try:
            deleted = await self.jobs.delete(job)
        except StoreError as error:
            logger.error("job %s: deleting it failed: %s", job.job_id, error)
            await context.abort(grpc.StatusCode.INTERNAL, bounded(f"could not delete job '{job.job_id}': {error}"))
        return generation_pb2.DeleteJobResponse(job_id=job.job_id, deleted=deleted)

    async def ListJobs(
        self,
        request: generation_pb2.ListJobsRequest,
        context: grpc.aio.ServicerContext[generation_pb2.ListJobsRequest, generation_pb2.ListJobsResponse],
    ) -> generation_pb2.ListJobsResponse:
        limit = request.limit or 100
        if not 0 < limit <= MAX_LIST_LIMIT:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"limit: must be between 0 and {MAX_LIST_LIMIT} (0 means 100)"
            )
        if request.state not in JobState.values():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"state: {request.state} is not one of {list(JobState.keys())}"
            )
        try:
            jobs = await self.jobs.list_jobs(current_tenant().name, request.state, limit)
        except StoreUnavailable as error:
            await abort_store_unavailable(context, error)
        return generation_pb2.ListJobsResponse(jobs=[self._shown(job) for job in jobs])

    async def ListModels(
        self,
        request: generation_pb2.ListModelsRequest,
        context: grpc.aio.ServicerContext[generation_pb2.ListModelsRequest, generation_pb2.ListModelsResponse],
    ) -> generation_pb2.ListModelsResponse:
        return generation_pb2.ListModelsResponse(models=list_models(self.stages, current_tenant()))

    async def UploadImage(
        self,
        request_iterator: AsyncIterator[image_pb2.ImageUploadChunk],
        context: grpc.aio.ServicerContext[image_pb2.ImageUploadChunk, image_pb2.UploadedImage],
    ) -> image_pb2.UploadedImage:
        peer = await self.placement.admission_peer(context)  # held by the replica that admits the request naming it
        if peer is not None and self.relay is not None:
            uploaded_there: image_pb2.UploadedImage = await self.relay.unary(
                peer, "UploadImage", request_iterator, context
            )
            return uploaded_there
        tenant = current_tenant()

        async def chunks() -> AsyncIterator[bytes]:
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

    async def GetClusterInfo(
        self,
        request: generation_pb2.GetClusterInfoRequest,
        context: grpc.aio.ServicerContext[generation_pb2.GetClusterInfoRequest, generation_pb2.ClusterInfo],
    ) -> generation_pb2.ClusterInfo:
        # Endpoints, devices, weights and every tenant's load are for operators only.
        tenant = current_tenant()
        if not tenant.admin:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"GetClusterInfo: tenant '{tenant.name}' is not an admin tenant (admin: true in the tenants file)",
            )
        return cluster_status(self.stages)
