"""The DiT servicer's side of step scheduling: which calls the step engine runs, their ids for Yield, their
checkpoints, and the "denoise_state" tensor in and out.

Rules a reader needs:
- **Which calls are stepped.** On a stage with a `StepEngine` (one rank, a family whose loop runs as steps, and
  not request batching without --continuous-batching), every request without a step cache and without adapters.
  Others run whole as before: they send no checkpoints, cannot be yielded, and are refused a state.
- **call_id** (DenoiseParams.call_id, at most 64 characters) names a running call for Yield; two calls running at
  once may not share one. The live calls are kept by id only while they run, so the table is bounded by the calls
  the server runs at once. Yield on an id no call runs answers NOT_FOUND; on a call that is not stepped, or that
  can no longer be exported (its last step), `yielding` False with the reason.
- **checkpoint_every** (0 to num_inference_steps) sends the call's state after every that many steps; refused on
  a stage that steps no request, taken and unused (no state sent) by a call that is not stepped.
- **The state** travels as "denoise_state", UINT8 [bytes]: its header's byte count is checked against the
  request's latents (`max_state_bytes`) before any byte is held; the engine then checks it was made for the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dit_svc.batch_growth import BatchGrowth
from dit_svc.config import Batching
from dit_svc.step_engine import Member, StateBytes, StepEngine
from services.stage import StageRuntime
from services.torch_wire import encode_tensor
from stagediff.tensor_codec import WireError
from stagediff.v1 import stages_pb2, tensor_pb2
from stagekit.denoise import DenoiseSpec, makes_audio
from stagekit.denoise_steps import STATE_TENSOR, max_state_bytes, runs_steps
from stagekit.errors import RequestError

MAX_CALL_ID = 64


@dataclass
class DenoiseCall:
    """What a Denoise call asked: its request, and what step scheduling takes from it."""

    spec: DenoiseSpec
    conditioning: dict[str, torch.Tensor]
    call_id: str = ""
    checkpoint_every: int = 0
    state: bytes | None = None


class StepCalls:
    """The servicer's live calls and its step engine (None: the stage steps no request, for `why_not`)."""

    def __init__(self, engine: StepEngine | None, why_not: str = "") -> None:
        self.engine = engine
        self.why_not = why_not
        # call_id -> the engine's member, or why the call is not stepped.
        self.live: dict[str, Member | str] = {}

    def reason(self, spec: DenoiseSpec) -> str | None:
        """Why this request is not stepped; None when the engine runs it."""
        if self.engine is None:
            return self.why_not
        if spec.cache.enabled:
            return "it has a step cache (the cache's decisions live on the model)"
        if spec.loras:
            return "it applies LoRA adapters"
        return None

    def options(self, params: stages_pb2.DenoiseParams) -> tuple[str, int]:
        """The call's checked call_id and checkpoint_every."""
        if len(params.call_id) > MAX_CALL_ID:
            raise RequestError(f"call_id: {len(params.call_id)} characters; at most {MAX_CALL_ID} are allowed")
        every = params.checkpoint_every
        if not 0 <= every <= params.num_inference_steps:
            raise RequestError(f"checkpoint_every: {every}; allowed 0 (never) to num_inference_steps")
        if every and self.engine is None:
            raise RequestError(f"checkpoint_every: this stage does not step requests ({self.why_not}); send 0")
        return params.call_id, every

    def check_state_chunk(self, chunk: tensor_pb2.TensorChunk, spec: DenoiseSpec, received: bool) -> None:
        """Checks the header of a "denoise_state" tensor before its bytes arrive (other chunks pass)."""
        if not chunk.HasField("header") or chunk.header.name != STATE_TENSOR:
            return
        header = chunk.header
        reason = self.reason(spec)
        if reason is not None:
            raise RequestError(f"{STATE_TENSOR}: this request is not stepped ({reason}); send it without a state")
        if received:
            raise RequestError(f"{STATE_TENSOR}: sent twice; send the state once")
        if header.datatype != "UINT8" or len(header.shape) != 1:
            raise WireError(f"tensor '{STATE_TENSOR}': {header.datatype} {list(header.shape)}; expected UINT8 [bytes]")
        assert self.engine is not None  # reason is None
        limit = max_state_bytes(tuple(self.engine.denoiser.latent_shape(spec)))  # type: ignore[attr-defined]
        if header.shape[0] > limit:
            raise RequestError(f"{STATE_TENSOR}: {header.shape[0]} bytes; at most {limit} for this request's latents")

    async def stream(self, call: DenoiseCall, whole: Callable[[], AsyncIterator[Any]]) -> AsyncIterator[Any]:
        """What the call streams: the engine's items when it is stepped, else those of `whole()` (the call run
        whole); the call is known to Yield by its id meanwhile."""
        if call.call_id in self.live:
            raise RequestError(f"call_id: '{call.call_id}' names a call running on this stage; send a unique one")
        reason = self.reason(call.spec)
        entry: Member | str = reason or Member(call.spec, call.conditioning, call.state, call.checkpoint_every)
        if call.call_id:
            self.live[call.call_id] = entry
        items = whole() if isinstance(entry, str) else self._engine().stream(entry)
        try:
            async for item in items:
                yield item
        finally:
            if call.call_id and self.live.get(call.call_id) is entry:
                del self.live[call.call_id]
            with contextlib.suppress(Exception):
                await items.aclose()  # type: ignore[attr-defined]

    def _engine(self) -> StepEngine:
        assert self.engine is not None
        return self.engine

    def answer_yield(self, call_id: str) -> stages_pb2.YieldResponse | None:
        """Asks the call to yield at its next step boundary; None when no call of that id runs."""
        entry = self.live.get(call_id) if call_id else None
        if entry is None:
            return None
        if isinstance(entry, str):
            return stages_pb2.YieldResponse(yielding=False, reason=f"not stepped: {entry}")
        if not entry.may_yield:
            return stages_pb2.YieldResponse(
                yielding=False, reason="at its last step (or its scheduler keeps no state): it runs to its end"
            )
        entry.yield_asked = True
        return stages_pb2.YieldResponse(yielding=True)

    def drain(self) -> None:
        """The stage is draining: every stepped call that can be exported yields at its next step boundary."""
        if self.engine is not None:
            self.engine.drain()


def step_responses(item: Any) -> list[stages_pb2.DenoiseResponse] | None:
    """The responses of an engine item that only stepped calls send (a state, a yield); None for the others."""
    if isinstance(item, StateBytes):
        data = torch.from_numpy(np.frombuffer(item.data, dtype=np.uint8).copy())
        return [
            stages_pb2.DenoiseResponse(tensor=chunk) for chunk in encode_tensor(STATE_TENSOR, data, index=item.step)
        ]
    if isinstance(item, stages_pb2.DenoiseYielded):
        return [stages_pb2.DenoiseResponse(yielded=item)]
    return None


def step_calls_for(
    runtime: StageRuntime, denoiser: object, batching: Batching, ranks: int, work_limit: int | None
) -> StepCalls:
    """The stage's step calls: with an engine where it steps requests (reported in StageInfo.step_scheduling and
    step_slots), else without one and the reason."""
    if ranks > 1:
        return StepCalls(None, f"a rank group ({ranks} ranks) runs each request whole")
    if makes_audio(denoiser) or not runs_steps(denoiser):
        return StepCalls(None, f"the {type(denoiser).__name__} loop is not written as steps")
    if batching.max_batch_size > 1 and not batching.continuous:
        return StepCalls(None, "requests are batched whole (--max-batch-size without --continuous-batching)")
    runtime.step_scheduling, runtime.step_slots = True, batching.step_slots
    growth = BatchGrowth(batching.step_slots) if batching.step_slots > 1 and batching.growth == "measured" else None
    return StepCalls(StepEngine(runtime, denoiser, batching.step_slots, work_limit, growth))
