"""gRPC servicer of the denoising stage.

The checkpoint's family names its denoiser (families/<family>/denoise.py) and the conditioning tensors it
takes (`Family.conditioning`), by the names the text encoder sends them under: embeddings [1, L, text_dim]
("prompt_embeds" and, with CFG, "negative_prompt_embeds") and, where the family declares them, masks
[1, L] ("<embeddings>_mask", 1 for a token, 0 for padding). The servicer checks each against its slot and
hands them to the denoiser by name.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import diffusers
import grpc
import torch

from dit_svc.batching import MAX_BATCH_SIZE, MAX_BATCH_WAIT_MS, RequestBatcher, checked_batch_group, max_work
from dit_svc.cache_offer import CacheOffer, cache_offer_from
from dit_svc.denoise import Denoiser, DenoiseSpec, OneRank, batch_key, make_adapter_cache, make_denoiser
from dit_svc.gguf import check_gguf_file, gguf_file, quantization_for
from dit_svc.group import DenoiserGroup, serve_dit_node
from dit_svc.lora import LoraSettings, list_adapters, parse_fused, served_model_id
from dit_svc.model_options import ModelOptions
from dit_svc.offload import validate_offload_flags
from dit_svc.options import DEFAULT_MASTER_PORT, build_parser
from dit_svc.parallel import ParallelConfig, ParallelConfigError
from dit_svc.parallel.hsdp import local_parameter_bytes
from dit_svc.parallel.mesh import refuse_unsupported_methods
from dit_svc.quantization import METHODS as QUANTIZATION_METHODS
from dit_svc.quantization import linear_layer_names, parse_ignored_layers, validate_quantization_flags
from dit_svc.step_cache import CachePasses, CacheSpec
from families.base import LORA_WITH
from services.auth import CLUSTER_SECRET_ENV, ClusterSecretError, load_cluster_secret
from services.checkpoint import CheckpointError, read_checkpoint
from services.environment_options import parse_args
from services.memory_budget import WeightNeed, checkpoint_components, stage_need
from services.rank_group import ControlChannel, GroupFailure, NodeLayout, group_authkey
from services.server import is_loopback
from services.stage import RequestError, StageRuntime, abort_for
from services.stage_main import StageServicer, run_stage
from services.torch_wire import encode_tensor, to_torch
from services.validation import (
    MAX_LORAS_PER_REQUEST,
    resolve_cache,
    resolve_loras,
    validate_sampling,
    validate_seed,
    validate_size,
)
from stagediff.tensor_codec import TensorAssembler, WireError, WireTensor, expect_tensor
from stagediff.v1 import stages_pb2, stages_pb2_grpc

# The memory guard's fix for weights that do not fit at full size: GGUF weights stay quantized in memory.
GGUF_FIX = (
    "--quantization gguf with a .gguf file in each transformer folder (held at its size: about 1.06 bytes per "
    "parameter for Q8_0, 0.56 for Q4_0)"
)


class DenoiserServicer(stages_pb2_grpc.DenoiserServicer, StageServicer):
    service_name = stages_pb2.DESCRIPTOR.services_by_name["Denoiser"].full_name

    def __init__(self, args: argparse.Namespace, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.threads = args.threads
        self.parallel = parallel_config_from(args)
        self.layout = node_layout_from(args)
        self.options = model_options_from(args) if Path(args.model, "model_index.json").is_file() else ModelOptions()
        self.cache_offer = step_cache_offer_from(args)
        self.max_batch_size, self.batch_wait_ms = batching_from(args)
        self.batcher: RequestBatcher | None = None
        self.denoiser: Denoiser | DenoiserGroup | None = None
        # What runs each request: the group, or this rank alone (the same two calls).
        self.runner: DenoiserGroup | OneRank | None = None
        self.slots = {slot.name: slot for slot in runtime.spec.traits.conditioning}
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
        root = runtime.spec.path
        names = _transformer_components(str(root))
        gguf_helps = self.options.quantization != "gguf" and runtime.spec.traits.support("gguf").supported
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
        if self.parallel.total_ranks == 1:
            self.denoiser = make_denoiser(
                runtime.spec.path,
                runtime.device,
                runtime.dtype,
                options=self.options,
                load_threads=runtime.load_threads,
            )
        else:
            self.denoiser = DenoiserGroup(
                runtime.spec.path,
                runtime.device,
                runtime.dtype,
                self.threads,
                self.parallel,
                self.options,
                load_threads=runtime.load_threads,
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
                make_adapter_cache(self.denoiser, self.options, runtime.load_threads),
            )
        )
        if self.max_batch_size > 1:
            run_batch = self.runner.denoise_batch_request
            self.batcher = RequestBatcher(
                runtime, run_batch, self.max_batch_size, self.batch_wait_ms, work_limit=max_work(runtime.spec.limits())
            )
            runtime.parallel_config = {
                **runtime.parallel_config,
                "max_batch_size": str(self.max_batch_size),
                "batch_wait_ms": f"{self.batch_wait_ms:g}",
            }
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
        if lora.per_request:
            directory = lora.directory
            itemsize = runtime.dtype.itemsize
            runtime.list_loras = lambda: list_adapters(directory, itemsize)
            runtime.max_loras = lora.max_per_request
            runtime.lora_cache_bytes = lora.cache_bytes
        if lora.fused:
            runtime.fused_loras = [stages_pb2.LoraAdapter(name=name, scale=scale) for name, scale in lora.fused]
            runtime.served_model = served_model_id(runtime.spec.model_id, lora.fused)

    def failure(self) -> str | None:
        return self.denoiser.failure() if isinstance(self.denoiser, DenoiserGroup) else None

    def close(self) -> None:
        if isinstance(self.denoiser, DenoiserGroup):
            self.denoiser.close()

    def _spec_from(self, params: stages_pb2.DenoiseParams) -> DenoiseSpec:
        self.runtime.check_model(params.model)
        limits = self.runtime.info().limits
        validate_size(limits, params.height, params.width, params.num_frames)
        validate_sampling(limits, params.num_inference_steps, params.guidance_scale)
        validate_seed(params.seed)
        cache = resolve_cache(limits, params.cache if params.HasField("cache") else None)
        loras = resolve_loras(limits, list(params.loras))
        return DenoiseSpec(
            height=params.height,
            width=params.width,
            num_frames=params.num_frames,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            seed=params.seed,
            cache=CacheSpec(cache.method, cache.threshold),
            loras=tuple((lora.name, lora.scale) for lora in loras),
            batch_group=checked_batch_group(params.batch_group),
            **self._images(params),
        )

    def _images(self, params: stages_pb2.DenoiseParams) -> dict[str, tuple]:
        """The request's image roles and sizes, checked against the model and put in its role order."""
        spec = self.runtime.spec
        roles = list(params.image_roles)
        # A role may come as many times as the model lists it (services/input_images.py).
        repeated = any(roles.count(role) > spec.image_roles.count(role) for role in roles)
        if len(roles) > len(spec.image_roles) or repeated:
            raise RequestError(
                f"image_roles: {len(roles)} roles; send each of {', '.join(spec.image_roles) or 'none'} at most "
                "as many times as the model lists it"
            )
        for role in roles:
            if role not in spec.image_roles:
                raise RequestError(f"image_roles: '{role[:32]}' is not taken; allowed: {', '.join(spec.image_roles)}")
        missing = [role for role in spec.required_image_roles if role not in roles]
        if missing:
            raise RequestError(f"image_roles: {', '.join(missing)} required by model '{spec.model_id}'")
        sizes = [(size.width, size.height) for size in params.image_sizes]
        if sizes and len(sizes) != len(roles):
            raise RequestError(f"image_sizes: {len(sizes)} sizes for {len(roles)} image_roles; send one per image")
        for index, (width, height) in enumerate(sizes):
            if width < 1 or height < 1 or width * height > spec.max_image_pixels:
                raise RequestError(
                    f"image_sizes[{index}]: {width}x{height} is not allowed; at most {spec.max_image_pixels} pixels"
                )
        # Stable: the images of one role keep the order they were sent in, as the other stages order them.
        order = sorted(range(len(roles)), key=lambda i: spec.image_roles.index(roles[i]))
        return {
            "image_roles": tuple(roles[i] for i in order),
            "image_sizes": tuple(sizes[i] for i in order) if sizes else (),
        }

    def _check_conditioning(self, tensor: WireTensor, received: dict[str, torch.Tensor], spec: DenoiseSpec) -> None:
        """Checks a conditioning tensor against the family's slot for its name (families/base.py TensorSlot)."""
        slot = self.slots.get(tensor.name)
        if slot is None or tensor.name in received:
            raise WireError(
                f"tensor '{tensor.name}': expected each of {', '.join(repr(name) for name in self.slots)} at most "
                "once ('prompt_embeds' always; 'negative_prompt_embeds' with guidance_scale > 1)"
            )
        max_length = self.runtime.spec.sequence_length_limit
        expect_tensor(tensor, name=tensor.name, datatypes=slot.datatypes, ndim=slot.ndim)
        if slot.image:
            # Made from the input images: the denoiser says the shape they have for this request.
            # A None in the shape is a token count, 1..sequence_length_limit.
            expected = self.denoiser.image_tensor_shape(tensor.name, spec) if spec.image_roles else None
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
            if batch != 1 or not 1 <= length <= max_length or dim != self.denoiser.text_dim:
                raise WireError(
                    f"tensor '{tensor.name}': shape {list(tensor.shape)} is not allowed; "
                    f"expected [1, L, {self.denoiser.text_dim}] with 1 <= L <= {max_length}"
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
                when = {"cfg": "required when guidance_scale > 1 (CFG)", "image": "required with input images"}.get(
                    slot.needed, "missing"
                )
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
                if not bool(received[slot.name].bool().any()):
                    raise WireError(f"tensor '{slot.name}': the embeddings' mask marks no token")

    async def _receive(
        self, requests: AsyncIterator[stages_pb2.DenoiseRequest]
    ) -> tuple[DenoiseSpec, dict[str, torch.Tensor]]:
        spec: DenoiseSpec | None = None
        assembler = TensorAssembler()
        received: dict[str, torch.Tensor] = {}
        async for request in requests:
            if request.HasField("params"):
                if spec is not None:
                    raise RequestError("params: sent twice; send params once, first")
                spec = self._spec_from(request.params)
            elif request.HasField("tensor"):
                if spec is None:
                    raise RequestError("params: must be the first message, before any tensor")
                tensor = assembler.feed(request.tensor)
                if tensor is None:
                    continue
                self._check_conditioning(tensor, received, spec)
                received[tensor.name] = to_torch(tensor)
            else:
                raise RequestError("part: each message must set params or tensor")
        assembler.finish()
        if spec is None:
            raise RequestError("params: missing; the first message must carry DenoiseParams")
        self._check_complete(spec, received)
        return spec, received

    async def Denoise(self, request_iterator, context):
        if self.denoiser is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "dit: still loading its model")
        try:
            spec, conditioning = await self._receive(request_iterator)
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)

        runner = self.runner

        def work(emit: Callable[[object], None], cancel: threading.Event) -> None:
            def on_step(step: int, total: int) -> None:
                emit(stages_pb2.DenoiseProgress(step=step, total=total))

            latents, passes = runner.denoise_request(spec, conditioning, on_step, cancel.is_set)
            emit(passes)
            emit(latents)

        key = batch_key(spec, conditioning) if self.batcher is not None else None
        items = self.runtime.stream(work) if key is None else self.batcher.stream(spec, conditioning, key)
        try:
            async for item in items:
                if isinstance(item, stages_pb2.DenoiseProgress):
                    yield stages_pb2.DenoiseResponse(progress=item)
                    continue
                if isinstance(item, CachePasses):
                    passes = stages_pb2.TransformerPasses(run=item.run, skipped=item.skipped)
                    yield stages_pb2.DenoiseResponse(passes=passes)
                    continue
                # One tensor per latent frame, so the VAE can decode frame t while t+1 travels.
                for t in range(item.shape[2]):
                    for chunk in encode_tensor("latents", item[:, :, t : t + 1], index=t):
                        yield stages_pb2.DenoiseResponse(tensor=chunk)
        except GroupFailure as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"dit: {error}")
        except Exception as error:
            await abort_for(error, context, self.runtime.stage)


def parallel_config_from(args: argparse.Namespace) -> ParallelConfig:
    world = args.ulysses_degree * args.ring_degree * args.cfg_parallel_size * args.tensor_parallel_size
    shard = args.hsdp_shard_size
    if shard is None:
        shard = max(1, world // args.hsdp_replicate_size) if args.use_hsdp else 1
    return ParallelConfig(
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        cfg_degree=args.cfg_parallel_size,
        tp_degree=args.tensor_parallel_size,
        use_hsdp=args.use_hsdp,
        hsdp_shard_size=shard,
        hsdp_replicate_size=args.hsdp_replicate_size if args.use_hsdp else 1,
    )


def check_parallel_layout(args: argparse.Namespace) -> None:
    """Refuses an impossible layout, or one the checkpoint's family does not run, before anything loads."""
    config = parallel_config_from(args)
    transformer_config = json.loads((Path(args.model) / "transformer" / "config.json").read_text())
    devices = (
        torch.cuda.device_count()
        if args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
        else None
    )
    try:
        family = read_checkpoint(args.model).traits
    except CheckpointError:
        family = None  # the stage itself reports what is wrong with the checkpoint
    check_node_layout(args, config, devices)
    try:
        # Across nodes the devices of every node count; check_node_layout checked each node's share.
        config.validate(
            transformer_config["num_attention_heads"],
            available_devices=None if devices is None else devices * args.nnodes,
        )
        if family is not None:
            refuse_unsupported_methods(config, family)
    except ParallelConfigError as error:
        raise SystemExit(f"stagediff serve dit: {error}") from None


def _unreachable_from_other_nodes(args: argparse.Namespace) -> bool:
    """Node 0 binds loopback while the other nodes reach it at another address (another machine)."""
    return is_loopback(args.host) and not is_loopback(args.master_addr)


def check_node_layout(args: argparse.Namespace, config: ParallelConfig, devices: int | None = None) -> None:
    """Refuses node flags that cannot form a group (a SystemExit naming the flag and what is allowed)."""
    world, nnodes, node_rank = config.total_ranks, args.nnodes, args.node_rank
    problem = None
    if nnodes < 1:
        problem = f"--nnodes {nnodes}: must be at least 1"
    elif world % nnodes != 0:
        allowed = [n for n in range(1, world + 1) if world % n == 0]
        problem = (
            f"--nnodes {nnodes} does not divide the world size {world} (cfg x ring x ulysses x tp); "
            f"each node runs world size / nnodes ranks, so --nnodes must be one of {allowed}"
        )
    elif not 0 <= node_rank < nnodes:
        problem = f"--node-rank {node_rank}: allowed 0..{nnodes - 1} with --nnodes {nnodes}"
    elif devices is not None and world // nnodes > devices:
        problem = (
            f"each of the {nnodes} nodes runs {world // nnodes} ranks but {devices} devices are visible; "
            "raise --nnodes or make more devices visible (CUDA_VISIBLE_DEVICES)"
        )
    else:
        for flag, port in (("--master-port", args.master_port), ("--group-port", args.group_port)):
            if port is not None and not 1 <= port <= 65535:
                problem = f"{flag} {port}: allowed 1..65535"
        if nnodes > 1 and (args.master_port or DEFAULT_MASTER_PORT) == args.group_port:
            problem = f"--group-port {args.group_port}: must differ from --master-port (torch.distributed's store)"
        elif problem is None and nnodes > 1 and node_rank == 0 and _unreachable_from_other_nodes(args):
            problem = (
                f"--host {args.host}: node 0's control channel binds --host, which the other nodes cannot reach at "
                f"--master-addr {args.master_addr}; bind an address they can reach (0.0.0.0 in a container)"
            )
    if problem is None and nnodes > 1:
        try:
            secret = load_cluster_secret(args.cluster_secret_file)
        except ClusterSecretError as error:
            problem = str(error)
        else:
            if secret is None:
                problem = (
                    f"--nnodes {nnodes} needs the cluster secret (--cluster-secret-file or ${CLUSTER_SECRET_ENV}): "
                    "the nodes' control channel carries pickled work, which only the cluster may send"
                )
    if problem is not None:
        raise SystemExit(f"stagediff serve dit: {problem}")


def node_layout_from(args: argparse.Namespace) -> NodeLayout:
    """Where the group's ranks live, from the node flags (already checked by check_node_layout)."""
    if args.nnodes == 1:
        return NodeLayout(master_addr=args.master_addr, master_port=args.master_port)
    secret = load_cluster_secret(args.cluster_secret_file)
    if secret is None:
        raise ValueError("a group over several nodes needs the cluster secret")
    return NodeLayout(
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port or DEFAULT_MASTER_PORT,
        channel=ControlChannel(args.group_port, group_authkey(secret), bind_host=args.host),
    )


def model_options_from(args: argparse.Namespace) -> ModelOptions:
    """The memory options, refusing combinations that cannot work (a SystemExit naming the valid choices)."""
    try:
        offload = validate_offload_flags(
            args.enable_cpu_offload,
            args.enable_layerwise_offload,
            args.offload_blocks,
            tensor_parallel_size=args.tensor_parallel_size,
            use_hsdp=args.use_hsdp,
        )
        ignored = tuple(parse_ignored_layers(args.ignored_layers))
        _refuse_unsupported_options(args, args.quantization)
        quantization = quantization_for(args.quantization, Path(args.model), _transformer_components(args.model))
        if quantization != args.quantization:  # GGUF weights found in the checkpoint
            _refuse_unsupported_options(args, quantization)
        if ignored and quantization not in QUANTIZATION_METHODS:
            raise ValueError("--ignored-layers needs --quantization {fp8,int8} (a GGUF file chose its own layers)")
        if quantization and (args.tensor_parallel_size > 1 or args.use_hsdp):
            raise ValueError(
                f"--quantization {quantization} cannot be combined with --tensor-parallel-size or --use-hsdp: "
                "both shard the weights that quantization replaces; use sequence or CFG parallelism instead"
            )
        if quantization in QUANTIZATION_METHODS:
            names = linear_layer_names(_meta_transformer(args.model))
            validate_quantization_flags(quantization, ignored, names)
        if quantization == "gguf":
            for component in _transformer_components(args.model):
                folder = Path(args.model, component)
                check_gguf_file(gguf_file(folder), _transformer_class(args.model), folder)
        lora = lora_settings_from(args, quantization)
    except ValueError as error:
        raise SystemExit(f"stagediff serve dit: {error}") from None
    return ModelOptions(quantization, ignored, offload, args.offload_blocks, compile=args.compile, lora=lora)


def _transformer_components(model: str) -> tuple[str, ...]:
    """The checkpoint's transformer folders: "transformer", and "transformer_2" for two experts."""
    try:
        index = json.loads(Path(model, "model_index.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ("transformer",)  # the stage itself reports what is wrong with the checkpoint
    return ("transformer", "transformer_2") if (index.get("transformer_2") or [None, None])[1] else ("transformer",)


def lora_settings_from(args: argparse.Namespace, quantization: str | None) -> LoraSettings:
    """--lora-dir, its limits and --lora, refusing what cannot work (a ValueError naming the flag).

    `quantization`: the one the stage serves (--quantization, or "gguf" found in the checkpoint)."""
    directory = Path(args.lora_dir) if args.lora_dir else None
    fused = parse_fused(args.lora)
    if directory is None:
        if fused:
            raise ValueError("--lora needs --lora-dir, the directory its adapters are in")
        return LoraSettings()
    if not directory.is_dir():
        raise ValueError(f"--lora-dir {directory}: not a directory")
    for flag, value in (
        ("--lora-cache-bytes", args.lora_cache_bytes),
        ("--lora-max-file-bytes", args.lora_max_file_bytes),
    ):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if not 0 <= args.max_loras_per_request <= MAX_LORAS_PER_REQUEST:
        raise ValueError(
            f"--max-loras-per-request {args.max_loras_per_request}: allowed 0 (only --lora's fused adapters) to "
            f"{MAX_LORAS_PER_REQUEST}"
        )
    family = read_checkpoint(args.model).traits
    per_request = args.max_loras_per_request > 0
    for used, flag, feature in ((per_request, "--lora-dir", "lora"), (bool(fused), "--lora", "lora_fused")):
        if used and not family.support(feature).supported:
            raise ValueError(f"the {family.name} family does not support {flag}: {family.support(feature).reason}")
    if fused and quantization == "gguf":
        raise ValueError(
            "--lora cannot be combined with GGUF weights: the adapter is fused into full-precision weights, and a "
            "GGUF file's are packed; fuse it into the safetensors weights before converting them"
        )
    if fused and (args.tensor_parallel_size > 1 or args.use_hsdp):
        raise ValueError(
            "--lora cannot be combined with --tensor-parallel-size or --use-hsdp: those load each rank's shards of "
            "the weights, and the adapter is fused into whole weights"
        )
    for used, flag, feature in (
        (args.ulysses_degree > 1, "--ulysses-degree", "ulysses"),
        (args.ring_degree > 1, "--ring-degree", "ring"),
        (args.cfg_parallel_size > 1, "--cfg-parallel-size", "cfg_parallel"),
        (args.tensor_parallel_size > 1, "--tensor-parallel-size", "tensor_parallel"),
        (args.use_hsdp, "--use-hsdp", "hsdp"),
        (quantization == "fp8", "--quantization fp8", "fp8"),
        (quantization == "int8", "--quantization int8", "int8"),
        (quantization == "gguf", "--quantization gguf", "gguf"),
        (args.enable_cpu_offload, "--enable-cpu-offload", "cpu_offload"),
        (args.enable_layerwise_offload, "--enable-layerwise-offload", "layerwise_offload"),
        (args.compile, "--compile", "compile"),
    ):
        if used and per_request and not LORA_WITH[feature].supported:
            raise ValueError(
                f"--lora-dir (adapters per request) cannot be combined with {flag}: {LORA_WITH[feature].reason} "
                "(--max-loras-per-request 0 serves only the fused adapters)"
            )
    return LoraSettings(
        directory=directory,
        cache_bytes=args.lora_cache_bytes,
        max_file_bytes=args.lora_max_file_bytes,
        max_per_request=args.max_loras_per_request,
        fused=fused,
        pipeline=family.pipeline,
    )


def _refuse_unsupported_options(args: argparse.Namespace, quantization: str | None) -> None:
    """Refuses a memory option the checkpoint's family does not support, with the registry's reason."""
    try:
        family = read_checkpoint(args.model).traits
    except CheckpointError:
        return  # the stage itself reports what is wrong with the checkpoint
    for used, flag, feature in (
        (args.enable_cpu_offload, "--enable-cpu-offload", "cpu_offload"),
        (args.enable_layerwise_offload, "--enable-layerwise-offload", "layerwise_offload"),
        (quantization == "fp8", "--quantization fp8", "fp8"),
        (quantization == "int8", "--quantization int8", "int8"),
        (quantization == "gguf", "--quantization gguf", "gguf"),
        (args.compile, "--compile", "compile"),
    ):
        if used and not family.support(feature).supported:
            raise ValueError(f"the {family.name} family does not support {flag}: {family.support(feature).reason}")


def batching_from(args: argparse.Namespace) -> tuple[int, float]:
    """--max-batch-size and --batch-wait-ms, refusing values out of range or a family that does not batch."""
    size, wait_ms = args.max_batch_size, args.batch_wait_ms
    problem = None
    if not 1 <= size <= MAX_BATCH_SIZE:
        problem = f"--max-batch-size {size}: allowed 1 (no batching) to {MAX_BATCH_SIZE}"
    elif not 0 <= wait_ms <= MAX_BATCH_WAIT_MS:
        problem = f"--batch-wait-ms {wait_ms:g}: allowed 0 to {MAX_BATCH_WAIT_MS}"
    elif size > 1:
        try:
            family = read_checkpoint(args.model).traits
        except CheckpointError:
            family = None  # the stage itself reports what is wrong with the checkpoint
        if family is not None and not family.support("batching").supported:
            problem = (
                f"--max-batch-size {size}: the {family.name} family does not batch: {family.support('batching').reason}"
            )
    if problem is not None:
        raise SystemExit(f"stagediff serve dit: {problem}")
    return size, wait_ms


def step_cache_offer_from(args: argparse.Namespace) -> CacheOffer:
    """The step caches this stage offers (dit_svc/cache_offer.py), refusing a cache flag it cannot honour."""
    try:
        family = read_checkpoint(args.model).traits
    except CheckpointError:
        # The stage itself reports what is wrong with the checkpoint; nothing is offered without one.
        return CacheOffer({}, stages_pb2.StepCache(method="none"))
    try:
        return cache_offer_from(args, family, _transformer_components(args.model))
    except ValueError as error:
        raise SystemExit(f"stagediff serve dit: {error}") from None


def _transformer_class(model: str) -> type[torch.nn.Module]:
    index = json.loads((Path(model) / "model_index.json").read_text())
    return getattr(diffusers, index["transformer"][1])


def _meta_transformer(model: str) -> torch.nn.Module:
    """The transformer's module tree without its weights, to check layer names before loading."""
    model_class = _transformer_class(model)
    with torch.device("meta"):
        return model_class.from_config(model_class.load_config(Path(model) / "transformer"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(build_parser(), argv)
    if Path(args.model, "transformer", "config.json").is_file():
        check_parallel_layout(args)
        step_cache_offer_from(args)
        batching_from(args)
    else:
        check_node_layout(args, parallel_config_from(args))
    if args.node_rank > 0:  # a follower machine of a multi-node group: node 0 serves the stage
        mag_ratios = step_cache_offer_from(args).mag_ratios
        serve_dit_node(args, parallel_config_from(args), model_options_from(args), node_layout_from(args), mag_ratios)
        return
    run_stage("dit", args, DenoiserServicer)


if __name__ == "__main__":
    main()
