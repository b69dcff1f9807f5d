"""The checks behind `DitConfig` (dit_svc/config.py): each refuses flags that cannot work, before anything loads.

Each check takes typed values and raises ValueError naming the flag and what is allowed; `DitConfig.from_args` turns
it into the stage's one-line exit. `FEATURE_FLAGS` is the one table from flags to the registry's features
(families/base.py): the family's own support and LoRA's (`LORA_WITH`) are both read through it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dit_svc.lora import LoraSettings, parse_fused
from dit_svc.model_options import ModelOptions
from dit_svc.options import DEFAULT_MASTER_PORT
from dit_svc.quantization import METHODS as QUANTIZATION_METHODS
from dit_svc.quantization import linear_layer_names, parse_ignored_layers, validate_quantization_flags
from families.base import LORA_WITH, Family
from services.auth import CLUSTER_SECRET_ENV, ClusterSecretError, load_cluster_secret
from services.server import is_loopback
from services.validation import MAX_LORAS_PER_REQUEST
from stagekit.gguf import check_gguf_file, gguf_file, quantization_for
from stagekit.parallel import ParallelConfig
from stagekit.parallel.mesh import refuse_unsupported_methods

# (flag, feature): parallel methods first, then the memory and speed options (the family's refusals read
# only these, in this order).
FEATURE_FLAGS: tuple[tuple[str, str], ...] = (
    ("--ulysses-degree", "ulysses"),
    ("--ring-degree", "ring"),
    ("--cfg-parallel-size", "cfg_parallel"),
    ("--tensor-parallel-size", "tensor_parallel"),
    ("--use-hsdp", "hsdp"),
    ("--quantization fp8", "fp8"),
    ("--quantization int8", "int8"),
    ("--quantization gguf", "gguf"),
    ("--enable-cpu-offload", "cpu_offload"),
    ("--enable-layerwise-offload", "layerwise_offload"),
    ("--compile", "compile"),
)
PARALLEL_FEATURES = frozenset({"ulysses", "ring", "cfg_parallel", "tensor_parallel", "hsdp"})


def used_features(
    parallel: ParallelConfig, quantization: str | None, offload: str | None, compile: bool
) -> Iterator[tuple[str, str]]:
    """The (flag, feature) pairs of FEATURE_FLAGS the stage's options use, in the table's order."""
    used = {
        "ulysses": parallel.ulysses_degree > 1,
        "ring": parallel.ring_degree > 1,
        "cfg_parallel": parallel.cfg_degree > 1,
        "tensor_parallel": parallel.tp_degree > 1,
        "hsdp": parallel.use_hsdp,
        "fp8": quantization == "fp8",
        "int8": quantization == "int8",
        "gguf": quantization == "gguf",
        "cpu_offload": offload == "module",
        "layerwise_offload": offload == "layerwise",
        "compile": compile,
    }
    return ((flag, feature) for flag, feature in FEATURE_FLAGS if used[feature])


def validate_offload_flags(
    enable_cpu_offload: bool,
    enable_layerwise_offload: bool,
    offload_blocks: int = 1,
    tensor_parallel_size: int = 1,
    use_hsdp: bool = False,
) -> str | None:
    """The offload mode the flags ask for ("module", "layerwise" or None); refuses combinations that cannot work.

    Offload moves whole parameters between host and device, while tensor parallelism and
    HSDP replace them with DTensor shards that every rank's collectives expect on the device.
    """
    if offload_blocks < 1:
        raise ValueError(f"--offload-blocks: {offload_blocks} is not allowed; use 1 or more blocks")
    if enable_cpu_offload and enable_layerwise_offload:
        raise ValueError(
            "--enable-cpu-offload and --enable-layerwise-offload cannot be combined: module-wise offload moves "
            "whole models, layerwise offload moves blocks of one model; choose one"
        )
    mode = "module" if enable_cpu_offload else "layerwise" if enable_layerwise_offload else None
    if mode is None:
        return None
    flag = "--enable-cpu-offload" if mode == "module" else "--enable-layerwise-offload"
    if tensor_parallel_size > 1:
        raise ValueError(
            f"{flag} cannot be combined with --tensor-parallel-size {tensor_parallel_size}: tensor-parallel weights "
            "are DTensor shards whose collectives need them on the device; use sequence or CFG parallelism instead"
        )
    if use_hsdp:
        raise ValueError(
            f"{flag} cannot be combined with --use-hsdp: HSDP already shards the weights across ranks and gathers "
            "them on the device for each block; use one or the other"
        )
    return mode


def transformer_components(model: Path) -> tuple[str, ...]:
    """The checkpoint's transformer folders: "transformer", and "transformer_2" for two experts."""
    try:
        index = json.loads((model / "model_index.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ("transformer",)  # the stage itself reports what is wrong with the checkpoint
    return ("transformer", "transformer_2") if (index.get("transformer_2") or [None, None])[1] else ("transformer",)


def transformer_class(model: Path) -> type[torch.nn.Module]:
    import diffusers

    index = json.loads((model / "model_index.json").read_text())
    model_class: type[torch.nn.Module] = getattr(diffusers, index["transformer"][1])
    return model_class


def meta_transformer(model: Path) -> torch.nn.Module:
    """The transformer's module tree without its weights, to check layer names before loading."""
    model_class = transformer_class(model)
    with torch.device("meta"):
        module: torch.nn.Module = model_class.from_config(model_class.load_config(model / "transformer"))
    return module


def check_parallel_layout(
    parallel: ParallelConfig, attention_heads: int, family: Family | None, devices: int | None, nnodes: int
) -> None:
    """Refuses an impossible layout, or one the checkpoint's family does not run (ParallelConfigError)."""
    # Across nodes the devices of every node count; check_node_layout checked each node's share.
    parallel.validate(attention_heads, available_devices=None if devices is None else devices * nnodes)
    if family is not None:
        refuse_unsupported_methods(parallel, family)


def check_node_layout(
    parallel: ParallelConfig,
    *,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int | None,
    group_port: int,
    host: str,
    cluster_secret_file: str | None,
    devices: int | None = None,
) -> str | None:
    """Refuses node flags that cannot form a group; the cluster secret a group over several nodes uses."""
    world = parallel.total_ranks
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
        for flag, port in (("--master-port", master_port), ("--group-port", group_port)):
            if port is not None and not 1 <= port <= 65535:
                problem = f"{flag} {port}: allowed 1..65535"
        if nnodes > 1 and (master_port or DEFAULT_MASTER_PORT) == group_port:
            problem = f"--group-port {group_port}: must differ from --master-port (torch.distributed's store)"
        elif problem is None and nnodes > 1 and node_rank == 0 and is_loopback(host) and not is_loopback(master_addr):
            # Node 0's control channel binds --host: loopback cannot be reached from another machine.
            problem = (
                f"--host {host}: node 0's control channel binds --host, which the other nodes cannot reach at "
                f"--master-addr {master_addr}; bind an address they can reach (0.0.0.0 in a container)"
            )
    if problem is not None:
        raise ValueError(problem)
    if nnodes == 1:
        return None
    try:
        secret = load_cluster_secret(cluster_secret_file)
    except ClusterSecretError as error:
        raise ValueError(str(error)) from None
    if secret is None:
        raise ValueError(
            f"--nnodes {nnodes} needs the cluster secret (--cluster-secret-file or ${CLUSTER_SECRET_ENV}): "
            "the nodes' control channel carries pickled work, which only the cluster may send"
        )
    return secret


def check_batching(max_batch_size: int, family: Family | None) -> None:
    """Refuses batching for a family that does not batch (the sizes are checked by `Batching`)."""
    if max_batch_size > 1 and family is not None and not family.support("batching").supported:
        raise ValueError(
            f"--max-batch-size {max_batch_size}: the {family.name} family does not batch: "
            f"{family.support('batching').reason}"
        )


def check_continuous_batching(parallel: ParallelConfig, family: Family | None) -> None:
    """Refuses --continuous-batching where the stage cannot step requests: a rank group (its ranks run each
    request's loop in step with rank 0's), or a family whose loop is not written as steps
    (stagekit/denoise_steps.py)."""
    if parallel.total_ranks > 1:
        raise ValueError(
            f"--continuous-batching: a rank group ({parallel.total_ranks} ranks) runs each request's loop whole; "
            "continuous batching steps requests on one rank (drop the parallel flags or --continuous-batching)"
        )
    if family is not None and getattr(family.load("denoiser"), "runs_steps", False) is not True:
        raise ValueError(
            f"--continuous-batching: the {family.name} family's denoising loop is not written as steps, so its "
            "requests cannot join a running batch; use --max-batch-size alone (request batching)"
        )


def refuse_unsupported_options(
    family: Family | None, parallel: ParallelConfig, quantization: str | None, offload: str | None, compile: bool
) -> None:
    """Refuses a memory or speed option the checkpoint's family does not support, with the registry's reason."""
    if family is None:
        return  # the stage itself reports what is wrong with the checkpoint
    for flag, feature in used_features(parallel, quantization, offload, compile):
        if feature not in PARALLEL_FEATURES and not family.support(feature).supported:
            raise ValueError(f"the {family.name} family does not support {flag}: {family.support(feature).reason}")


@dataclass(frozen=True)
class LoraFlags:
    """--lora-dir, its limits and --lora as given (dit_svc/options.py), checked by `lora_settings`."""

    directory: Path | None
    """--lora-dir: the adapters requests name, None without it."""
    fused: tuple[str, ...]
    """--lora: NAME[:SCALE] of each adapter fused in at startup."""
    cache_bytes: int
    """--lora-cache-bytes: bytes of loaded adapters each rank keeps."""
    max_file_bytes: int
    """--lora-max-file-bytes: the largest adapter file read."""
    max_per_request: int
    """--max-loras-per-request: adapters one request may apply (0: only the fused ones)."""


def model_options(
    model: Path,
    experts: tuple[str, ...],
    family: Family | None,
    parallel: ParallelConfig,
    *,
    quantization: str | None,
    ignored_layers: str,
    enable_cpu_offload: bool,
    enable_layerwise_offload: bool,
    offload_blocks: int,
    compile: bool,
    lora: LoraFlags,
) -> ModelOptions:
    """The memory options, refusing combinations that cannot work (ValueError naming the valid choices)."""
    tp, hsdp = parallel.tp_degree, parallel.use_hsdp
    offload = validate_offload_flags(
        enable_cpu_offload, enable_layerwise_offload, offload_blocks, tensor_parallel_size=tp, use_hsdp=hsdp
    )
    ignored = tuple(parse_ignored_layers(ignored_layers))
    refuse_unsupported_options(family, parallel, quantization, offload, compile)
    served = quantization_for(quantization, model, experts)
    if served != quantization:  # GGUF weights found in the checkpoint
        refuse_unsupported_options(family, parallel, served, offload, compile)
    if ignored and served not in QUANTIZATION_METHODS:
        raise ValueError("--ignored-layers needs --quantization {fp8,int8} (a GGUF file chose its own layers)")
    if served and (tp > 1 or hsdp):
        raise ValueError(
            f"--quantization {served} cannot be combined with --tensor-parallel-size or --use-hsdp: "
            "both shard the weights that quantization replaces; use sequence or CFG parallelism instead"
        )
    if served in QUANTIZATION_METHODS:
        validate_quantization_flags(served, ignored, linear_layer_names(meta_transformer(model)))
    if served == "gguf":
        for component in experts:
            check_gguf_file(gguf_file(model / component), transformer_class(model), model / component)
    settings = lora_settings(lora, family, parallel, served, offload, compile)
    return ModelOptions(served, ignored, offload, offload_blocks, compile=compile, lora=settings)


def lora_settings(
    flags: LoraFlags,
    family: Family | None,
    parallel: ParallelConfig,
    quantization: str | None,
    offload: str | None,
    compile: bool,
) -> LoraSettings:
    """The adapters the stage serves, refusing what cannot work (a ValueError naming the flag).

    `quantization`: the one the stage serves (--quantization, or "gguf" found in the checkpoint)."""
    directory, fused = flags.directory, parse_fused(list(flags.fused))
    if directory is None:
        if fused:
            raise ValueError("--lora needs --lora-dir, the directory its adapters are in")
        return LoraSettings()
    if not directory.is_dir():
        raise ValueError(f"--lora-dir {directory}: not a directory")
    for flag, value in (("--lora-cache-bytes", flags.cache_bytes), ("--lora-max-file-bytes", flags.max_file_bytes)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if not 0 <= flags.max_per_request <= MAX_LORAS_PER_REQUEST:
        raise ValueError(
            f"--max-loras-per-request {flags.max_per_request}: allowed 0 (only --lora's fused adapters) to "
            f"{MAX_LORAS_PER_REQUEST}"
        )
    if family is None:
        raise ValueError("the checkpoint cannot be read")  # DitConfig.from_options reports the checkpoint's error first
    per_request = flags.max_per_request > 0
    for used, flag, feature in ((per_request, "--lora-dir", "lora"), (bool(fused), "--lora", "lora_fused")):
        if used and not family.support(feature).supported:
            raise ValueError(f"the {family.name} family does not support {flag}: {family.support(feature).reason}")
    if fused and quantization == "gguf":
        raise ValueError(
            "--lora cannot be combined with GGUF weights: the adapter is fused into full-precision weights, and a "
            "GGUF file's are packed; fuse it into the safetensors weights before converting them"
        )
    if fused and (parallel.tp_degree > 1 or parallel.use_hsdp):
        raise ValueError(
            "--lora cannot be combined with --tensor-parallel-size or --use-hsdp: those load each rank's shards of "
            "the weights, and the adapter is fused into whole weights"
        )
    for flag, feature in used_features(parallel, quantization, offload, compile):
        if per_request and not LORA_WITH[feature].supported:
            raise ValueError(
                f"--lora-dir (adapters per request) cannot be combined with {flag}: {LORA_WITH[feature].reason} "
                "(--max-loras-per-request 0 serves only the fused adapters)"
            )
    return LoraSettings(
        directory=directory,
        cache_bytes=flags.cache_bytes,
        max_file_bytes=flags.max_file_bytes,
        max_per_request=flags.max_per_request,
        fused=fused,
        pipeline=family.lora_loader or family.pipeline,
    )
