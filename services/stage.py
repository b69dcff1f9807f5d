"""What the four stage services share: device choice, the compute thread, stage info, errors.

A stage runs its torch compute on one dedicated thread, so the asyncio event
loop keeps answering health checks, info calls and cancellations while a
request computes. Work that produces a stream (denoising steps, decoded frame
chunks) reports each item through `emit`, and the async handler forwards it as
soon as it is produced. Queued work runs by the calls' priority classes, the highest first
(services/stage_priority.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import torch

from services.checkpoint import CheckpointSpec
from services.component_identity import StageIdentity
from services.stage_priority import PriorityExecutor
from stagediff import __version__
from stagediff.tensor_codec import WireError
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from stagekit.errors import Cancelled, NotFoundError, RequestError, bounded

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' picks the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on accelerators and float32 on the CPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"--dtype {name}: allowed: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass
class _Failure:
    error: BaseException


_DONE = object()


class StageRuntime:
    """The stage's identity, its compute thread, and its info for GetStageInfo."""

    def __init__(
        self,
        stage: str,
        spec: CheckpointSpec | None,
        device: torch.device,
        dtype: torch.dtype,
        identity: StageIdentity | None = None,
    ) -> None:
        self.stage = stage
        # None for a stage started without a checkpoint (one that does not read it: the interpolator).
        self.spec = spec
        # The components held and the models served (services/component_identity.py); by default, the checkpoint's
        # model alone, its components not reported.
        self.identity = identity or StageIdentity({}, {}, (spec.model_id,) if spec is not None else ())
        self.device = device
        self.dtype = dtype
        # The compute thread, serving queued work by the calls' priority classes (services/stage_priority.py).
        self.executor = PriorityExecutor(thread_name_prefix=f"{stage}-compute")
        self.parameter_bytes: dict[str, int] = {}
        self.parallel_config: dict[str, str] = {}
        # Raised by a stage that cannot take the smallest sizes (a patch-parallel VAE needs rows for every rank).
        self.min_height = 0
        # The step caches the DiT offers and the one a request that names none gets (ModelLimits.cache_methods).
        self.cache_methods: list[stages_pb2.StepCache] = []
        self.default_cache: stages_pb2.StepCache | None = None
        # Threads that read safetensors shards while the stage loads (stagekit/weights/).
        self.load_threads = 4
        # Weights a request may name, served besides the checkpoint (StageInfo.weights_path).
        self.weights_path = ""
        # The DiT's LoRA adapters: those in its --lora-dir (listed afresh for each info), the most one request
        # applies, and those fused in at startup, which serve the checkpoint under another id (`served_model`).
        self.list_loras: Callable[[], list[stages_pb2.LoraInfo]] | None = None
        self.max_loras = 0
        self.lora_cache_bytes = 0  # the DiT's --lora-cache-bytes, when it serves adapters per request
        self.fused_loras: list[stages_pb2.LoraAdapter] = []
        self.served_model: str | None = None
        # The DiT's step scheduling (dit_svc/step_engine.py): whether it steps requests, and how many at once.
        self.step_scheduling = False
        self.step_slots = 0

    @property
    def checkpoint(self) -> CheckpointSpec:
        """The checkpoint of a stage that reads one (every stage but the interpolator)."""
        assert self.spec is not None, f"{self.stage}: started without a checkpoint"
        return self.spec

    @property
    def model_id(self) -> str:
        """The id this stage serves its model under: the checkpoint's, or the fused model's."""
        if self.served_model is not None:
            return self.served_model
        return self.spec.model_id if self.spec is not None else ""

    def info(self) -> stages_pb2.StageInfo:
        limits = self.spec.limits() if self.spec is not None else stages_pb2.ModelLimits()
        limits.min_height = max(limits.min_height, self.min_height)
        limits.cache_methods.extend(self.cache_methods)
        if self.default_cache is not None:
            limits.default_cache.CopyFrom(self.default_cache)
        if self.list_loras is not None:
            limits.loras.extend(self.list_loras())
        limits.max_loras = self.max_loras
        limits.lora_cache_bytes = self.lora_cache_bytes
        limits.fused_loras.extend(self.fused_loras)
        return stages_pb2.StageInfo(
            stage=self.stage,
            model=self.model_id,
            base_model=self.spec.model_id if self.served_model is not None and self.spec is not None else "",
            family=self.spec.family if self.spec is not None else "",
            device=str(self.device),
            parallel_config=self.parallel_config,
            parameter_bytes=self.parameter_bytes,
            limits=limits,
            version=__version__,
            weights_path=self.weights_path,
            components=self.identity.components,
            model_components=self.identity.model_components,
            models=self.served_models,
            step_scheduling=self.step_scheduling,
            step_slots=self.step_slots,
        )

    @property
    def served_models(self) -> list[str]:
        """Every model id a call may name: the served one first, then the other checkpoints'."""
        return list(dict.fromkeys([self.model_id, *self.identity.models[1:]])) if self.model_id else []

    def check_model(self, requested: str) -> None:
        served = self.served_models
        if requested and requested not in served:
            raise RequestError(
                f"model: '{requested}' is not served by this stage; it serves {', '.join(map(repr, served))}"
            )

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs blocking compute on the stage's thread, in the caller's context (its log fields and trace)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.executor, context.run, fn, *args)

    def compute_queued(self) -> bool:
        """Whether other work waits for the compute thread (asked from the compute thread, between pieces)."""
        return self.executor.has_queued()

    async def stream(self, work: Callable[[Callable[[Any], None], threading.Event], None]) -> AsyncIterator[Any]:
        """Runs `work(emit, cancel)` on the compute thread and yields what it emits, as it emits it.

        When the consumer stops early (the call was cancelled or failed), `cancel`
        is set; the work checks it between steps and raises Cancelled.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: Any) -> None:
            if cancel.is_set():
                raise Cancelled()
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def run() -> None:
            try:
                work(emit, cancel)
            except Cancelled:
                logger.info("%s: request cancelled; compute stopped", self.stage)
            except BaseException as error:  # forwarded to the handler, which maps it to a status
                loop.call_soon_threadsafe(queue.put_nowait, _Failure(error))
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        loop.run_in_executor(self.executor, contextvars.copy_context().run, run)
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            cancel.set()


class StageControlServicer(stages_pb2_grpc.StageControlServicer):
    def __init__(self, runtime: StageRuntime) -> None:
        self.runtime = runtime

    async def GetStageInfo(
        self,
        request: stages_pb2.GetStageInfoRequest,
        context: grpc.aio.ServicerContext[stages_pb2.GetStageInfoRequest, stages_pb2.StageInfo],
    ) -> stages_pb2.StageInfo:
        return self.runtime.info()


async def abort_for(error: BaseException, context: grpc.aio.ServicerContext[Any, Any], stage: str) -> NoReturn:
    """Maps an exception raised while serving a call to the status the client should see."""
    if isinstance(error, grpc.aio.AbortError):
        raise error
    if isinstance(error, (RequestError, WireError)):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(str(error)))
    if isinstance(error, NotFoundError):
        await context.abort(grpc.StatusCode.NOT_FOUND, bounded(str(error)))
    logger.exception("%s: request failed", stage)
    await context.abort(grpc.StatusCode.INTERNAL, bounded(f"{stage}: {type(error).__name__}: {error}"))
