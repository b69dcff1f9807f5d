"""What every family's denoising loop shares: the request's arguments, the stage's view of a denoiser, and
the two pieces of a step that do not depend on the model (agreeing to go on, running the guidance branches).

A family's denoiser (families/<family>/denoise.py) follows its diffusers pipeline step for step, so that
its latents equal the pipeline's for the same arguments. The stage constructs it with `make_denoiser`, which
asks the checkpoint's family in the registry which class that is, and runs each request with
`denoise_request`, which applies the request's LoRA adapters (dit_svc/lora.py) and step cache
(dit_svc/step_cache.py) around the loop and takes both off after it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from dit_svc.compile import compile_repeated_blocks
from dit_svc.lora import AdapterCache
from dit_svc.model_options import ModelOptions
from dit_svc.parallel import ParallelConfig
from dit_svc.parallel.cfg import agree_on_members, agree_to_continue, cfg_parallel_predictions
from dit_svc.step_cache import CachePasses, CacheSetting, CacheSpec, GroupConsensus, step_cache
from services.checkpoint import read_checkpoint
from services.errors import NotFoundError
from services.stage import Cancelled

logger = logging.getLogger(__name__)


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

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self.guidance_scale > 1.0


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

    def image_tensor_shape(self, name: str, spec: DenoiseSpec) -> tuple[int | None, ...] | None:
        """The shape of a conditioning tensor made from the request's input images (families that take
        images; see TensorSlot.image), None in place of a token count; None when the request cannot take it."""
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


def make_denoiser(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelConfig | None = None,
    options: ModelOptions | None = None,
    load_threads: int = 4,
) -> Denoiser:
    """The checkpoint's family's denoiser; every rank of a DiT group builds its own with this.

    With `options.compile` its blocks are compiled last (dit_svc/compile.py): the constructor has applied
    quantization, offload and the parallel plan by then.
    """
    denoiser_class = read_checkpoint(model_dir).traits.load("denoiser")
    denoiser = denoiser_class(model_dir, device, dtype, parallel=parallel, options=options, load_threads=load_threads)
    if options is not None and options.compile:
        started = time.perf_counter()
        blocks = compile_repeated_blocks(denoiser.experts)
        logger.info(
            "regional compilation: %d blocks set up in %.3f s; each compiles on its first request",
            blocks,
            time.perf_counter() - started,
        )
    return denoiser


def make_adapter_cache(denoiser: Denoiser, options: ModelOptions | None, load_threads: int = 4) -> AdapterCache | None:
    """The rank's cache of per-request adapters, on the pipeline's `transformer` (where diffusers'
    load_lora_weights puts them); None when the stage has no --lora-dir."""
    if options is None or not options.lora.per_request:
        return None
    return AdapterCache(denoiser.transformer, options.lora, load_threads)


def adapters_applied(adapters: AdapterCache | None, spec: DenoiseSpec) -> contextlib.AbstractContextManager:
    """The request's adapters on the transformer while the loop runs (nothing for a request without any)."""
    if adapters is None:
        if spec.loras:  # the servicer refuses these first; a direct caller gets the same answer
            raise NotFoundError(f"lora '{spec.loras[0][0]}': the DiT serves no adapters per request (no --lora-dir)")
        return contextlib.nullcontext()
    return adapters.applied(spec.loras)


def denoise_request(
    denoiser: Denoiser,
    spec: DenoiseSpec,
    conditioning: dict[str, torch.Tensor],
    on_step: Callable[[int, int], None],
    cancelled: Callable[[], bool],
    mag_ratios: dict[str, list[float]] | None = None,
    calibration: dict[str, dict[str, list[float]]] | None = None,
    adapters: AdapterCache | None = None,
) -> tuple[torch.Tensor, CachePasses]:
    """Runs the request on this rank with its adapters and step cache; returns the latents and the request's
    passes.

    Every rank of a group calls it with the same request. The passes count every guidance branch of every
    step once: under CFG-parallel each rank ran one branch, so the counts are summed over the CFG group.
    """
    setting = CacheSetting(
        num_inference_steps=spec.num_inference_steps,
        height=spec.height,
        width=spec.width,
        image_to_video=bool(spec.image_roles),
        mag_ratios=mag_ratios,
        calibration=calibration,
    )
    consensus = GroupConsensus() if denoiser.parallel is not None else None
    with adapters_applied(adapters, spec), step_cache(denoiser.experts, spec.cache, setting, consensus) as passes:
        latents = denoiser.denoise(spec, conditioning, on_step, cancelled)
    branches = 2 if spec.do_classifier_free_guidance else 1
    if not spec.cache.enabled:
        return latents, CachePasses(run=spec.num_inference_steps * branches)
    if denoiser.cfg_group is not None and branches == 2:
        counts = torch.tensor([passes.run, passes.skipped], dtype=torch.int64, device=latents.device)
        torch.distributed.all_reduce(counts, group=denoiser.cfg_group)
        passes = CachePasses(run=int(counts[0]), skipped=int(counts[1]))
    return latents, passes


def batch_key(spec: DenoiseSpec, conditioning: dict[str, torch.Tensor]) -> tuple | None:
    """Requests with the same key can be denoised as one batch: the same batch group (one tenant's, when the
    orchestrator keeps batches to one tenant), latent shape, schedule and guidance branches, the same LoRA
    adapters at the same scales, and conditioning tensors of the same shapes. Seeds, prompts and guidance scales
    may differ.
    None: the request runs alone, as one with a step cache does (its skip decisions are its own)."""
    if spec.cache.enabled:
        return None
    shapes = tuple(sorted((name, tuple(tensor.shape), str(tensor.dtype)) for name, tensor in conditioning.items()))
    return (
        spec.batch_group,
        spec.height,
        spec.width,
        spec.num_frames,
        spec.num_inference_steps,
        spec.do_classifier_free_guidance,
        spec.image_roles,
        spec.image_sizes,
        spec.loras,
        shapes,
    )


def denoise_batch_request(
    denoiser: BatchDenoiser,
    specs: list[DenoiseSpec],
    conditionings: list[dict[str, torch.Tensor]],
    on_step: Callable[[int, int, int], None],
    wanted: Callable[[], list[bool]],
    adapters: AdapterCache | None = None,
) -> list[tuple[torch.Tensor | None, CachePasses]]:
    """Runs a batch of requests of one `batch_key` (so one set of adapters) on this rank; each member's latents
    (None once dropped) and passes. Every rank of a group calls it with the same batch."""
    with adapters_applied(adapters, specs[0]):
        results = denoiser.denoise_batch(specs, conditionings, on_step, wanted)
    branches = 2 if specs[0].do_classifier_free_guidance else 1
    passes = [CachePasses(run=spec.num_inference_steps * branches) for spec in specs]
    return list(zip(results, passes, strict=True))


@dataclass(frozen=True)
class OneRank:
    """A stage's requests on one rank, through the same two calls as a DenoiserGroup's (dit_svc/group.py)."""

    denoiser: Denoiser
    mag_ratios: dict[str, list[float]] | None = None
    adapters: AdapterCache | None = None

    def denoise_request(self, spec, conditioning, on_step, cancelled) -> tuple[torch.Tensor, CachePasses]:
        return denoise_request(
            self.denoiser, spec, conditioning, on_step, cancelled, mag_ratios=self.mag_ratios, adapters=self.adapters
        )

    def denoise_batch_request(self, specs, conditionings, on_step, wanted) -> list:
        return denoise_batch_request(self.denoiser, specs, conditionings, on_step, wanted, adapters=self.adapters)


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
