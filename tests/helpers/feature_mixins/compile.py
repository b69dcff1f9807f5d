"""Regional compilation (`--compile`, dit_svc/compile.py): CompileTesterMixin.

The check builds the family's denoiser as the DiT stage does, runs the config's `compile_specs` eagerly,
compiles the blocks and runs the same requests again; the latents must equal the eager ones within fp32
tolerance. Inductor compiles on CPU with g++, so this is the CPU path of the flag. The first
COMPILING_REQUESTS requests bring every variant of structure that dynamo compiles; the others have sizes
and text lengths not seen before and must compile nothing more: recompilation is bounded by structure, not
by request size. One rank's run is made once per checkpoint and shared by the mixin's tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from dit_svc.compile import compile_repeated_blocks
from stagekit.parallel import ParallelConfig
from tests.helpers.feature_mixins.base import FamilyTesterConfig

TOLERANCE = 1e-4
COMPILING_REQUESTS = 2

_ONE_RANK: dict[tuple[str, str], dict[str, Any]] = {}


def eager_then_compiled(config: FamilyTesterConfig, model_dir: Path, parallel: ParallelConfig | None = None) -> dict:
    """Every request's latents eager and compiled, the blocks compiled, and the graphs dynamo had compiled
    after each compiled request."""
    torch._dynamo.reset()
    denoiser = config.build_denoiser(model_dir, torch.float32, parallel=parallel)

    def denoise(index: int) -> torch.Tensor:
        spec = config.compile_specs[index]
        return config.denoised(denoiser, spec, config.compile_conditioning(denoiser, index))

    eager = [denoise(index) for index in range(len(config.compile_specs))]
    listed = sum(
        len(getattr(expert, name))
        for expert in denoiser.experts
        for name in (config.blocks_attribute, *config.more_block_lists)
    ) + len(config.more_repeated_modules) * len(denoiser.experts)
    blocks = compile_repeated_blocks(denoiser.experts)
    graphs_before = counters["stats"]["unique_graphs"]
    compiled, graphs = [], []
    for index in range(len(config.compile_specs)):
        compiled.append(denoise(index))
        graphs.append(counters["stats"]["unique_graphs"] - graphs_before)
    return {"blocks": blocks, "listed_blocks": listed, "eager": eager, "compiled": compiled, "graphs": graphs}


def max_differences(result: dict) -> list[float]:
    return [
        (compiled - eager).abs().max().item()
        for compiled, eager in zip(result["compiled"], result["eager"], strict=True)
    ]


def compiles_nothing_more(graphs: list[int]) -> bool:
    """The graphs compiled after each request stay at what the first COMPILING_REQUESTS ones brought."""
    return all(count == graphs[COMPILING_REQUESTS - 1] for count in graphs[COMPILING_REQUESTS:])


def one_rank_compiled(config: FamilyTesterConfig, model_dir: Path) -> dict:
    """`eager_then_compiled` on one rank, once per checkpoint."""
    key = (config.family, str(model_dir))
    if key not in _ONE_RANK:
        _ONE_RANK[key] = eager_then_compiled(config, model_dir)
    return _ONE_RANK[key]


class CompileTesterMixin:
    """`--compile` on one rank: the compiled blocks (every repeated block of each expert) give the eager
    latents of every request of `compile_specs`, and requests of new sizes and text lengths compile nothing
    more."""

    def test_compiled_blocks_equal_eager(self: Any, model_dir: Path) -> None:
        result = one_rank_compiled(self, model_dir)
        # Every block of the config's block lists (FLUX's double- and single-stream ones alike), and no other.
        assert result["blocks"] == result["listed_blocks"] > 0, result["blocks"]
        assert result["graphs"][0] > 0, "nothing was compiled"
        assert all(eager.abs().max() > 0.1 for eager in result["eager"])
        differences = max_differences(result)
        print(f"{self.family} one rank: max abs diff per request {differences}, graphs {result['graphs']}")
        assert max(differences) <= TOLERANCE, differences

    def test_new_request_sizes_compile_nothing_more(self: Any, model_dir: Path) -> None:
        """Once the first requests brought every variant of structure, new sizes and text lengths reuse the
        graphs."""
        result = one_rank_compiled(self, model_dir)
        assert compiles_nothing_more(result["graphs"]), f"{self.family}: graphs after each request {result['graphs']}"
