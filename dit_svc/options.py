"""The options of `stagediff serve dit` (no torch here: `stagediff up` and the tests read them)."""

from __future__ import annotations

import argparse

from families.base import CACHE_METHODS, DEFAULT_CACHE_THRESHOLDS
from services.environment_options import OptionParser
from services.stage_options import add_stage_kind_arguments, stage_parser

# --batch-growth (dit_svc/batch_growth.py): "measured" grows a continuous batch while a row's share of a step falls.
GROWTH_CHOICES = ("measured", "full")

# torchrun's defaults for the store; the control channel of a multi-node group takes the next port.
DEFAULT_MASTER_PORT = 29500
DEFAULT_GROUP_PORT = 29501
# LoRA adapters (dit_svc/lora/): bytes of loaded adapters each rank keeps, the largest adapter file it reads,
# and the adapters one request may apply.
DEFAULT_LORA_CACHE_BYTES = 4 * 1024**3
DEFAULT_LORA_MAX_FILE_BYTES = 2 * 1024**3
DEFAULT_MAX_LORAS_PER_REQUEST = 4


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism", "the world size is cfg x ring x ulysses x tp")
    group.add_argument("--ulysses-degree", "--usp", type=int, default=1, help="Ulysses sequence parallel degree")
    group.add_argument("--ring-degree", "--ring", type=int, default=1, help="Ring attention degree")
    group.add_argument("--cfg-parallel-size", type=int, default=1, choices=[1, 2], help="one rank group per branch")
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="attention heads and MLP sharded")
    group.add_argument("--use-hsdp", action="store_true", help="shard each block's weights with FSDP2")
    group.add_argument("--hsdp-shard-size", type=int, default=None, help="ranks a weight is sharded over")
    group.add_argument("--hsdp-replicate-size", type=int, default=1, help="replicas of the sharded weights")
    nodes = parser.add_argument_group(
        "nodes",
        "one group over several machines, as torchrun's static rendezvous: start the same command on each with "
        "its --node-rank; node r runs ranks r*L..r*L+L-1 (L = world size / nnodes); node 0 serves the stage",
    )
    nodes.add_argument("--nnodes", type=int, default=1, help="machines the group spans (default 1)")
    nodes.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1 (default 0)")
    nodes.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (default 127.0.0.1)")
    nodes.add_argument(
        "--master-port",
        type=int,
        default=None,
        help=f"torch.distributed's TCP store on node 0 (default {DEFAULT_MASTER_PORT}; on one node a free port)",
    )
    nodes.add_argument(
        "--group-port",
        type=int,
        default=DEFAULT_GROUP_PORT,
        help=f"node 0's control channel, which the other nodes connect to (default {DEFAULT_GROUP_PORT})",
    )


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("memory", "quantization and CPU offload of the transformer(s)")
    group.add_argument(
        "--quantization",
        choices=["fp8", "int8", "gguf"],
        default=None,
        help="fp8, int8: weight-only, per output channel; gguf: the .gguf file in the transformer folder, "
        "dequantized on the fly to the stage's compute dtype (chosen by itself when the folder holds only a .gguf "
        "file)",
    )
    group.add_argument(
        "--ignored-layers",
        default="",
        help="comma-separated linear layer names or patterns kept in full precision (fp8, int8)",
    )
    group.add_argument("--enable-cpu-offload", action="store_true", help="experts wait in CPU memory when not in use")
    group.add_argument(
        "--enable-layerwise-offload", action="store_true", help="blocks stream to the device one group at a time"
    )
    group.add_argument("--offload-blocks", type=int, default=1, help="blocks resident at once with layerwise offload")


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speed", "compilation of the transformer(s); the first request compiles")
    group.add_argument(
        "--compile", action="store_true", help="torch.compile each repeated transformer block (regional compilation)"
    )


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "step cache", "the cache of a request that names none (GenerateRequest.cache); requests may name another"
    )
    group.add_argument(
        "--cache-backend", choices=CACHE_METHODS, default="none", help="default step cache (default: none)"
    )
    defaults = ", ".join(f"{method} {value:g}" for method, value in DEFAULT_CACHE_THRESHOLDS.items())
    group.add_argument(
        "--cache-threshold", type=float, default=None, help=f"its threshold; higher skips more (default: {defaults})"
    )
    group.add_argument(
        "--cache-mag-ratios",
        default=None,
        help="MagCache's ratios, from `stagediff calibrate-cache` (default: mag_ratios.json in the checkpoint, "
        "when present; without ratios the mag method is not offered)",
    )


def add_batching_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "batching",
        "concurrent requests of the same size, frames, steps and guidance branches denoised as one batch "
        "(dit_svc/batching.py); requests with a step cache run alone",
    )
    group.add_argument(
        "--max-batch-size", type=int, default=1, help="requests in one batch (default 1: no batching; at most 64)"
    )
    group.add_argument(
        "--batch-wait-ms",
        type=float,
        default=10.0,
        help="how long a request waits for partners before its batch starts (default 10; at most 10000)",
    )
    group.add_argument(
        "--continuous-batching",
        action="store_true",
        help="step up to --max-batch-size requests together, a new one joining at the next step boundary, each "
        "at its own step (families whose loop runs as steps, one rank; --batch-wait-ms is not used)",
    )
    group.add_argument(
        "--batch-growth",
        choices=GROWTH_CHOICES,
        default="measured",
        help="with --continuous-batching, how far a batch of one shape grows: 'measured' (default) while a row's "
        "measured share of a step keeps falling; 'full' to --max-batch-size whatever a row costs",
    )


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "LoRA",
        "adapters applied per request (GenerateRequest.loras), each loaded on first use and kept in an LRU, or "
        "fused into the base at startup (--lora); the tenants file says which adapters each tenant may use",
    )
    group.add_argument(
        "--lora-dir",
        default=None,
        help="directory of adapters: NAME.safetensors for the adapter NAME, TENANT/NAME.safetensors for one "
        "private to TENANT (default: none; requests naming adapters are refused)",
    )
    group.add_argument(
        "--lora-cache-bytes",
        type=int,
        default=DEFAULT_LORA_CACHE_BYTES,
        help="bytes of adapters kept loaded on each rank, the least recently used evicted "
        f"(default {DEFAULT_LORA_CACHE_BYTES})",
    )
    group.add_argument(
        "--lora-max-file-bytes",
        type=int,
        default=DEFAULT_LORA_MAX_FILE_BYTES,
        help=f"largest adapter file read (default {DEFAULT_LORA_MAX_FILE_BYTES})",
    )
    group.add_argument(
        "--max-loras-per-request",
        type=int,
        default=DEFAULT_MAX_LORAS_PER_REQUEST,
        help=f"adapters one request may apply at once (default {DEFAULT_MAX_LORAS_PER_REQUEST}; 0: only the "
        "fused ones of --lora)",
    )
    group.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME[:SCALE]",
        help="fuse an adapter of --lora-dir into the base weights at startup, at SCALE (default 1); repeatable. "
        "The model is served as MODEL+NAME, at no cost per step (few-step distillation adapters)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_kind_arguments(parser, "dit")
    add_parallel_arguments(parser)
    add_memory_arguments(parser)
    add_speed_arguments(parser)
    add_cache_arguments(parser)
    add_batching_arguments(parser)
    add_lora_arguments(parser)


def build_parser() -> OptionParser:
    parser = stage_parser("dit")
    add_arguments(parser)
    return parser
