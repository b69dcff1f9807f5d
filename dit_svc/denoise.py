"""How the DiT stage builds a family's denoiser and runs its requests on one rank.

The stage constructs the checkpoint's denoiser with `make_denoiser`, which asks the checkpoint's family in the
registry which class that is, and runs each request with `denoise_request` (or a batch of one `batch_key` with
`denoise_batch_request`), which applies the request's LoRA adapters (dit_svc/lora/) and step cache
(dit_svc/step_cache/) around the family's loop and takes both off after it. What a denoiser is, and the
request's arguments, are stagekit/denoise.py's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dit_svc.compile import compile_repeated_blocks
from dit_svc.lora import AdapterCache
from dit_svc.model_options import ModelOptions
from dit_svc.step_cache import CachePasses, CacheSetting, GroupConsensus, step_cache
from services.checkpoint import read_checkpoint
from stagekit.denoise import AudioDenoiser, Denoiser, DenoiseSpec, makes_audio, runs_batches
from stagekit.errors import NotFoundError

if TYPE_CHECKING:
    from dit_svc.config import DenoiserBuild

logger = logging.getLogger(__name__)


def make_denoiser(
    model_dir: str | Path, device: torch.device, dtype: torch.dtype, build: DenoiserBuild | None = None
) -> Denoiser:
    """The checkpoint's family's denoiser, built as `build` says (dit_svc/config.py; one rank, no options when
    None); every rank of a DiT group builds its own with this.

    With `options.compile` its blocks are compiled last (dit_svc/compile.py): the constructor has applied
    quantization, offload and the parallel plan by then.
    """
    denoiser_class = read_checkpoint(model_dir).traits.load("denoiser")
    if build is None:
        denoiser = denoiser_class(model_dir, device, dtype)
    else:
        denoiser = denoiser_class(
            model_dir,
            device,
            dtype,
            parallel=build.parallel,
            options=build.options,
            load_threads=build.load_threads,
        )
    if build is not None and build.options.compile:
        started = time.perf_counter()
        blocks = compile_repeated_blocks(denoiser.experts)
        logger.info(
            "regional compilation: %d blocks set up in %.3f s; each compiles on its first request",
            blocks,
            time.perf_counter() - started,
        )
    return denoiser


def make_adapter_cache(
    denoiser: Denoiser, options: ModelOptions | None, *, load_threads: int = 4
) -> AdapterCache | None:
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


def denoise_av_request(
    denoiser: AudioDenoiser,
    spec: DenoiseSpec,
    conditioning: dict[str, torch.Tensor],
    on_step: Callable[[int, int], None],
    cancelled: Callable[[], bool],
    adapters: AdapterCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor, CachePasses]:
    """A request of a family that makes sound (stagekit.denoise.AudioDenoiser) on this rank: its video latents, its
    audio latents and its passes. Every rank of a group calls it with the same request (dit_svc/group.py). Such a
    family has no step cache or adapters (its features refuse them at startup and the servicer refuses a request
    naming them); a direct caller naming adapters without a cache of them is refused as in `denoise_request`."""
    if spec.cache.enabled:
        raise ValueError(f"cache: {spec.cache.method} is not offered for {type(denoiser).__name__}")
    with adapters_applied(adapters, spec):
        video, audio = denoiser.denoise_av(spec, conditioning, on_step, cancelled)
    branches = 2 if spec.do_classifier_free_guidance else 1
    return video, audio, CachePasses(run=spec.num_inference_steps * branches)


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
    denoiser: Denoiser,
    specs: list[DenoiseSpec],
    conditionings: list[dict[str, torch.Tensor]],
    on_step: Callable[[int, int, int], None],
    wanted: Callable[[], list[bool]],
    adapters: AdapterCache | None = None,
) -> list[tuple[torch.Tensor | None, CachePasses]]:
    """Runs a batch of requests of one `batch_key` (so one set of adapters) on this rank; each member's latents
    (None once dropped) and passes. Every rank of a group calls it with the same batch."""
    # The stage batches requests only where the family has the `batching` feature.
    assert runs_batches(denoiser), f"{type(denoiser).__name__} does not run batches"
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

    def denoise_request(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> tuple[torch.Tensor, CachePasses]:
        return denoise_request(
            self.denoiser, spec, conditioning, on_step, cancelled, mag_ratios=self.mag_ratios, adapters=self.adapters
        )

    def denoise_av_request(
        self,
        spec: DenoiseSpec,
        conditioning: dict[str, torch.Tensor],
        on_step: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> tuple[torch.Tensor, torch.Tensor, CachePasses]:
        """`denoise_av_request` on this rank's denoiser, which must make sound (`stagekit.denoise.makes_audio`)."""
        denoiser = self.denoiser
        assert makes_audio(denoiser), f"{type(denoiser).__name__} makes no sound"
        return denoise_av_request(denoiser, spec, conditioning, on_step, cancelled, adapters=self.adapters)

    def denoise_batch_request(
        self,
        specs: list[DenoiseSpec],
        conditionings: list[dict[str, torch.Tensor]],
        on_step: Callable[[int, int, int], None],
        wanted: Callable[[], list[bool]],
    ) -> list[tuple[torch.Tensor | None, CachePasses]]:
        return denoise_batch_request(self.denoiser, specs, conditionings, on_step, wanted, adapters=self.adapters)
