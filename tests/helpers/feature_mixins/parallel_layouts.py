"""Ulysses, Ring, CFG-parallel, tensor parallelism and HSDP: ParallelLayoutsTesterMixin.

Spawning ranks is the expensive part, so each world size is spawned once per session: the first test that
needs it runs, in one group of gloo ranks, every layout of every config collected with this mixin (each
layout builds its own mesh), and the others take their results from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.feature_mixins.base import FamilyTesterConfig, SpawnResults, checkpoint, shared_spawn, tester_config

TOLERANCE = 1e-4

_ONE_RANK: dict[tuple[str, str], dict[str, Any]] = {}
_PER_RANK: SpawnResults = {}


def one_rank_outputs(config: FamilyTesterConfig, model_dir: Path) -> dict[str, Any]:
    """`parallel_outputs` of the fp32 one-rank denoiser, once per checkpoint."""
    key = (config.family, str(model_dir))
    if key not in _ONE_RANK:
        _ONE_RANK[key] = config.parallel_outputs(config.build_denoiser(model_dir, torch.float32))
    return _ONE_RANK[key]


def _rank_outputs(
    rank: int, world_size: int, cases: list[tuple[type[FamilyTesterConfig], str]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """On one rank: by config and layout name, `parallel_outputs` of every layout of that world size."""
    results = {}
    for config_class, model_dir in cases:
        config = config_class()
        results[config_class.__qualname__] = {
            name: config.parallel_outputs(config.build_denoiser(Path(model_dir), torch.float32, parallel=layout))
            for name, layout in config.parallel_layouts[world_size]
        }
    return results


def per_rank_outputs(
    request: pytest.FixtureRequest, config: type[FamilyTesterConfig], world_size: int
) -> list[dict[str, dict[str, Any]]]:
    """Every rank's outputs of the config's layouts of `world_size`, by layout name (one spawn per size)."""
    return shared_spawn(
        request,
        config,
        world_size,
        mixin=ParallelLayoutsTesterMixin,
        layouts="parallel_layouts",
        results=_PER_RANK,
        case=lambda each: (each, str(checkpoint(each, request))),
        rank_function=_rank_outputs,
    )


class ParallelLayoutsTesterMixin:
    """`--ulysses-degree`, `--ring-degree`, `--cfg-parallel-size`, `--tensor-parallel-size`, `--use-hsdp`: under
    every layout of the config's `parallel_layouts`, each rank's latents equal one rank's, each expert runs its
    forwards (a CFG-parallel rank its share), and a rank of a TP or HSDP layout holds part of each expert's
    parameters (the whole expert otherwise); then the config's own `check_parallel_outputs`."""

    def test_parallel_latents_equal_one_rank(
        self: Any, request: pytest.FixtureRequest, model_dir: Path, world_size: int
    ) -> None:
        one_rank = one_rank_outputs(self, model_dir)
        per_rank = per_rank_outputs(request, tester_config(type(self)), world_size)
        specs = self.parallel_specs or (self.spec,)
        report = []
        for name, _ in self.parallel_layouts[world_size]:
            for rank, results in enumerate(per_rank):
                for spec, expected, actual in zip(specs, one_rank["latents"], results[name]["latents"], strict=True):
                    assert actual.shape == expected.shape, f"{name} rank {rank}: {tuple(actual.shape)}"
                    difference = (actual - expected).abs().max().item()
                    report.append((name, rank, f"{spec.height}x{spec.width}x{spec.num_frames}", difference))
        print("\n".join(f"{name} rank {rank} {size}: max abs diff {diff:.2e}" for name, rank, size, diff in report))
        worst = max(report, key=lambda row: row[3])
        assert worst[3] <= TOLERANCE, f"{worst[0]} rank {worst[1]} at {worst[2]}: max abs difference {worst[3]:.2e}"

        for name, layout in self.parallel_layouts[world_size]:
            outputs = [results[name] for results in per_rank]
            calls = [count // layout.cfg_degree for count in self.forwards_per_expert]
            sharded = layout.tp_degree > 1 or layout.use_hsdp
            for rank, result in enumerate(outputs):
                assert result["calls"] == [calls] * len(specs), f"{name} rank {rank}: expert calls {result['calls']}"
                for expert, (held, whole) in enumerate(zip(result["bytes"], one_rank["bytes"], strict=True)):
                    print(f"{name} rank {rank} expert {expert}: holds {held} of {whole} parameter bytes")
                    if sharded:
                        limit = self.max_sharded_fraction
                        assert held < limit * whole, f"{name} rank {rank} expert {expert}: holds {held} of {whole}"
                    else:
                        assert held == whole, f"{name} rank {rank} expert {expert}: holds {held} of {whole}"
            self.check_parallel_outputs(name, layout, outputs, one_rank)
