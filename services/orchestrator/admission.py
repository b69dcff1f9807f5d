"""The storage checks a new job passes before it is queued, and the request helpers they and the jobs use.

At admission the new job's result size (`result_bytes`) and its input images are
reserved against its tenant's `max_stored_bytes`: the job is refused
(`StorageRefused`, RESOURCE_EXHAUSTED naming max_stored_bytes, retry later) when
its tenant's queued and running jobs alone would leave no room for it, or
(`LimitExceeded`, PERMISSION_DENIED) when it alone is larger than the quota; the
tenant's oldest finished jobs are pruned afterwards to make room
(services/orchestrator/pruning.py). New jobs are refused (RESOURCE_EXHAUSTED,
retry later) while the state volume has less than `min_free` space left.

A tenant's limits are its quotas in the tenants file, else the orchestrator's
defaults; a tenant no longer in the file (its jobs are still stored) gets the
defaults. Its queue limits in the scheduler (`queue_limits`) are its quotas'
max_queued_jobs and max_running_jobs, and those of its model_quotas per model.
A job never holds its input images' bytes (`without_image_bytes`).
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

from services.encoding import AUDIO_NONE
from services.orchestrator.scheduler import AdmissionRefused, FairScheduler, JobLimits, TenantLimits
from services.orchestrator.store import JobStore, MinFree, StoreFull
from services.orchestrator.tenants import LimitExceeded, Tenant, output_frames
from stagediff.v1 import generation_pb2

if TYPE_CHECKING:  # job.py imports without_image_bytes
    from services.orchestrator.job import JobTable

# When a refused job may try again after the state volume was found too full.
DISK_FULL_RETRY_AFTER_S = 60.0
# The sound a result with sound is reserved at, whatever its model's (LTX-2: 24 kHz stereo): bytes are not
# known at admission for a job's model, only that it has sound.
AUDIO_RESERVE_RATE = 48_000
AUDIO_RESERVE_CHANNELS = 2


class StorageRefused(AdmissionRefused):
    """A job refused for space: the state volume is nearly full (scope "disk"), or its tenant's running and
    queued jobs already hold its max_stored_bytes (scope "storage"). RESOURCE_EXHAUSTED with a retry-after."""


def queue_limits(tenant: Tenant | None) -> TenantLimits:
    """The scheduler's limits for a tenant's jobs (none for a tenant no longer in the file): its max_queued_jobs
    and max_running_jobs over all its jobs, and on each model those its model_quotas set there."""
    if tenant is None:
        return TenantLimits()
    per_model = {
        model: JobLimits(max_queued=quotas.max_queued_jobs, max_running=quotas.max_running_jobs)
        for model, quotas in tenant.model_quotas.items()
        if quotas.max_queued_jobs is not None or quotas.max_running_jobs is not None
    }
    quotas = tenant.quotas
    return TenantLimits(max_queued=quotas.max_queued_jobs, max_running=quotas.max_running_jobs, per_model=per_model)


def result_shape(request: generation_pb2.GenerateRequest) -> tuple[int, int, int, int]:
    """The final frames' shape [F, H, W, 3] of a completed request (F after interpolation)."""
    return (output_frames(request), request.height, request.width, 3)


def without_image_bytes(request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
    """`request` without its images' bytes (their roles, digests and sizes kept); itself when it holds none.

    The copy is built field by field, never by CopyFrom and ClearField: protobuf (upb) keeps the bytes a
    message copied in its own memory until the message is freed, cleared or not, so a job would keep every
    input image it ever took.
    """
    if not any(image.data for image in request.images):
        return request
    cleared = generation_pb2.GenerateRequest()
    for descriptor, value in request.ListFields():
        if descriptor.name == "images":
            continue
        if descriptor.is_repeated:
            getattr(cleared, descriptor.name).extend(value)
        elif descriptor.message_type is not None:
            getattr(cleared, descriptor.name).CopyFrom(value)
        else:
            setattr(cleared, descriptor.name, value)
    for image in request.images:
        kept = cleared.images.add()
        for descriptor, value in image.ListFields():
            if descriptor.name != "data":
                setattr(kept, descriptor.name, value)
    return cleared


def has_sound(request: generation_pb2.GenerateRequest) -> bool:
    """Whether a completed request's result has sound (its model makes some and the request keeps it)."""
    return request.audio_codec not in ("", AUDIO_NONE)


def max_audio_samples(request: generation_pb2.GenerateRequest, sample_rate: int) -> int:
    """The most samples per channel a result's sound may have: the video's length (the VAE's frames at the
    request's fps; interpolation adds frames, never time) at `sample_rate`, with a quarter and a second to spare."""
    if sample_rate <= 0 or request.fps <= 0:
        return 0
    return math.ceil(request.num_frames / request.fps * sample_rate * 1.25) + sample_rate


def result_bytes(request: generation_pb2.GenerateRequest) -> int:
    """The bytes a job's result is reserved at admission: its raw frames, twice when an encoded result keeps them
    too (an encoded file is not larger than the frames it encodes, but for a few bytes of header), and its
    sound's float32 waveform at its bound (at AUDIO_RESERVE_RATE and _CHANNELS, above any served model's)."""
    frames, height, width, channels = result_shape(request)
    raw = frames * height * width * channels
    if has_sound(request):
        raw += max_audio_samples(request, AUDIO_RESERVE_RATE) * AUDIO_RESERVE_CHANNELS * 4
    return raw * 2 if request.keep_raw_frames else raw


class StorageLimits:
    """Each tenant's storage limits, what its unfinished jobs hold, and the checks that refuse a new job.

    `max_kept` finished jobs and `max_stored_bytes` (None: no limit) per tenant unless its quotas say
    otherwise, and `min_free` space kept free on the state volume.
    """

    def __init__(
        self,
        store: JobStore,
        scheduler: FairScheduler,
        table: JobTable,
        tenants: dict[str, Tenant],
        *,
        max_kept: int,
        max_stored_bytes: int | None,
        min_free: MinFree,
    ) -> None:
        self.store = store
        self.scheduler = scheduler
        self.table = table
        # Tenants by name, as last seen: shared with the manager, which updates it at each admission.
        self.tenants = tenants
        self.max_kept = max_kept
        self.max_stored_bytes = max_stored_bytes
        self.min_free = min_free

    @staticmethod
    def disk_full(tenant: str, error: StoreFull) -> StorageRefused:
        return StorageRefused(
            f"the orchestrator's state volume is full ({error}); retry later",
            retry_after_s=DISK_FULL_RETRY_AFTER_S,
            scope="disk",
            tenant=tenant,
        )

    def check_free_space(self, tenant: str) -> None:
        """Refuses new jobs while the state volume has less than `min_free` left."""
        free, total = self.store.free_bytes()
        keep = self.min_free.of(total)
        if free < keep:
            raise StorageRefused(
                f"the orchestrator's state volume has {free} bytes free, less than the {self.min_free} it keeps free "
                "(--min-free-bytes); retry later",
                retry_after_s=DISK_FULL_RETRY_AFTER_S,
                scope="disk",
                tenant=tenant,
            )

    async def check_stored_bytes(self, tenant: Tenant, needed: int) -> None:
        """Refuses a job that needs `needed` bytes (its result and input images) when they cannot fit the
        tenant's max_stored_bytes even after its finished jobs go. Admission checks a request's image bytes
        alone before it parses them; `submit` checks them with the result."""
        limit = self.limits(tenant.name)[1]
        if limit is None:
            return
        if needed > limit:
            raise LimitExceeded(
                tenant.name,
                "max_stored_bytes",
                needed,
                limit,
                f"output: the result and the input images take {needed} bytes, more than tenant "
                f"'{tenant.name}' may store (max_stored_bytes {limit})",
            )
        usage = await asyncio.to_thread(self.store.usage, tenant.name)
        held = usage.active + self.reserved_bytes(tenant.name)
        if held + needed > limit:
            raise StorageRefused(
                f"tenant '{tenant.name}' has {held} bytes in queued and running jobs; with this job's {needed} that "
                f"exceeds its max_stored_bytes of {limit}; retry when some have finished",
                retry_after_s=self.scheduler.retry_after(tenant.name),
                scope="storage",
                tenant=tenant.name,
            )

    def limits(self, name: str) -> tuple[int, int | None]:
        """(max kept finished jobs, max stored bytes) of a tenant: its quotas, else the orchestrator's defaults.

        A tenant no longer in the tenants file (its jobs are still stored) gets the defaults.
        """
        tenant = self.tenants.get(name)
        kept = tenant.quotas.max_kept_jobs if tenant is not None else None
        stored = tenant.quotas.max_stored_bytes if tenant is not None else None
        return (self.max_kept if kept is None else kept, self.max_stored_bytes if stored is None else stored)

    def reserved_bytes(self, tenant: str) -> int:
        """What the tenant's queued and running jobs will write as results (not yet in the store's sizes)."""
        return sum(
            result_bytes(job.request) for job in self.table.jobs.values() if job.tenant == tenant and not job.finished
        )
