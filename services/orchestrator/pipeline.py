"""One job's trip through the stages of its family's chain: text encoder, DiT, VAE, and interpolator.

- The stages are the family's chain less the optional stages the request leaves off
  (services/orchestrator/chain.py). The text encoder runs to its end first, so no DiT replica is held while
  prompts are encoded; a request's input images go through the VAE's Encode at the same time (kept as
  "vae-encode"; its "image_latents" join the conditioning). Later stages run at the same time, joined by
  queues: each chunk is forwarded as it arrives and the last stage's frames go to the result
  (`ResultPublisher`); the VAE's sound (a model that makes video with sound) goes straight to the result, past
  the interpolator. The calls themselves are in services/orchestrator/stage_calls.py.
- Finished stages leave their output (`KEPT_OUTPUTS`) in `job.intermediates` and, once the job has run on
  past them a while (services/orchestrator/kept_outputs.py), in the `JobStore`, so a retry or a restarted
  orchestrator resumes after the last finished stage (`restore_intermediates`).
- A call that fails with UNAVAILABLE takes its replica out of rotation. Failing over to another serving replica
  is free (bounded per job and stage by the replica count); otherwise the retry spends one of `stage_retries`
  after a short backoff and waits a bounded time for a replica before the job fails with UNAVAILABLE naming the
  stage.
- The result file is fsynced and renamed into place with the row that marks the job SUCCEEDED, before the
  completion event; a failed or cancelled job deletes its partial files. A store failure fails the job with
  RESOURCE_EXHAUSTED or INTERNAL, naming what could not be written.

`run` needs a store; a pipeline without one serves only tests that call single stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc

from services.encoding import RAW, AudioTrack, output_format
from services.metrics import OrchestratorMetrics
from services.orchestrator import kept_outputs
from services.orchestrator.admission import has_sound, result_shape
from services.orchestrator.cache_namespace import cache_namespace_key
from services.orchestrator.chain import stages_for
from services.orchestrator.denoise_call import DIT_STATE
from services.orchestrator.dispatch import MOVED, store_failure
from services.orchestrator.dit_gate import DitGate
from services.orchestrator.encoded_results import EncodedResult, EncodingError
from services.orchestrator.job import Job, JobState
from services.orchestrator.preemption import CheckpointPolicy
from services.orchestrator.result_publisher import ResultPublisher
from services.orchestrator.routes import ModelRoute, accept_any
from services.orchestrator.stage_calls import END, VAE_ENCODE, StageCalls
from services.orchestrator.stage_clients import StageError, StagePool
from services.orchestrator.step_times import StepTimes
from services.orchestrator.store import InvalidTransition, JobStore, LeaseLost, StoreError
from services.orchestrator.store_retry import store_call
from stagediff.tensor_codec import WireError
from stagediff.v1 import generation_pb2, tensor_pb2

logger = logging.getLogger(__name__)

# Stages whose whole output a job keeps (in `job.intermediates["outputs"]` and in the store), so that a retry
# or a restart resumes after them: the conditioning and the latents, small next to the frames.
KEPT_OUTPUTS = ("text-encoder", VAE_ENCODE, "dit")


def _first_stage_error(group: BaseExceptionGroup) -> BaseException:
    """Picks the error to report from a TaskGroup failure: a stage's error over anything else."""
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        else:
            leaves.append(error)

    collect(group)
    return next((e for e in leaves if isinstance(e, StageError)), leaves[0])


def restore_intermediates(job: Job, stored: dict[str, list[tensor_pb2.TensorChunk]]) -> None:
    """Puts the stage outputs a store kept for an unfinished job back where `_run_once` resumes from them."""
    kept = (*KEPT_OUTPUTS, DIT_STATE)
    job.intermediates["outputs"] = {stage: chunks for stage, chunks in stored.items() if stage in kept}


class Pipeline:
    """Runs jobs through their family's chain of stages, retrying and failing over, and stores their results."""

    def __init__(
        self,
        stages: StagePool,
        stage_retries: int = 1,
        retry_backoff_s: float = 0.5,
        store: JobStore | None = None,
        metrics: OrchestratorMetrics | None = None,
        cluster_secret: str | None = None,
        batch_per_tenant: bool = False,
        keep_outputs_after_s: float = kept_outputs.DEFAULT_AFTER_S,
        gate: DitGate | None = None,
        checkpoints: CheckpointPolicy | None = None,
        step_times: StepTimes | None = None,
    ) -> None:
        """`gate`, `checkpoints`, `step_times`: the DiT's step-level scheduling (StageCalls says what each is)."""
        self.stages = stages
        self.store = store
        self.metrics = metrics
        # Retries of a stage with no other serving replica; failovers to another replica are free.
        self.stage_retries = stage_retries
        self.retry_backoff_s = retry_backoff_s
        self.calls = StageCalls(
            stages,
            store,
            metrics,
            cache_namespace_key(cluster_secret),
            batch_per_tenant,
            keep_outputs_after_s,
            gate=gate,
            checkpoints=checkpoints,
            step_times=step_times,
        )

    async def run(self, job: Job) -> None:
        """Runs a job to its end and records the outcome on it (never raises, except when cancelled)."""
        store = self.store
        if store is None:
            raise RuntimeError("Pipeline.run needs a JobStore to write the result into")
        committed = False
        try:
            committed = await self._run_and_store(job, store)
        finally:
            if job.encoder is not None:
                job.encoder.close()
            if not committed:
                saving = job.intermediates.get("saving", [])
                if job.intermediates.get("handing_back"):  # it runs again from its last kept stage
                    await kept_outputs.flush(saving)
                else:
                    kept_outputs.drop(saving)
                for file in (job.result, job.encoded, job.audio):
                    if file is not None:
                        await asyncio.to_thread(file.discard)

    async def _run_and_store(self, job: Job, store: JobStore) -> bool:
        """The job's run; True once its result is committed to the store."""
        started = time.perf_counter()
        try:
            deadline = asyncio.timeout_at(job.deadline) if job.deadline is not None else contextlib.nullcontext()
            async with deadline:
                job.result = result = await store_call(store.create_result, job.job_id, result_shape(job.request))
                output = output_format(job.request.output_format)
                if output.name != RAW:
                    job.encoded = encoded = await store_call(
                        store.create_encoded, job.job_id, output.extension, output.media_type
                    )
                    job.encoder = EncodedResult(job, result, encoded)
                await self._run_with_retries(job)
                if has_sound(job.request) and job.audio is None:
                    raise WireError("audio: the VAE sent no sound for a model that makes video with sound")
                if job.encoder is not None:
                    await job.encoder.finish()
        except TimeoutError:
            stage = job.current_stage or "the queue"
            await job.finish(
                JobState.JOB_STATE_FAILED, grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline exceeded in {stage}"
            )
            return False
        except StageError as error:
            logger.warning("job %s failed: %s", job.job_id, error)
            await job.finish(JobState.JOB_STATE_FAILED, error.code, str(error))
            return False
        except WireError as error:
            await job.finish(JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, f"a stage sent bad data: {error}")
            return False
        except EncodingError as error:
            logger.error("job %s failed: %s", job.job_id, error)
            await job.finish(JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, str(error))
            return False
        except StoreError as error:  # InvalidTransition included: the store no longer holds the job as running
            code, message = store_failure(error, "could not write the job's data")
            logger.error("job %s failed: %s", job.job_id, message)
            await job.finish(JobState.JOB_STATE_FAILED, code, message)
            return False
        job.timings["total"] = time.perf_counter() - started
        job.num_frames_out = int(job.intermediates.get("frames_published", 0))
        if not await self._commit_result(job, store):
            return False
        await job.publish(
            generation_pb2.GenerateEvent(
                completed=generation_pb2.JobCompleted(
                    timings=job.timings,
                    num_frames=job.num_frames_out,
                    fps=job.fps_out,
                    transformer_passes=job.transformer_passes,
                    media_type=job.encoded.media_type if job.encoded is not None else "",
                    encoded_bytes=job.encoded.size if job.encoded is not None else 0,
                    seed=job.request.seed,
                    notices=job.notices,
                )
            )
        )
        await job.finish(JobState.JOB_STATE_SUCCEEDED)
        return True

    async def _commit_result(self, job: Job, store: JobStore) -> bool:
        """Completes the result file and marks the job SUCCEEDED in the store, before any client hears it."""
        assert job.result is not None  # `_run_and_store` made it before the run
        try:
            await kept_outputs.settle(job.intermediates.get("saving", []))  # none may land after the commit
            await store_call(
                store.commit_result,
                job.result,
                job.fps_out,
                passes=(job.transformer_passes.run, job.transformer_passes.skipped),
                encoded=job.encoded,
                audio=job.audio,
                keep_raw=job.request.keep_raw_frames,
                timings=job.timings,
            )
        except LeaseLost:  # another replica runs the job now: this run leaves it to that one
            job.intermediates["lease_lost"] = True
            job.intermediates["cancel_reason"] = (grpc.StatusCode.UNAVAILABLE, MOVED)
            raise asyncio.CancelledError from None
        except InvalidTransition:  # cancelled while the file was being completed
            raise asyncio.CancelledError from None
        except StoreError as error:
            code, message = store_failure(error, "could not store the result")
            logger.error("job %s failed: %s", job.job_id, message)
            await job.finish(JobState.JOB_STATE_FAILED, code, message)
            return False
        except ValueError as error:  # the stages sent fewer frames than the request makes
            await job.finish(
                JobState.JOB_STATE_FAILED, grpc.StatusCode.INTERNAL, f"could not store the result: {error}"
            )
            return False
        return True

    def _route(self, job: Job) -> ModelRoute:
        """The job's model's route (routes.py): its family's chain, and which replicas serve it at each stage."""
        route = self.stages.routes.get(job.request.model)
        if route is None:
            dit = self.stages["dit"]
            raise StageError(
                "dit", dit.endpoint, grpc.StatusCode.UNAVAILABLE, f"no replica has served model '{job.request.model}'"
            )
        return route

    async def _run_with_retries(self, job: Job) -> None:
        attempt = 0
        failovers: dict[str, int] = {}
        while True:
            try:
                await self._run_once(job)
                return
            except BaseExceptionGroup as group:
                error = _first_stage_error(group)
            except StageError as stage_error:
                error = stage_error
            if not isinstance(error, StageError) or error.code != grpc.StatusCode.UNAVAILABLE:
                raise error
            stage = self.stages[error.stage]
            route = self.stages.routes.get(job.request.model)
            serving = stage.serving(route.accepts(stage.name) if route is not None else accept_any)
            others = [replica for replica in serving if replica.endpoint != error.endpoint]
            if others and failovers.get(stage.name, 0) < len(stage.replicas):
                failovers[stage.name] = failovers.get(stage.name, 0) + 1
                if self.metrics is not None:
                    self.metrics.stage_failover(stage.name, error.endpoint)
                logger.info("job %s: %s; failing over to another replica", job.job_id, error)
                continue
            if attempt >= self.stage_retries:
                raise error
            attempt += 1
            if self.metrics is not None:
                self.metrics.stage_retry(stage.name)
            logger.info("job %s: %s; retry %d from the last finished stage", job.job_id, error, attempt)
            await asyncio.sleep(self.retry_backoff_s * attempt)

    async def _run_once(self, job: Job) -> None:
        request = job.request
        route = self._route(job)
        family = route.family
        stages = stages_for(family, request)
        job.chain = tuple(stages)
        job.fps_out = request.fps * (2**request.interpolation.exp if "interp" in stages else 1)
        outputs: dict[str, list[tensor_pb2.TensorChunk]] = job.intermediates.setdefault("outputs", {})
        # The conditioning: the text encoder's, and the VAE's encode of the input images, at the same time.
        encode_images = bool(request.images) and "vae" in family.images.encoded_by
        async with asyncio.TaskGroup() as group:
            if "text-encoder" not in outputs:
                group.create_task(self.calls.encode(job, route))
            if encode_images and VAE_ENCODE not in outputs:
                group.create_task(self.calls.encode_images(job, route))
        if request.images and self.store is not None:
            # The conditioning is kept: a retry or a restart resumes from it, never from the images again.
            await asyncio.to_thread(self.store.drop_input_images, job.job_id)
        assert job.result is not None  # `_run_and_store` made it before the run
        limits = route.info.limits
        sound = AudioTrack(limits.audio_sample_rate, limits.audio_channels) if limits.audio_sample_rate > 0 else None
        if job.encoder is not None and has_sound(request):
            job.encoder.sound = sound  # muxed beside the frames (before the first: the container's streams)
        publisher = ResultPublisher(job, job.result, job.fps_out, self.metrics, sound=sound, store=self.store)
        # The DiT's input is the conditioning; each later stage's is the stage before's output.
        inbox: asyncio.Queue[Any] = asyncio.Queue()
        for chunk in [*outputs["text-encoder"], *(outputs[VAE_ENCODE] if encode_images else [])]:
            inbox.put_nowait(chunk)
        inbox.put_nowait(END)
        relayed = stages[stages.index("dit") :]
        async with asyncio.TaskGroup() as group:
            for position, stage in enumerate(relayed):
                outbox: asyncio.Queue[Any] | None = asyncio.Queue() if position < len(relayed) - 1 else None
                if stage in outputs and outbox is not None:  # finished before a retry or a restart
                    for chunk in outputs[stage]:
                        outbox.put_nowait(chunk)
                    outbox.put_nowait(END)
                else:
                    group.create_task(self._relay(job, route, stage, inbox, outbox, publisher))
                if outbox is not None:  # None after the last stage only
                    inbox = outbox

    async def _relay(
        self,
        job: Job,
        route: ModelRoute,
        stage: str,
        inbox: asyncio.Queue,
        outbox: asyncio.Queue | None,
        publisher: ResultPublisher,
    ) -> None:
        """Runs one stage call: its input from `inbox`, its output on to `outbox`, or, from the last stage of the
        job's chain, to the result. A stage in KEPT_OUTPUTS has its output kept once it is all sent."""
        kept: list[tensor_pb2.TensorChunk] | None = [] if stage in KEPT_OUTPUTS else None

        async def emit(chunk: tensor_pb2.TensorChunk) -> None:
            if kept is not None:
                kept.append(chunk)
            if outbox is not None:
                outbox.put_nowait(chunk)
            else:
                await publisher.publish(chunk)

        if stage == "vae":  # its sound goes straight to the result, past the interpolator
            await self.calls.decode(job, route, inbox, emit, publisher.publish_audio)
        else:
            stage_calls = {"dit": self.calls.denoise, "interp": self.calls.interpolate}
            await stage_calls[stage](job, route, inbox, emit)
        if outbox is not None:
            outbox.put_nowait(END)  # first, so that the next stage does not wait for the store
        if kept is not None:
            await self.calls.keep_output(job, stage, kept)
