"""The DiT stage schedules at the step (dit_svc/step_engine.py, dit_svc/step_calls.py), through the real servicer
served in-process on 127.0.0.1, on the tiny Wan checkpoint:

- a call asked to yield (Yield) sends its state and `yielded`; sent back, to the same or another replica, the state
  finishes the request with the latents an uninterrupted call sends, bit for bit;
- checkpoint_every sends a state every K steps while the call goes on; the last one resumes to the same latents;
- with --continuous-batching a request arriving while another runs joins it at a step boundary, and each gets the
  latents it gets alone;
- a stage that drains yields its stepped calls (`draining`), and they resume elsewhere to the same latents;
- what is refused: Yield of an unknown id, a state of another request, an oversized state, a state or a yield for a
  call that is not stepped, bad call ids and checkpoint intervals, --continuous-batching where it cannot run.

The engine's denoiser is wrapped (`Gated`) so that a test can hold a step until it has acted: no timing is assumed
(a call asked at step k yields at k, or at k + 1 when its next step had begun).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from dit_svc.config import DitConfig
from dit_svc.service import DenoiserServicer
from dit_svc.step_engine import StepEngine
from services.checkpoint import read_checkpoint
from services.stage import StageRuntime
from services.torch_wire import encode_tensor, to_torch
from stagediff.tensor_codec import TensorAssembler
from stagediff.v1 import stages_pb2, stages_pb2_grpc, tensor_pb2
from tests.helpers.serving import parse_serve

CPU = torch.device("cpu")
STEPS = 6
TOLERANCE = 1e-4


class Gated:
    """The engine's denoiser, holding the step that starts from `hold_at` until `go` is set."""

    runs_steps = True

    def __init__(self, inner: Any, hold_at: int | None = None) -> None:
        self.inner, self.hold_at = inner, hold_at
        self.go = threading.Event()
        self.expand_timesteps = False

    def begin(self, spec: Any, conditioning: Any, state: Any = None) -> Any:
        return self.inner.begin(spec, conditioning, state)

    def latent_shape(self, spec: Any) -> Any:
        return self.inner.latent_shape(spec)

    def step(self, runs: list[Any]) -> None:
        if self.hold_at is not None and any(run.step_index == self.hold_at for run in runs):
            assert self.go.wait(30), "the test never let the step go"
        self.inner.step(runs)

    def result(self, run: Any) -> Any:
        return self.inner.result(run)


class Replica:
    """A DiT stage servicer of the tiny checkpoint, loaded, and served on a port while a scenario runs."""

    def __init__(self, model: Path, *flags: str) -> None:
        self.runtime = StageRuntime("dit", read_checkpoint(model), CPU, torch.float32)
        config = DitConfig.from_args(parse_serve(["dit", "--model", str(model), *flags]))
        self.servicer = DenoiserServicer(config, self.runtime)
        self.servicer.load()
        engine = self.servicer.calls.engine
        assert isinstance(engine, StepEngine)
        self.engine = engine
        self.real = engine.denoiser

    def gate(self, hold_at: int | None) -> Gated:
        gated = Gated(self.real, hold_at)
        self.engine.denoiser = gated  # type: ignore[assignment]
        return gated


@pytest.fixture(scope="module")
def replicas(tiny_model: Path) -> tuple[Replica, Replica]:
    """One replica stepping requests one after another, and one with continuous batching of two."""
    return Replica(tiny_model), Replica(tiny_model, "--max-batch-size", "2", "--continuous-batching")


@pytest.fixture(autouse=True)
def _ungated(replicas: tuple[Replica, Replica]) -> Iterator[None]:
    yield
    for replica in replicas:
        replica.engine.denoiser = replica.real


def serve(replicas: tuple[Replica, ...], scenario: Callable[..., Awaitable[None]]) -> None:
    """Runs `scenario(*stubs)` with a Denoiser stub of each replica, one event loop for all."""

    async def run() -> None:
        servers, stubs = [], []
        try:
            for replica in replicas:
                server = grpc.aio.server()
                replica.servicer.add_to_server(server)
                port = server.add_insecure_port("127.0.0.1:0")
                await server.start()
                servers.append(server)
                stubs.append(stages_pb2_grpc.DenoiserStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}")))
            await scenario(*stubs)
        finally:
            for server in servers:
                await server.stop(None)
            for replica in replicas:  # the engine's task belongs to this loop
                await replica.engine.stop()

    asyncio.run(run())


def texts(replica: Replica, seed: int, cfg: bool = True) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    dim = replica.real.text_dim  # type: ignore[attr-defined]
    tensors = {"prompt_embeds": torch.randn(1, 4, dim, generator=generator)}
    if cfg:
        tensors["negative_prompt_embeds"] = torch.randn(1, 4, dim, generator=generator)
    return tensors


def params(seed: int = 5, steps: int = STEPS, guidance: float = 4.0, **fields: Any) -> stages_pb2.DenoiseParams:
    return stages_pb2.DenoiseParams(
        height=16, width=16, num_frames=5, num_inference_steps=steps, guidance_scale=guidance, seed=seed, **fields
    )


def requests(
    params: stages_pb2.DenoiseParams, tensors: dict[str, torch.Tensor], state: bytes | None = None
) -> list[stages_pb2.DenoiseRequest]:
    messages = [stages_pb2.DenoiseRequest(params=params)]
    messages += [stages_pb2.DenoiseRequest(tensor=c) for name, t in tensors.items() for c in encode_tensor(name, t)]
    if state is not None:
        data = torch.frombuffer(bytearray(state), dtype=torch.uint8)
        messages += [stages_pb2.DenoiseRequest(tensor=c) for c in encode_tensor("denoise_state", data)]
    return messages


class Outcome:
    """What a Denoise stream sent: progress steps, states (bytes, after which step), yielded, latents."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.states: list[tuple[int, bytes]] = []
        self.yielded: stages_pb2.DenoiseYielded | None = None
        self.passes: stages_pb2.TransformerPasses | None = None
        self.frames: list[torch.Tensor] = []
        self.assembler = TensorAssembler()

    def take(self, response: stages_pb2.DenoiseResponse) -> None:
        if response.HasField("progress"):
            self.steps.append(response.progress.step)
        elif response.HasField("yielded"):
            self.yielded = response.yielded
        elif response.HasField("passes"):
            self.passes = response.passes
        elif (tensor := self.assembler.feed(response.tensor)) is not None:
            if tensor.name == "denoise_state":
                self.states.append((self.steps[-1], tensor.array.tobytes()))
            else:
                self.frames.append(to_torch(tensor).clone())

    @property
    def latents(self) -> torch.Tensor:
        return torch.cat(self.frames, dim=2)


async def denoise(
    stub: stages_pb2_grpc.DenoiserStub,
    messages: list[stages_pb2.DenoiseRequest],
    on_step: Callable[[int], Awaitable[None]] | None = None,
) -> Outcome:
    outcome = Outcome()
    async for response in stub.Denoise(iter(messages)):
        outcome.take(response)
        if on_step is not None and response.HasField("progress"):
            await on_step(response.progress.step)
    return outcome


async def refused(call: Awaitable[Any], code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == code, raised.value
    return str(raised.value.details())


def test_a_yielded_call_resumes_on_any_replica_to_the_uninterrupted_latents(replicas: tuple[Replica, Replica]) -> None:
    one, other = replicas
    tensors = texts(one, 0)
    assert (one.runtime.info().step_scheduling, one.runtime.info().step_slots) == (True, 1)
    assert (other.runtime.info().step_scheduling, other.runtime.info().step_slots) == (True, 2)

    async def scenario(stub: Any, other_stub: Any) -> None:
        whole = await denoise(stub, requests(params(), tensors))
        assert whole.steps == list(range(1, STEPS + 1)) and whole.passes is not None and whole.passes.run == 2 * STEPS
        gated = one.gate(hold_at=3)
        answers = []

        async def ask_to_yield(step: int) -> None:
            if step == 3:
                answers.append(await stub.Yield(stages_pb2.YieldRequest(call_id="job-1")))
                gated.go.set()

        cut = await denoise(stub, requests(params(call_id="job-1"), tensors), ask_to_yield)
        assert answers[0].yielding, answers[0]
        # At the boundary where Yield found it (3), or the next one when the step after it had begun (4).
        assert cut.yielded is not None and (cut.yielded.total, cut.yielded.draining) == (6, False)
        step = cut.yielded.step
        assert step in (3, 4) and cut.steps == list(range(1, step + 1)), cut.steps
        assert cut.frames == [] and [at for at, _ in cut.states] == [step]
        state = cut.states[0][1]
        for target in (stub, other_stub):
            resumed = await denoise(target, requests(params(), tensors, state))
            assert resumed.steps == list(range(step + 1, 7)) and resumed.passes is not None
            assert resumed.passes.run == 2 * (6 - step)
            assert torch.equal(resumed.latents, whole.latents)
        # The state names its request: another seed's refuses it.
        assert "denoise_state" in await refused(denoise(stub, requests(params(seed=6), tensors, state)))
        # The call has ended: its id is free.
        await refused(stub.Yield(stages_pb2.YieldRequest(call_id="job-1")), grpc.StatusCode.NOT_FOUND)

    serve(replicas, scenario)


def test_checkpoints_every_k_steps_resume_to_the_uninterrupted_latents(replicas: tuple[Replica, Replica]) -> None:
    one, other = replicas
    tensors = texts(one, 1, cfg=False)

    async def scenario(stub: Any, other_stub: Any) -> None:
        whole = await denoise(stub, requests(params(guidance=1.0), tensors))
        checkpointed = await denoise(stub, requests(params(guidance=1.0, checkpoint_every=2), tensors))
        assert [step for step, _ in checkpointed.states] == [2, 4] and checkpointed.yielded is None
        assert torch.equal(checkpointed.latents, whole.latents)
        resumed = await denoise(other_stub, requests(params(guidance=1.0), tensors, checkpointed.states[-1][1]))
        assert resumed.steps == [5, 6] and torch.equal(resumed.latents, whole.latents)

    serve(replicas, scenario)


def test_a_request_joins_a_running_batch_at_a_step_boundary(replicas: tuple[Replica, Replica]) -> None:
    one, other = replicas
    first, second = texts(one, 2), texts(one, 3)
    first_params, second_params = params(seed=1, steps=8, guidance=4.0), params(seed=2, steps=5, guidance=5.5)

    async def scenario(stub: Any, other_stub: Any) -> None:
        alone = [
            await denoise(stub, requests(first_params, first)),
            await denoise(stub, requests(second_params, second)),
        ]
        gated = other.gate(hold_at=2)
        seen: list[tuple[str, int]] = []
        later: list[asyncio.Task] = []

        async def start_the_second(step: int) -> None:
            seen.append(("first", step))
            if step == 2:

                async def second_call(step: int) -> None:
                    seen.append(("second", step))

                later.append(asyncio.create_task(denoise(other_stub, requests(second_params, second), second_call)))
                async with asyncio.timeout(30):  # it is in the engine (waiting for the boundary, or admitted)
                    while not any(m.spec.seed == 2 for m in [*other.engine.waiting, *other.engine.active]):
                        await asyncio.sleep(0.01)
                gated.go.set()

        together = [await denoise(other_stub, requests(first_params, first), start_the_second)]
        together.append(await later[0])
        assert seen.index(("second", 1)) < seen.index(("first", 8)), seen
        exact = []
        for got, want in zip(together, alone, strict=True):
            difference = (got.latents - want.latents).abs().max().item()
            assert difference <= TOLERANCE, difference
            exact.append((torch.equal(got.latents, want.latents), difference))
        print(f"joined rows equal their runs alone exactly: {exact}")

    serve(replicas, scenario)


def test_a_draining_stage_yields_its_stepped_calls(replicas: tuple[Replica, Replica]) -> None:
    one, other = replicas
    tensors = texts(one, 4)

    async def scenario(stub: Any, other_stub: Any) -> None:
        whole = await denoise(other_stub, requests(params(), tensors))
        gated = one.gate(hold_at=2)

        async def drain_now(step: int) -> None:
            if step == 2:
                await one.servicer.drain()  # what the server calls at SIGTERM (services/stage_main.py on_drain)
                gated.go.set()

        try:
            cut = await denoise(stub, requests(params(), tensors), drain_now)
        finally:
            one.engine.draining = False
        assert cut.yielded is not None and cut.yielded.step in (2, 3) and cut.yielded.draining
        resumed = await denoise(other_stub, requests(params(), tensors, cut.states[-1][1]))
        assert torch.equal(resumed.latents, whole.latents)

    serve(replicas, scenario)


def test_what_step_scheduling_refuses(replicas: tuple[Replica, Replica]) -> None:
    one, _ = replicas
    tensors = texts(one, 5)
    cache = stages_pb2.StepCache(method="first_block", threshold=0.1)

    async def scenario(stub: Any, other_stub: Any) -> None:
        await refused(stub.Yield(stages_pb2.YieldRequest(call_id="nobody")), grpc.StatusCode.NOT_FOUND)
        # Refused at the params: sent alone, so that the refusal does not race the client's sending.
        assert "call_id" in await refused(denoise(stub, requests(params(call_id="x" * 65), {})))
        assert "checkpoint_every" in await refused(denoise(stub, requests(params(checkpoint_every=7), {})))
        huge = tensor_pb2.TensorChunk(header=tensor_pb2.TensorHeader(name="denoise_state", datatype="UINT8"))
        huge.header.shape.append(1 << 30)
        forged = [*requests(params(), tensors), stages_pb2.DenoiseRequest(tensor=huge)]
        assert "denoise_state" in await refused(denoise(stub, forged))
        # A call with a step cache is not stepped: it cannot yield, and takes no state.
        assert "not stepped" in await refused(denoise(stub, requests(params(cache=cache), tensors, b"\0" * 8)))
        hold = threading.Event()
        busy = asyncio.ensure_future(one.runtime.run(hold.wait, 30))  # the call waits for the compute thread
        try:
            call = asyncio.ensure_future(denoise(stub, requests(params(cache=cache, call_id="cached"), tensors)))
            async with asyncio.timeout(30):
                while "cached" not in one.servicer.calls.live:
                    await asyncio.sleep(0.01)
            answer = await stub.Yield(stages_pb2.YieldRequest(call_id="cached"))
            assert not answer.yielding and "step cache" in answer.reason, answer
        finally:
            hold.set()
        await busy
        assert (await call).yielded is None and len((await call).frames) > 0

    serve(replicas, scenario)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--continuous-batching"], "--max-batch-size N with N > 1"),
        (["--continuous-batching", "--max-batch-size", "2", "--cfg-parallel-size", "2"], "rank group"),
    ],
)
def test_continuous_batching_is_refused_where_it_cannot_run(tiny_model: Path, flags: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as refusal:
        DitConfig.from_args(parse_serve(["dit", "--model", str(tiny_model), *flags]))
    assert "--continuous-batching" in str(refusal.value) and says in str(refusal.value), refusal.value


def test_continuous_batching_is_refused_for_a_family_that_does_not_step(flux_model: Path) -> None:
    flags = ["dit", "--model", str(flux_model), "--max-batch-size", "2", "--continuous-batching"]
    with pytest.raises(SystemExit, match="not written as steps"):
        DitConfig.from_args(parse_serve(flags))
