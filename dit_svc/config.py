"""The DiT stage's configuration: one frozen `DitConfig`, built and checked once at startup.

`DitConfig.from_args(args)` is the one reader of `stagediff serve dit`'s parsed options (dit_svc/options.py declares
them): it reads the checkpoint's traits once, checks every flag against them (dit_svc/config_checks.py) and
refuses a bad one with a one-line exit naming the flag and what is allowed, before anything loads. `main()`
hands its sections down: `DenoiserBuild` to every rank's denoiser, the node layout to the rank group, the
step cache offer and batching to the servicer. Nothing below `main()` reads the options themselves.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dit_svc.batching import MAX_BATCH_SIZE, MAX_BATCH_WAIT_MS
from dit_svc.cache_offer import CacheOffer, cache_offer_from
from dit_svc.config_checks import (
    LoraFlags,
    check_batching,
    check_continuous_batching,
    check_node_layout,
    check_parallel_layout,
    model_options,
    transformer_components,
)
from dit_svc.model_options import ModelOptions
from dit_svc.options import DEFAULT_MASTER_PORT, GROWTH_CHOICES
from families.base import Family
from services.checkpoint import CheckpointError, CheckpointSpec, read_checkpoint
from services.rank_group import ControlChannel, NodeLayout, group_authkey
from stagediff.v1 import stages_pb2
from stagekit.parallel import ParallelConfig


@dataclass(frozen=True)
class CheckpointTraits:
    """What the options are checked against, read from the checkpoint once."""

    path: Path
    """--model, as given."""
    spec: CheckpointSpec | None
    """The checkpoint as read (the stage's StageConfig takes it too); None when it cannot be read."""
    error: str | None
    """Why the checkpoint cannot be read (the stage's exit names it), None when it can."""
    experts: tuple[str, ...]
    """The transformer folders: "transformer", and "transformer_2" for two experts."""
    attention_heads: int | None
    """The transformer's attention heads, which a parallel layout must divide; None without its config."""

    @property
    def family(self) -> Family | None:
        """The checkpoint's family (its features and the reasons for those it lacks); None when unreadable."""
        return self.spec.traits if self.spec is not None else None

    @classmethod
    def read(cls, model: str, model_name: str | None = None) -> CheckpointTraits:
        path = Path(model)
        try:
            spec, error = read_checkpoint(model, model_name), None
        except CheckpointError as problem:
            spec, error = None, str(problem)
        heads = spec.attention_heads if spec is not None else None
        return cls(path, spec, error, transformer_components(path), heads)


@dataclass(frozen=True)
class Batching:
    """How concurrent requests are batched (dit_svc/batching.py)."""

    max_batch_size: int = 1
    """Requests in one batch, 1 (no batching) to MAX_BATCH_SIZE."""
    batch_wait_ms: float = 10.0
    """How long a request waits for partners before its batch starts, 0 to MAX_BATCH_WAIT_MS."""
    continuous: bool = False
    """--continuous-batching: up to max_batch_size requests share each step, joining and leaving at step
    boundaries (dit_svc/step_engine.py); batch_wait_ms is not used."""
    growth: str = "measured"
    """--batch-growth: how far a continuous batch grows, "measured" (while a row's share of a step falls,
    dit_svc/batch_growth.py) or "full" (to max_batch_size)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"--max-batch-size {self.max_batch_size}: allowed 1 (no batching) to {MAX_BATCH_SIZE}")
        if not 0 <= self.batch_wait_ms <= MAX_BATCH_WAIT_MS:
            raise ValueError(f"--batch-wait-ms {self.batch_wait_ms:g}: allowed 0 to {MAX_BATCH_WAIT_MS}")
        if self.continuous and self.max_batch_size < 2:
            raise ValueError(
                "--continuous-batching needs --max-batch-size N with N > 1: the most requests that share a step"
            )
        if self.growth not in GROWTH_CHOICES:
            raise ValueError(f"--batch-growth {self.growth!r}: allowed {', '.join(GROWTH_CHOICES)}")
        if self.growth != "measured" and not self.continuous:
            raise ValueError(f"--batch-growth {self.growth}: only with --continuous-batching")

    @property
    def step_slots(self) -> int:
        """How many requests the step engine steps at once: max_batch_size with continuous batching, else 1."""
        return self.max_batch_size if self.continuous else 1


@dataclass(frozen=True)
class DenoiserBuild:
    """What every rank builds the family's denoiser from (dit_svc/denoise.py make_denoiser)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The group's parallel layout (one rank: the default)."""
    options: ModelOptions = field(default_factory=ModelOptions)
    """Quantization, offload, compilation and LoRA of the transformer(s)."""
    load_threads: int = 4
    """Threads that read the weights (--num-weight-load-threads; 1 with --disable-multithread-weight-load)."""


@dataclass(frozen=True)
class DitConfig:
    """The DiT stage's checked configuration."""

    checkpoint: CheckpointTraits
    """The checkpoint's traits, read once."""
    build: DenoiserBuild
    """Parallel layout, model options and load threads of every rank's denoiser."""
    layout: NodeLayout
    """Where the group's ranks live (one node unless --nnodes)."""
    node_rank: int
    """This machine's index in the group; node 0 serves the stage."""
    threads: int
    """Intra-op threads of each rank (--threads; 0: torch's default)."""
    batching: Batching
    """--max-batch-size, --batch-wait-ms and --continuous-batching."""
    step_cache: CacheOffer
    """The step caches offered and the default one."""

    @property
    def parallel(self) -> ParallelConfig:
        return self.build.parallel

    @property
    def options(self) -> ModelOptions:
        return self.build.options

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DitConfig:
        """The stage's configuration from its parsed options; a bad flag exits naming it and what is allowed."""
        try:
            return cls.from_options(args)
        except ValueError as error:  # ParallelConfigError and CheckpointError included
            raise SystemExit(f"stagediff serve dit: {error}") from None

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> DitConfig:
        """The stage's configuration from its parsed options; a bad flag raises ValueError naming it."""
        checkpoint = CheckpointTraits.read(args.model, args.model_name)
        family = checkpoint.family
        parallel = parallel_config(
            ulysses_degree=args.ulysses_degree,
            ring_degree=args.ring_degree,
            cfg_parallel_size=args.cfg_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size,
            use_hsdp=args.use_hsdp,
            hsdp_shard_size=args.hsdp_shard_size,
            hsdp_replicate_size=args.hsdp_replicate_size,
        )
        devices = _visible_devices(args.device) if checkpoint.attention_heads is not None else None
        secret = check_node_layout(
            parallel,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            group_port=args.group_port,
            host=args.host,
            cluster_secret_file=args.cluster_secret_file,
            devices=devices,
        )
        if checkpoint.attention_heads is not None:
            check_parallel_layout(parallel, checkpoint.attention_heads, family, devices, args.nnodes)
        if family is None:  # nothing is offered without a checkpoint
            step_cache = CacheOffer({}, stages_pb2.StepCache(method="none"))
        else:
            step_cache = cache_offer_from(
                family,
                checkpoint.experts,
                model=checkpoint.path,
                backend=args.cache_backend,
                threshold=args.cache_threshold,
                mag_ratios_file=args.cache_mag_ratios,
            )
        batching = Batching(args.max_batch_size, args.batch_wait_ms, args.continuous_batching, args.batch_growth)
        check_batching(batching.max_batch_size, family)
        if batching.continuous:
            check_continuous_batching(parallel, family)
        if checkpoint.error is not None:  # the message the stage gives for a checkpoint it cannot read
            raise CheckpointError(checkpoint.error)
        options = model_options(
            checkpoint.path,
            checkpoint.experts,
            family,
            parallel,
            quantization=args.quantization,
            ignored_layers=args.ignored_layers,
            enable_cpu_offload=args.enable_cpu_offload,
            enable_layerwise_offload=args.enable_layerwise_offload,
            offload_blocks=args.offload_blocks,
            compile=args.compile,
            lora=LoraFlags(
                directory=Path(args.lora_dir) if args.lora_dir else None,
                fused=tuple(args.lora),
                cache_bytes=args.lora_cache_bytes,
                max_file_bytes=args.lora_max_file_bytes,
                max_per_request=args.max_loras_per_request,
            ),
        )
        if args.nnodes == 1:
            layout = NodeLayout(master_addr=args.master_addr, master_port=args.master_port)
        elif secret is None:
            raise ValueError("a group over several nodes needs the cluster secret")
        else:
            layout = NodeLayout(
                nnodes=args.nnodes,
                node_rank=args.node_rank,
                master_addr=args.master_addr,
                master_port=args.master_port or DEFAULT_MASTER_PORT,
                channel=ControlChannel(args.group_port, group_authkey(secret), bind_host=args.host),
            )
        load_threads = 1 if args.disable_multithread_weight_load else args.num_weight_load_threads
        return cls(
            checkpoint=checkpoint,
            build=DenoiserBuild(parallel, options, load_threads),
            layout=layout,
            node_rank=args.node_rank,
            threads=args.threads,
            batching=batching,
            step_cache=step_cache,
        )


def parallel_config(
    *,
    ulysses_degree: int = 1,
    ring_degree: int = 1,
    cfg_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    use_hsdp: bool = False,
    hsdp_shard_size: int | None = None,
    hsdp_replicate_size: int = 1,
) -> ParallelConfig:
    """The layout the parallel flags name (checked against the checkpoint by `DitConfig.from_options`)."""
    world = ulysses_degree * ring_degree * cfg_parallel_size * tensor_parallel_size
    shard = hsdp_shard_size
    if shard is None:
        shard = max(1, world // hsdp_replicate_size) if use_hsdp else 1
    return ParallelConfig(
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        cfg_degree=cfg_parallel_size,
        tp_degree=tensor_parallel_size,
        use_hsdp=use_hsdp,
        hsdp_shard_size=shard,
        hsdp_replicate_size=hsdp_replicate_size if use_hsdp else 1,
    )


def _visible_devices(device: str) -> int | None:
    """The CUDA devices a group may use, None on the CPU (any number of processes)."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.device_count()
    return None
