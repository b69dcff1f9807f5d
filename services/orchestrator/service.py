"""The orchestrator service: the public Generation API of a StageDiff cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random

import grpc

from services.errors import RequestError
from services.orchestrator.jobs import Job, JobManager, JobState, QueueFull
from services.orchestrator.pipeline import Pipeline
from services.orchestrator.stage_clients import PROBE_INTERVAL_S, REPLICA_WAIT_S, STAGE_ORDER, StagePool
from services.server import configure_logging, serve
from services.validation import validate_sampling, validate_seed, validate_size
from stagediff import __version__
from stagediff.protocol import JOB_FAILED_METADATA_KEY
from stagediff.v1 import generation_pb2, generation_pb2_grpc, stages_pb2

logger = logging.getLogger(__name__)

MAX_INTERP_EXP = 4
ALLOWED_INTERP_SCALES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
MAX_FPS = 240.0
MAX_REQUEST_ID_CHARS = 128


class ModelNotFound(LookupError):
    """The request names a model no stage serves (NOT_FOUND)."""


class ClusterNotReady(Exception):
    """Some stage has not reported SERVING since the orchestrator started."""


def _abort_code(job: Job) -> grpc.StatusCode:
    if job.error_code is not None:
        return job.error_code
    return grpc.StatusCode.CANCELLED if job.state == JobState.JOB_STATE_CANCELLED else grpc.StatusCode.UNKNOWN


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, stages: StagePool, jobs: JobManager) -> None:
        self.stages = stages
        self.jobs = jobs
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

    async def _admit(self, request, context) -> Job:
        try:
            full = self.complete_request(request)
            job, created = self.jobs.submit(full)
        except RequestError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except ModelNotFound as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        except QueueFull as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except ClusterNotReady as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        if created:
            remaining = context.time_remaining()
            if remaining is not None:
                job.deadline = asyncio.get_running_loop().time() + remaining
            logger.info(
                "job %s queued: %dx%d, %d frames, %d steps",
                job.job_id,
                full.height,
                full.width,
                full.num_frames,
                full.num_inference_steps,
            )
        return job

    async def _find(self, job_id: str, context) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"job_id: no job '{job_id}'")
        return job

    async def _stream(self, job: Job, context):
        async for event in job.follow():
            yield event
        if job.state != JobState.JOB_STATE_SUCCEEDED:
            context.set_trailing_metadata(((JOB_FAILED_METADATA_KEY, "1"),))
            await context.abort(_abort_code(job), job.error_message or "job did not succeed")

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
        if limit < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit: must be >= 0 (0 means 100)")
        jobs = [
            job.to_proto(self.jobs.position(job))
            for job in reversed(self.jobs.jobs.values())
            if request.state in (JobState.JOB_STATE_UNSPECIFIED, job.state)
        ]
        return generation_pb2.ListJobsResponse(jobs=jobs[:limit])

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
    parser = argparse.ArgumentParser(prog="stagediff serve orchestrator", description=__doc__)
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
    parser.add_argument("--max-queued-jobs", type=int, default=256)
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
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> None:
    stages = StagePool(
        {stage: getattr(args, stage.replace("-", "_")) for stage in STAGE_ORDER},
        probe_interval_s=args.health_interval,
        replica_wait_s=args.replica_wait,
    )
    pipeline = Pipeline(stages, stage_retries=args.stage_retries)
    jobs = JobManager(pipeline.run, max_running=args.max_running_jobs, max_queued=args.max_queued_jobs)
    servicer = GenerationServicer(stages, jobs)

    def register(server: grpc.aio.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name]

    async def load() -> None:
        await stages.wait_until_serving()
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
    )


if __name__ == "__main__":
    main()
