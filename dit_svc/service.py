"""gRPC servicer of the denoising stage.

The checkpoint's family names its denoiser (families/<family>/denoise.py) and the conditioning tensors it
takes (`Family.conditioning`), by the names the text encoder sends them under: embeddings [1, L, text_dim]
("prompt_embeds" and, with CFG, "negative_prompt_embeds") and, where the family declares them, masks
[1, L] ("<embeddings>_mask", 1 for a token, 0 for padding). The servicer checks each against its slot and
hands them to the denoiser by name. The stream ends with the latents, one tensor "latents" per latent frame; a family
that makes sound with its video (stagekit.denoise.AudioDenoiser: LTX-2) then sends one more, "audio_latents" FP32
[1, Ca, A, M] (index 0), which the VAE stage decodes to the waveform. `main()` checks the options once
(dit_svc/config.py `DitConfig.from_args`) and hands the servicer, or a follower node's group, the sections of the
resulting `DitConfig`. Where the stage steps requests (dit_svc/step_calls.py, dit_svc/step_engine.py) a call may also
send and receive its state ("denoise_state"), be asked to yield by `Yield`, and yields by itself when the stage drains.
"""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import cast

import grpc
import torch

from dit_svc.batching import RequestBatcher, checked_batch_group, max_work
from dit_svc.config import DitConfig
from dit_svc.denoise import OneRank, batch_key, make_adapter_cache, make_denoiser
from dit_svc.group import DenoiserGroup, serve_dit_node
from dit_svc.lora import LoraSettings, list_adapters, served_model_id
from dit_svc.options import build_parser
from dit_svc.request_images import request_images
from dit_svc.step_cache import CachePasses
from dit_svc.step_calls import DenoiseCall, StepCalls, step_calls_for, step_responses
from services.auth import TLSConfigError, server_credentials_for
from services.checkpoint import CheckpointSpec
from services.environment_options import parse_args
from services.memory_budget import WeightNeed, checkpoint_components, stage_need
from services.model_source import stage_model
from services.rank_group import GroupFailure
from services.stage import RequestError, StageRuntime, abort_for
from services.stage_config import StageConfig
from services.stage_main import StageServicer, prepare_stage_process, run_stage
from services.torch_wire import encode_tensor, to_torch
from services.validation import (
    MAX_FPS,
    resolve_cache,
    resolve_loras,
    validate_sampling,
    validate_seed,
    validate_size,
    validate_sound_length,
)
from stagediff.tensor_codec import TensorAssembler, WireError, WireTensor, expect_tensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc
from stagekit.denoise import CacheSpec, Denoiser, DenoiseSpec, PooledTextDenoiser, makes_audio, takes_images
from stagekit.denoise_steps import STATE_TENSOR
from stagekit.gguf import gguf_file

# The memory guard's fix for weights that do not fit at full size: GGUF weights stay quantized in memory.
GGUF_FIX = (
    "--quantization gguf with a .gguf file in each transformer folder (held at its size: about 1.06 bytes per "
    "parameter for Q8_0, 0.56 for Q4_0)"
)


@dataclass(frozen=True)
class AudioLatents:
    """The audio latents [1, Ca, A, M] of a family that makes sound, as the compute thread hands them to the stream."""

    latents: torch.Tensor


class DenoiserServicer(stages_pb2_grpc.DenoiserServicer, StageServicer):
    service_name = stages_pb2.DESCRIPTOR.services_by_name["Denoiser"].full_name

    def __init__(self, config: DitConfig, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.config = config
        self.parallel = config.parallel
        self.layout = config.layout
        self.options = config.options
        self.cache_offer = config.step_cache
        self.max_batch_size = config.batching.max_batch_size
        self.batch_wait_ms = config.batching.batch_wait_ms
        self.batcher: RequestBatcher | None = None
        self.denoiser: Denoiser | DenoiserGroup | None = None
        # What runs each request: the group, or this rank alone (the same two calls).
        self.runner: DenoiserGroup | OneRank | None = None
        self.calls = StepCalls(None, "the stage is loading")  # dit_svc/step_calls.py: Yield, states, checkpoints
        if runtime.spec is None:
            raise ValueError("the DiT stage needs a checkpoint (--model)")
        self.checkpoint: CheckpointSpec = runtime.spec
        self.slots = {slot.name: slot for slot in self.checkpoint.traits.conditioning}
        if self.parallel.total_ranks > 1:
            runtime.parallel_config = {**self.parallel.describe(), "nnodes": str(self.layout.nnodes)}

    def add_to_server(self, server: grpc.aio.Server) -> None:
        stages_pb2_grpc.add_DenoiserServicer_to_server(self, server)

    def memory_need(self) -> WeightNeed:
        """The transformer(s) in the stage's dtype, GGUF weights at their file size.

        On the CPU every rank of the group is a process on this machine holding its own copy, or its 1/N with
        tensor parallelism or HSDP; on CUDA each rank has a GPU of its own. The offload flags are not offered
        as a fix: the experts are loaded onto the device whole before they are offloaded.
        """
        runtime, parallel = self.runtime, self.parallel
        root = self.checkpoint.path
        names = self.config.checkpoint.experts
        gguf_helps = self.options.quantization != "gguf" and self.checkpoint.traits.support("gguf").supported
        fixes = [GGUF_FIX] if gguf_helps else []
        held: dict[str, int] = {}
        components = {}
        if self.options.quantization == "gguf":
            held = {name: gguf_file(root / name).stat().st_size for name in names}
        else:
            components = checkpoint_components(root, names=names)
        split = parallel.tp_degree * (parallel.hsdp_shard_size if parallel.use_hsdp else 1)
        on_cpu = runtime.device.type == "cpu"
        copies = parallel.total_ranks // self.layout.nnodes if on_cpu else 1
        if not on_cpu:
            fixes.append("--tensor-parallel-size N, or --use-hsdp --hsdp-shard-size N (each GPU holds 1/N)")
        return stage_need(
            runtime.stage,
            runtime.device,
            runtime.dtype,
            components,
            copies=copies,
            split=split,
            held_as_stored=held,
            fixes=fixes,
        )

    def load(self) -> None:
        runtime = self.runtime
        build = self.config.build
        if self.parallel.total_ranks == 1:
            self.denoiser = make_denoiser(self.checkpoint.path, runtime.device, runtime.dtype, build)
        else:
            self.denoiser = DenoiserGroup(
                self.checkpoint.path,
                runtime.device,
                runtime.dtype,
                self.config.threads,
                build,
                layout=self.layout,
                mag_ratios=self.cache_offer.mag_ratios,
            )
            nnodes = self.layout.nnodes
            per_node = self.parallel.total_ranks // nnodes
            devices = (
                ", ".join(f"{runtime.device.type}:{rank}" for rank in range(per_node))
                if runtime.device.type == "cuda"
                else f"cpu x {per_node} processes"
            )
            runtime.parallel_config = {
                **self.parallel.describe(),
                "nnodes": str(nnodes),
                "devices": devices if nnodes == 1 else f"{nnodes} nodes x ({devices})",
            }
        runtime.parallel_config = {**runtime.parallel_config, **self.options.describe()}
        runtime.cache_methods = self.cache_offer.methods()
        runtime.default_cache = self.cache_offer.default
        self._serve_loras(self.options.lora)
        self.runner = (
            self.denoiser
            if isinstance(self.denoiser, DenoiserGroup)
            else OneRank(
                self.denoiser,
                self.cache_offer.mag_ratios,
                make_adapter_cache(self.denoiser, build.options, load_threads=build.load_threads),
            )
        )
        work_limit = max_work(self.checkpoint.limits())
        self.calls = step_calls_for(runtime, self.denoiser, self.config.batching, self.parallel.total_ranks, work_limit)
        if self.max_batch_size > 1:
            run_batch = self.runner.denoise_batch_request
            self.batcher = RequestBatcher(
                runtime,
                run_batch,
                self.max_batch_size,
                self.batch_wait_ms,
                work_limit=work_limit,
            )
            runtime.parallel_config = {
                **runtime.parallel_config,
                "max_batch_size": str(self.max_batch_size),
                "batch_wait_ms": f"{self.batch_wait_ms:g}",
            }
        from stagekit.parallel.hsdp import local_parameter_bytes  # brings torch.distributed.fsdp: not at startup

        # With TP or HSDP a rank holds a shard: report what rank 0 holds (quantized weights at their stored size).
        local = self.denoiser.denoiser if isinstance(self.denoiser, DenoiserGroup) else self.denoiser
        experts = local.experts
        names = ("transformer", "transformer_2")[: len(experts)]
        runtime.parameter_bytes = {
            name: local_parameter_bytes(expert) for name, expert in zip(names, experts, strict=True)
        }

    def _serve_loras(self, lora: LoraSettings) -> None:
        """What GetStageInfo says of the adapters: those in --lora-dir (listed afresh each time, so an adapter
        dropped in is served without a restart), how many a request may apply, and those fused in, which serve
        the checkpoint under its own id."""
        runtime = self.runtime
        directory = lora.directory
        if lora.per_request and directory is not None:
            itemsize = runtime.dtype.itemsize
            runtime.list_loras = lambda: list_adapters(directory, itemsize)
            runtime.max_loras = lora.max_per_request
            runtime.lora_cache_bytes = lora.cache_bytes
        if lora.fused:
            runtime.fused_loras = [stages_pb2.LoraAdapter(name=name, scale=scale) for name, scale in lora.fused]
            runtime.served_model = served_model_id(self.checkpoint.model_id, lora.fused)

    @property
    def _rank0_denoiser(self) -> Denoiser:
        """This rank's own denoiser (a group's rank 0 answers for the group); Denoise refuses calls until `load`
        has set it."""
        assert self.denoiser is not None, "dit: used before its model loaded"
        return self.denoiser.denoiser if isinstance(self.denoiser, DenoiserGroup) else self.denoiser

    def failure(self) -> str | None:
        return self.denoiser.failure() if isinstance(self.denoiser, DenoiserGroup) else None

    def close(self) -> None:
        if isinstance(self.denoiser, DenoiserGroup):
            self.denoiser.close()

    def _spec_from(self, params: stages_pb2.DenoiseParams) -> DenoiseSpec:
        self.runtime.check_model(params.model)
        limits = self.runtime.info().limits
        validate_size(limits, params.height, params.width, params.num_frames)
        embedded = params.embedded_guidance_scale if params.HasField("embedded_guidance_scale") else None
        if embedded is None and limits.HasField("default_embedded_guidance_scale"):
            embedded = limits.default_embedded_guidance_scale
        validate_sampling(limits, params.num_inference_steps, params.guidance_scale, embedded)
        validate_seed(params.seed)
        fps = params.fps or limits.default_fps
        if not (math.isfinite(fps) and 0 < fps <= MAX_FPS):
            raise RequestError(
                f"fps: {params.fps:g} is not allowed; use a value in (0, {MAX_FPS:g}], or 0 for the model's default"
            )
        validate_sound_length(limits, params.num_frames, fps)
        cache = resolve_cache(limits, params.cache if params.HasField("cache") else None)
        loras = resolve_loras(limits, list(params.loras))
        return DenoiseSpec(
            height=params.height,
            width=params.width,
            num_frames=params.num_frames,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            embedded_guidance_scale=embedded,
            cfg_threshold=self.checkpoint.traits.cfg_threshold,
            seed=params.seed,
            cache=CacheSpec(cache.method, cache.threshold),
            loras=tuple((lora.name, lora.scale) for lora in loras),
            batch_group=checked_batch_group(params.batch_group),
            fps=fps,
            **request_images(self.checkpoint, params),
        )

    def _check_conditioning(self, tensor: WireTensor, received: dict[str, torch.Tensor], spec: DenoiseSpec) -> None:
        """Checks a conditioning tensor against the family's slot for its name (families/base.py TensorSlot)."""
        slot = self.slots.get(tensor.name)
        if slot is None or tensor.name in received:
            raise WireError(
                f"tensor '{tensor.name}': expected each of {', '.join(repr(name) for name in self.slots)} at most "
                "once ('prompt_embeds' always; 'negative_prompt_embeds' with CFG: guidance_scale above "
                f"{self.checkpoint.traits.cfg_threshold:g} for this model)"
            )
        max_length = self.checkpoint.sequence_length_limit
        expect_tensor(tensor, name=tensor.name, datatypes=slot.datatypes, ndim=slot.ndim)
        if slot.image:
            # Made from the input images: the denoiser says the shape they have for this request.
            # A None in the shape is a token count, 1..sequence_length_limit.
            expected = None
            if spec.image_roles:
                denoiser = self._rank0_denoiser
                assert takes_images(denoiser), "image slots belong to a family that takes input images"
                expected = denoiser.image_tensor_shape(tensor.name, spec)
            if (
                expected is None
                or len(expected) != len(tensor.shape)
                or not all(
                    size == want if want is not None else 1 <= size <= max_length
                    for size, want in zip(tensor.shape, expected, strict=True)
                )
            ):
                allowed = (
                    [want if want is not None else "L" for want in expected]
                    if expected is not None
                    else "none for this request's image_roles and image_sizes"
                )
                raise WireError(
                    f"tensor '{tensor.name}': shape {list(tensor.shape)} is not allowed; expected {allowed}"
                )
            return
        if slot.kind == "embeds":
            batch, length, dim = tensor.shape
            text_dim = getattr(self._rank0_denoiser, slot.width)
            if batch != 1 or not 1 <= length <= max_length or dim != text_dim:
                raise WireError(
                    f"tensor '{tensor.name}': shape {list(tensor.shape)} is not allowed; "
                    f"expected [1, L, {text_dim}] with 1 <= L <= {max_length}"
                )
            return
        if slot.kind == "pooled":
            # Only a family that declares pooled slots has them, and its denoiser says their width.
            pooled_dim = cast(PooledTextDenoiser, self._rank0_denoiser).pooled_dim
            if list(tensor.shape) != [1, pooled_dim]:
                raise WireError(
                    f"tensor '{tensor.name}': shape {list(tensor.shape)} is not allowed; expected [1, {pooled_dim}]"
                )
            return
        batch, length = tensor.shape
        if batch != 1 or not 1 <= length <= max_length:
            raise WireError(
                f"tensor '{tensor.name}': shape {list(tensor.shape)} is not allowed; expected [1, L] with "
                f"1 <= L <= {max_length}, L as in its embeddings"
            )

    def _check_complete(self, spec: DenoiseSpec, received: dict[str, torch.Tensor]) -> None:
        """Every slot the request needs arrived, and each mask matches its embeddings' length."""
        for slot in self.slots.values():
            if slot.is_needed(spec.do_classifier_free_guidance, bool(spec.image_roles)) and slot.name not in received:
                cfg = f"required when guidance_scale > {spec.cfg_threshold:g} (CFG)"
                when = {"cfg": cfg, "image": "required with input images"}.get(slot.needed, "missing")
                raise RequestError(f"{slot.name}: {when}; send it after params")
            if slot.of is not None and slot.name in received:
                embeds = received.get(slot.of)
                if embeds is None:
                    raise RequestError(f"{slot.name}: sent without {slot.of}")
                if received[slot.name].shape[1] != embeds.shape[1]:
                    raise WireError(
                        f"tensor '{slot.name}': length {received[slot.name].shape[1]} differs from the "
                        f"{embeds.shape[1]} of '{slot.of}'"
                    )
                if not slot.may_be_empty and not bool(received[slot.name].bool().any()):
                    raise WireError(f"tensor '{slot.name}': the embeddings' mask marks no token")

    async def _receive(self, requests: AsyncIterator[stages_pb2.DenoiseRequest]) -> DenoiseCall:
        spec: DenoiseSpec | None = None
        assembler = TensorAssembler()
        received: dict[str, torch.Tensor] = {}
        options, state = ("", 0), None
        async for request in requests:
            if request.HasField("params"):
                if spec is not None:
                    raise RequestError("params: sent twice; send params once, first")
                spec, options = self._spec_from(request.params), self.calls.options(request.params)
            elif request.HasField("tensor"):
                if spec is None:
                    raise RequestError("params: must be the first message, before any tensor")
                self.calls.check_state_chunk(request.tensor, spec, state is not None)
                tensor = assembler.feed(request.tensor)
                if tensor is None:
                    continue
                if tensor.name == STATE_TENSOR:
                    state = tensor.array.tobytes()
                    continue
                self._check_conditioning(tensor, received, spec)
                received[tensor.name] = to_torch(tensor)
            else:
                raise RequestError("part: each message must set params or tensor")
        assembler.finish()
        if spec is None:
            raise RequestError("params: missing; the first message must carry DenoiseParams")
        self._check_complete(spec, received)
        return DenoiseCall(spec, received, *options, state=state)

    async def Denoise(
        self,
        request_iterator: AsyncIterator[stages_pb2.DenoiseRequest],
        context: grpc.aio.ServicerContext[stages_pb2.DenoiseRequest, stages_pb2.DenoiseResponse],
    ) -> AsyncIterator[stages_pb2.DenoiseResponse]:
        runner, batcher = self.runner, self.batcher
        if self.denoiser is None or runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "dit: still loading its model")
        try:
            call = await self._receive(request_iterator)
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)
        spec, conditioning = call.spec, call.conditioning

        # A family that makes sound runs its joint loop, on this rank or on every rank of its group, and alone (it
        # does not batch).
        with_audio = makes_audio(runner.denoiser)

        def work(emit: Callable[[object], None], cancel: threading.Event) -> None:
            def on_step(step: int, total: int) -> None:
                emit(stages_pb2.DenoiseProgress(step=step, total=total))

            if with_audio:
                latents, audio_latents, passes = runner.denoise_av_request(spec, conditioning, on_step, cancel.is_set)
                emit(passes)
                emit(latents)
                emit(AudioLatents(audio_latents))
                return
            latents, passes = runner.denoise_request(spec, conditioning, on_step, cancel.is_set)
            emit(passes)
            emit(latents)

        key = batch_key(spec, conditioning) if batcher is not None and not with_audio else None

        def whole() -> AsyncIterator[object]:
            return (
                self.runtime.stream(work) if key is None or batcher is None else batcher.stream(spec, conditioning, key)
            )

        items = self.calls.stream(call, whole)
        try:
            async for item in items:
                if (responses := step_responses(item)) is not None:  # a state, a yield: stepped calls only
                    for response in responses:
                        yield response
                    continue
                if isinstance(item, stages_pb2.DenoiseProgress):
                    yield stages_pb2.DenoiseResponse(progress=item)
                    continue
                if isinstance(item, CachePasses):
                    passes = stages_pb2.TransformerPasses(run=item.run, skipped=item.skipped)
                    yield stages_pb2.DenoiseResponse(passes=passes)
                    continue
                if isinstance(item, AudioLatents):
                    # After the video's last latent frame: the audio latents whole, for the VAE stage's audio decoder.
                    for chunk in encode_tensor("audio_latents", item.latents.float(), index=0):
                        yield stages_pb2.DenoiseResponse(tensor=chunk)
                    continue
                # One tensor per latent frame, so the VAE can decode frame t while t+1 travels.
                for t in range(item.shape[2]):
                    for chunk in encode_tensor("latents", item[:, :, t : t + 1], index=t):
                        yield stages_pb2.DenoiseResponse(tensor=chunk)
        except GroupFailure as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"dit: {error}")
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)

    async def Yield(
        self,
        request: stages_pb2.YieldRequest,
        context: grpc.aio.ServicerContext[stages_pb2.YieldRequest, stages_pb2.YieldResponse],
    ) -> stages_pb2.YieldResponse:
        answer = self.calls.answer_yield(request.call_id)
        if answer is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"call_id '{request.call_id[:64]}': no such call runs here")
        return answer

    async def drain(self) -> None:
        self.calls.drain()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv)
    args.model = stage_model("dit", args.model)
    config = DitConfig.from_args(args)
    stage = StageConfig.from_args("dit", args, config.checkpoint.spec)
    if config.node_rank > 0:  # a follower machine of a multi-node group: node 0 serves the stage
        device, dtype = prepare_stage_process(stage)
        if stage.checkpoint is None:
            raise SystemExit("stagediff serve dit: --model is required")
        try:
            credentials = server_credentials_for(stage.server.tls)
        except TLSConfigError as error:
            raise SystemExit(f"stagediff serve dit: {error}") from None
        server = stage.server
        serve_dit_node(
            config,
            stage.checkpoint.path,
            device,
            dtype,
            host=server.host,
            port=server.port,
            credentials=credentials,
            drain_grace_s=stage.drain_grace_s,
        )
        return
    run_stage(stage, lambda runtime: DenoiserServicer(config, runtime))


if __name__ == "__main__":
    main()
