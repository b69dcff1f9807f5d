"""What a family's denoiser implements and uses, and what the DiT stage asks of it.

`DenoiseSpec` is one request's arguments (its step cache a `CacheSpec`); `Denoiser` and `BatchDenoiser` are
the stage's view of a family's denoiser (families/<family>/denoise.py), which follows its diffusers pipeline
step for step so that its latents equal the pipeline's for the same arguments. The helpers are the pieces of
a step that do not depend on the model: agreeing to go on (`stop_if_cancelled`, `members_still_wanted`, rank
0's answer holds for a group), running the guidance branches (`guidance_predictions`, one per CFG rank group
under CFG-parallel), and dropping a batch member's rows from the scheduler (`keep_batch_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable

import torch

from stagekit.errors import Cancelled
from stagekit.parallel import ParallelConfig
from stagekit.parallel.cfg import agree_on_members, agree_to_continue, cfg_parallel_predictions


@dataclass(frozen=True)
class CacheSpec:
    """A request's step cache: a method of families.base.CACHE_METHODS and its threshold (higher skips more)."""

    method: str = "none"
    threshold: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True)
class DenoiseSpec:
    """One request's denoising arguments, already validated."""

    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    # Roles of the input images whose tensors condition the request (families/base.py IMAGE_ROLES), in the
    # model's role order, and the decoded size (width, height) of each, () when the caller sent none.
    image_roles: tuple[str, ...] = ()
    image_sizes: tuple[tuple[int, int], ...] = ()
    # The step cache of the request (its method "none" when it runs every pass).
    cache: CacheSpec = CacheSpec()
    # The request's LoRA adapters as (name, scale), in the order it named them.
    loras: tuple[tuple[str, float], ...] = ()
    # Requests of different batch groups never share a batch (DenoiseParams.batch_group: one per tenant when the
    # orchestrator keeps batches to one tenant); opaque to the stage.
    batch_group: bytes = b""
    # The guidance a guidance-distilled transformer takes as an input (FLUX.1-dev's embedding); None otherwise.
    embedded_guidance_scale: float | None = None
    # guidance_scale above this runs CFG: the family's `cfg_threshold` (families/base.py), 0 for Z-Image.
    cfg_threshold: float = 1.0
    # The video's frames per second, for a family whose transformer or sound depends on it (LTX-2); 0: the
    # family's default.
    fps: float = 0.0

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self.guidance_scale > self.cfg_threshold


class Denoiser(Protocol):
    """What the DiT stage asks of a family's denoiser."""

    transformer: torch.nn.Module
    # The rank group's layout, None on one rank; the process group of the CFG branches, None without CFG-parallel.
    parallel: ParallelConfig | None
    cfg_group: torch.distributed.ProcessGroup | None

    @property
    def experts(self) -> list[torch.nn.Module]:
        """Every transformer the loop runs (Wan2.2 A14B has two), as their stage reports them."""
        ...

    @property
    def text_dim(self) -> int:
        """The width of the embeddings the transformer takes."""
        ...

    def denoise(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> torch.Tensor:
        """Runs every step and returns float32 latents [1, C, T, h, w]; on_step(step, total) after each.

        `conditioning` holds the tensors the family declares (families/base.py TensorSlot), by name.
        """
        ...


class PooledTextDenoiser(Denoiser, Protocol):
    """The denoiser of a family that takes one pooled vector per text beside its sequence (a TensorSlot of kind
    "pooled": FLUX's CLIP output)."""

    @property
    def pooled_dim(self) -> int:
        """The width of the pooled vectors the transformer takes."""
        ...


class ImageDenoiser(Denoiser, Protocol):
    """The denoiser of a family that takes input images (its `images.roles` are not empty)."""

    def image_tensor_shape(self, name: str, spec: DenoiseSpec) -> tuple[int | None, ...] | None:
        """The shape of a conditioning tensor made from the request's input images (see TensorSlot.image),
        None in place of a token count; None when the request cannot take it."""
        ...


class BatchDenoiser(Denoiser, Protocol):
    """A denoiser that also runs several requests of one `batch_key` as one batch (the family's `batching`
    feature): each request's latents equal its own run's."""

    def denoise_batch(
        self,
        specs: list[DenoiseSpec],
        conditionings: list[dict[str, torch.Tensor]],
        on_step: Callable[[int, int, int], None],
        wanted: Callable[[], list[bool]],
    ) -> list[torch.Tensor | None]:
        """The latents of each request, None for those dropped; on_step(member, step, total) after each step.

        Before each step `wanted()` says which members still want their result (see `members_still_wanted`);
        a member dropped once is not denoised further.
        """
        ...


@runtime_checkable
class AudioDenoiser(Denoiser, Protocol):
    """The denoiser of a family that makes sound with its video (LTX-2): one loop denoises both, and the DiT stage
    sends the audio latents after the video's ("audio_latents", for the VAE stage's audio decoder). Such a family
    runs one request at a time (its `batching` feature is refused)."""

    def denoise_av(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs every step; returns float32 (video latents [1, C, T, h, w], audio latents [1, Ca, A, M]), both as
        the VAE stage decodes them; on_step(step, total) after each, `cancelled` checked before each."""
        ...


def makes_audio(denoiser: object) -> TypeGuard[AudioDenoiser]:
    """Whether `denoiser` is an AudioDenoiser (its family makes sound with its video)."""
    return callable(getattr(denoiser, "denoise_av", None))


def takes_images(denoiser: Denoiser) -> TypeGuard[ImageDenoiser]:
    """Whether `denoiser` is an ImageDenoiser (its family takes input images)."""
    return callable(getattr(denoiser, "image_tensor_shape", None))


def runs_batches(denoiser: Denoiser) -> TypeGuard[BatchDenoiser]:
    """Whether `denoiser` is a BatchDenoiser (its family has the `batching` feature)."""
    return callable(getattr(denoiser, "denoise_batch", None))


def members_still_wanted(
    wanted: Callable[[], list[bool]], parallel: ParallelConfig | None, device: torch.device
) -> list[bool]:
    """Before a batch step: which members still want their result; in a group, rank 0's answer holds for all."""
    keep = wanted()
    return agree_on_members(keep, device) if parallel is not None else keep


# Per scheduler class, its attributes that hold one row per request of the batch (the multistep solvers'
# history); the others hold the schedule, shared by every row.
SCHEDULER_BATCH_STATE = {
    "UniPCMultistepScheduler": ("model_outputs", "last_sample"),
    "FlowMatchEulerDiscreteScheduler": (),
}


def keep_batch_rows(scheduler: object, rows: list[int]) -> bool:
    """Drops every other row from the scheduler's per-request state; False for a scheduler whose state is not
    known here (the caller then keeps denoising the dropped rows and discards them at the end)."""
    attributes = SCHEDULER_BATCH_STATE.get(type(scheduler).__name__)
    if attributes is None:
        return False

    def keep(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.index_select(0, torch.tensor(rows, device=tensor.device))

    for name in attributes:
        value = getattr(scheduler, name)
        setattr(scheduler, name, [keep(item) for item in value] if isinstance(value, list) else keep(value))
    return True


class BatchRows:
    """Which request each row of a batch being denoised belongs to, kept between steps.

    Before each step `before_step` asks which members still want their result: the rows of those that left are
    dropped from the scheduler's per-row state and `before_step` returns the rows to keep, which the caller
    slices from its own per-row tensors (latents, embeddings, scales). Where the scheduler's state cannot be
    sliced, the leaving rows stay in the batch and their results are discarded. After the last step `results`
    gives each request its latents (None for those that left).
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.members = list(range(count))  # the request of each row
        self.dropped: set[int] = set()  # members still in the rows but no longer wanted

    def before_step(
        self, wanted: Callable[[], list[bool]], parallel: ParallelConfig | None, device: torch.device, scheduler: object
    ) -> list[int] | None:
        """The rows to keep when some leave now (None when the rows stay as they are); raises Cancelled when no
        member is left. In a group, rank 0's answer holds for every rank."""
        keep = members_still_wanted(wanted, parallel, device)
        leaving = [member for member in self.members if not keep[member] and member not in self.dropped]
        rows = None
        if leaving:
            kept = [row for row, member in enumerate(self.members) if keep[member]]
            if kept and keep_batch_rows(scheduler, kept):
                self.members = [self.members[row] for row in kept]
                rows = kept
            else:
                self.dropped.update(leaving)
        if all(member in self.dropped for member in self.members):
            raise Cancelled()
        return rows

    def stepped(self, on_step: Callable[[int, int, int], None], step: int, total: int) -> None:
        """Tells every member still wanted that `step` of `total` is done."""
        for member in self.members:
            if member not in self.dropped:
                on_step(member, step, total)

    def results(self, latents: torch.Tensor) -> list[torch.Tensor | None]:
        """Each request's row of `latents` (kept 1 long), None for those that left."""
        results: list[torch.Tensor | None] = [None] * self.count
        for row, member in enumerate(self.members):
            if member not in self.dropped:
                results[member] = latents[row : row + 1]
        return results


def guide_rows(cond: torch.Tensor, uncond: torch.Tensor, scales: list[float]) -> torch.Tensor:
    """A batch's CFG, `uncond + scale * (cond - uncond)` row by row with each request's scale as a Python number,
    as the pipelines combine one request's (a tensor of scales would round them to the transformer's dtype)."""
    return torch.cat(
        [
            uncond[row : row + 1] + scale * (cond[row : row + 1] - uncond[row : row + 1])
            for row, scale in enumerate(scales)
        ]
    )


def stop_if_cancelled(cancelled: Callable[[], bool], parallel: ParallelConfig | None, device: torch.device) -> None:
    """Raises Cancelled before a step when the request is cancelled; in a group, rank 0's answer holds for all."""
    keep_going = not cancelled()
    if parallel is not None:
        keep_going = agree_to_continue(keep_going, device)
    if not keep_going:
        raise Cancelled()


def guidance_predictions(
    predict: Callable[[object, str], torch.Tensor],
    positive: object,
    negative: object,
    cfg_group: torch.distributed.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cond, uncond) predictions of a CFG step: both on this rank, or one branch per CFG rank group.

    `predict(conditioning, branch)` runs the transformer; `branch` is "cond" or "uncond".
    """
    if cfg_group is not None:
        return cfg_parallel_predictions(predict, positive, negative, cfg_group)
    return predict(positive, "cond"), predict(negative, "uncond")
