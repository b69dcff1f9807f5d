"""A request's denoising as steps: a run that advances one step at a time, and its state as data.

A family whose loop is written as steps (`StepDenoiser`: `begin` makes a `DenoiseRun`, `step` advances several
runs by one step each, one transformer pass per branch for all of them) lets the DiT stage schedule at the step:
yield a request at a step boundary and continue it later or on another replica (`DenoiseState`), checkpoint it
every K steps, and run requests of different step counts and timesteps in one continuous batch.

Rules a reader needs:
- **Exact.** A run resumed from its state continues bit for bit as the uninterrupted run: the state holds the
  latents in float32 and every attribute the scheduler's `step` changes (`SCHEDULER_STEP_STATE`: UniPC's
  multistep history `model_outputs`, `timestep_list`, `last_sample`, `lower_order_nums`, `this_order`, and the
  step index of both). The schedule itself (`timesteps`, `sigmas`) is rebuilt by `set_timesteps`, which is
  deterministic. A scheduler class not in the table, or one that draws noise during its steps (flow-matching
  Euler's `stochastic_sampling`), makes runs that cannot be exported (`exportable` is False): they run to their end.
- **No RNG.** The families' loops draw all their noise before the first step (the seed's generator); the schedulers
  above draw none while stepping, so no generator state needs to travel.
- **Bound to its request.** A state carries a digest of everything that decides the trajectory (`request_digest`:
  the request's sampling fields, its adapters and a hash of its conditioning tensors); importing it for another
  request is refused. A request with a step cache is never exported: the cache's decisions live in hooks on the
  model and depend on the passes before them.
- **Safe to read.** `state_from_bytes` reads with `torch.load(weights_only=True)` (tensors, lists, numbers only; no
  code runs), bounded in bytes, and checks every tensor's shape against the request's latents.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeGuard, TypeVar

import torch

from stagekit.denoise import DenoiseSpec
from stagekit.errors import RequestError

# Per scheduler class, the attributes its `step` changes: what a state carries besides the latents.
SCHEDULER_STEP_STATE = {
    "UniPCMultistepScheduler": (
        "model_outputs",
        "timestep_list",
        "last_sample",
        "lower_order_nums",
        "this_order",
        "_step_index",
    ),
    "FlowMatchEulerDiscreteScheduler": ("_step_index",),
}
# The name a state travels under on the wire (a UINT8 tensor of its bytes).
STATE_TENSOR = "denoise_state"
STATE_FORMAT = 1


def scheduler_exportable(scheduler: object) -> bool:
    """Whether a run with this scheduler can be exported: its class is known and it draws no noise in `step`."""
    if type(scheduler).__name__ not in SCHEDULER_STEP_STATE:
        return False
    config = getattr(scheduler, "config", {})
    return not bool(getattr(config, "stochastic_sampling", False))


def scheduler_state(scheduler: object) -> dict[str, Any]:
    """The scheduler's step state (SCHEDULER_STEP_STATE), tensors cloned to the CPU."""

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        if isinstance(value, list):
            return [copy(item) for item in value]
        return value

    return {name: copy(getattr(scheduler, name, None)) for name in SCHEDULER_STEP_STATE[type(scheduler).__name__]}


def restore_scheduler(scheduler: object, state: dict[str, Any], device: torch.device) -> None:
    """Puts a step state back on a scheduler whose `set_timesteps` has run."""

    def place(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, list):
            return [place(item) for item in value]
        return value

    expected = SCHEDULER_STEP_STATE[type(scheduler).__name__]
    if sorted(state) != sorted(expected):
        raise RequestError(f"denoise_state: scheduler state has {sorted(state)}; expected {sorted(expected)}")
    for name, value in state.items():
        setattr(scheduler, name, place(value))


def request_digest(spec: DenoiseSpec, conditioning: dict[str, torch.Tensor], scheduler_class: str) -> str:
    """SHA-256 of what decides a request's trajectory: its sampling fields, adapters, scheduler and conditioning."""
    digest = hashlib.sha256()
    fields = (
        spec.height,
        spec.width,
        spec.num_frames,
        spec.num_inference_steps,
        repr(spec.guidance_scale),
        spec.seed,
        spec.image_roles,
        spec.image_sizes,
        spec.loras,
        repr(spec.embedded_guidance_scale),
        repr(spec.cfg_threshold),
        repr(spec.fps),
        scheduler_class,
    )
    digest.update(repr(fields).encode())
    for name in sorted(conditioning):
        tensor = conditioning[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


@dataclass
class DenoiseState:
    """A request's denoising at a step boundary: `step` of `total` steps done, the latents after them, and the
    scheduler's step state; `digest` names the request (`request_digest`)."""

    step: int
    total: int
    latents: torch.Tensor
    scheduler: dict[str, Any]
    digest: str

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(
            {
                "format": STATE_FORMAT,
                "step": self.step,
                "total": self.total,
                "latents": self.latents.detach().to("cpu", torch.float32),
                "scheduler": self.scheduler,
                "digest": self.digest,
            },
            buffer,
        )
        return buffer.getvalue()


def max_state_bytes(latent_shape: tuple[int, ...], history: int = 4) -> int:
    """The most bytes a state of latents of this shape may take: the latents and `history` more tensors of their
    size (UniPC keeps its solver order's model outputs and the last sample), plus 1 MiB for the rest."""
    return 4 * math.prod(latent_shape) * (1 + history) + (1 << 20)


def state_from_bytes(data: bytes, latent_shape: tuple[int, ...], digest: str) -> DenoiseState:
    """Reads a state sent for a request whose latents have `latent_shape` and whose digest is `digest`; raises
    RequestError naming what is wrong (size, format, another request's state, shapes, a step out of range)."""
    limit = max_state_bytes(latent_shape)
    if len(data) > limit:
        raise RequestError(f"denoise_state: {len(data)} bytes; at most {limit} for this request's latents")
    try:
        raw = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: torch says what it found
        raise RequestError(f"denoise_state: not a denoising state ({type(error).__name__})") from None
    if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT:
        raise RequestError(f"denoise_state: not a state of format {STATE_FORMAT}")
    if raw.get("digest") != digest:
        raise RequestError("denoise_state: made for another request (its sampling fields or conditioning differ)")
    step, total, latents = raw.get("step"), raw.get("total"), raw.get("latents")
    if not isinstance(step, int) or not isinstance(total, int) or not 0 < step < total:
        raise RequestError(f"denoise_state: step {step} of {total}; a state is taken between the first and last step")
    if not isinstance(latents, torch.Tensor) or tuple(latents.shape) != tuple(latent_shape):
        shape = list(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise RequestError(f"denoise_state: latents {shape}; expected {list(latent_shape)}")
    if latents.dtype != torch.float32 or not bool(torch.isfinite(latents).all()):
        raise RequestError("denoise_state: latents must be finite float32")
    scheduler = raw.get("scheduler")
    if not isinstance(scheduler, dict):
        raise RequestError("denoise_state: no scheduler state")
    for name, value in scheduler.items():
        for tensor in value if isinstance(value, list) else [value]:
            if isinstance(tensor, torch.Tensor) and tensor.numel() > 1 and tuple(tensor.shape) != tuple(latent_shape):
                raise RequestError(f"denoise_state: scheduler '{name}' has shape {list(tensor.shape)}")
    return DenoiseState(step=step, total=total, latents=latents, scheduler=scheduler, digest=digest)


@dataclass
class DenoiseRun:
    """One request being denoised step by step: what every family's run holds. A family's `begin` makes it
    (subclasses add the request's embeddings and the like); `step` advances it."""

    spec: DenoiseSpec
    latents: torch.Tensor
    scheduler: Any
    timesteps: torch.Tensor
    digest: str
    step_index: int = 0

    @property
    def total(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= self.total

    @property
    def exportable(self) -> bool:
        """Whether this run's state can be taken now: between its first and last step, its scheduler known, and
        no step cache (which keeps its own state in hooks on the model)."""
        return 0 < self.step_index < self.total and not self.spec.cache.enabled and scheduler_exportable(self.scheduler)

    def export(self) -> DenoiseState:
        """The run's state now; only when `exportable`."""
        if not self.exportable:
            raise ValueError(f"run at step {self.step_index} of {self.total} cannot be exported")
        return DenoiseState(
            step=self.step_index,
            total=self.total,
            latents=self.latents.detach().to("cpu", torch.float32, copy=True),
            scheduler=scheduler_state(self.scheduler),
            digest=self.digest,
        )

    def restore(self, state: DenoiseState) -> None:
        """Continues from `state` (already checked against this request by `state_from_bytes`)."""
        if state.total != self.total:
            raise RequestError(f"denoise_state: {state.total} steps; this request runs {self.total}")
        if not scheduler_exportable(self.scheduler):
            raise RequestError(f"denoise_state: the {type(self.scheduler).__name__} cannot resume from a state")
        restore_scheduler(self.scheduler, state.scheduler, self.latents.device)
        self.latents = state.latents.to(self.latents.device, self.latents.dtype)
        self.step_index = state.step


class StepDenoiser(Protocol):
    """A denoiser whose loop is written as steps (see the module's docstring)."""

    runs_steps: ClassVar[bool]

    def begin(
        self, spec: DenoiseSpec, conditioning: dict[str, torch.Tensor], state: DenoiseState | None = None
    ) -> DenoiseRun:
        """A run of the request at step 0, or continued from `state`."""
        ...

    def step(self, runs: list[DenoiseRun]) -> None:
        """Advances each run (none of them done) by one step, the runs sharing each transformer pass. Runs of one
        call share their guidance branches (all with CFG or none) and latent shape; their timesteps may differ."""
        ...

    def result(self, run: DenoiseRun) -> torch.Tensor:
        """A finished run's latents as `denoise` returns them (float32 [1, C, T, h, w]: a family that packs its
        latents into tokens while it steps unpacks them here)."""
        ...


def runs_steps(denoiser: object) -> TypeGuard[StepDenoiser]:
    """Whether `denoiser` is a StepDenoiser: its class says so (`runs_steps = True`; a subclass whose loop
    differs says False)."""
    return getattr(type(denoiser), "runs_steps", False) is True


RunT = TypeVar("RunT", bound=DenoiseRun)


def run_to_end(
    step: Callable[[list[RunT]], None],
    run: RunT,
    on_step: Callable[[int, int], None],
    before_step: Callable[[RunT], None],
) -> torch.Tensor:
    """Runs `run` to its last step with `step` (its denoiser's): `before_step(run)` first each time (which may raise
    to stop), then one step, then on_step(step, total). Returns the latents."""
    while not run.done:
        before_step(run)
        step([run])
        on_step(run.step_index, run.total)
    return run.latents
