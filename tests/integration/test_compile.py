"""Regional compilation (`--compile`, dit_svc/compile.py) beyond one rank: Wan's compiled blocks compute what
eager ones do on two gloo ranks under Ulysses and under HSDP (whose FSDP2-wrapped blocks are why the blocks are
matched along their class hierarchy), the flag reaches the denoiser, and the stage refuses it where the feature
table says it is not verified. The one-rank checks of each family are CompileTesterMixin's
(tests/helpers/feature_mixins/compile.py), in tests/integration/test_family_features.py; the two ranks run
WanT2VTesterConfig's requests the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dit_svc.compile import repeated_blocks
from dit_svc.config import DenoiserBuild, DitConfig
from dit_svc.denoise import make_denoiser
from dit_svc.model_options import ModelOptions
from families.init_model import init_model
from families.registry import FAMILIES as REGISTRY
from stagekit.parallel import ParallelConfig
from stagekit.parallel.launch import run_ranks
from tests.helpers.feature_mixins import WanT2VTesterConfig
from tests.helpers.feature_mixins.compile import (
    TOLERANCE,
    compiles_nothing_more,
    eager_then_compiled,
    max_differences,
)
from tests.helpers.serving import parse_serve

CPU = torch.device("cpu")
LAYOUTS_2 = [
    ("ulysses2", ParallelConfig(ulysses_degree=2)),
    ("hsdp2", ParallelConfig(use_hsdp=True, hsdp_shard_size=2)),
]
# The families whose feature table says --compile is not verified: the stage must refuse it for them.
UNVERIFIED = [name for name, family in REGISTRY.items() if not family.support("compile").supported]


def _wan_layouts_on_rank(rank: int, world_size: int, model_dir: str) -> dict:
    config = WanT2VTesterConfig()
    return {name: eager_then_compiled(config, Path(model_dir), layout) for name, layout in LAYOUTS_2}


def test_compiled_blocks_equal_eager_under_ulysses_and_hsdp(tiny_model: Path) -> None:
    """On every rank of Wan under Ulysses 2 (padded and unpadded token counts) and HSDP 2, in one spawn of two
    ranks, the compiled blocks give the eager latents, and new sizes compile nothing more."""
    for rank, layouts in enumerate(run_ranks(_wan_layouts_on_rank, 2, str(tiny_model))):
        for layout, result in layouts.items():
            differences = max_differences(result)
            print(f"wan-t2v {layout} rank {rank}: max abs diff per request {differences}, graphs {result['graphs']}")
            assert result["blocks"] == 2 and result["graphs"][0] > 0, (layout, rank, result["blocks"])
            assert max(differences) <= TOLERANCE, (layout, rank, differences)
            assert compiles_nothing_more(result["graphs"]), (layout, rank, result["graphs"])


def test_compile_flag_reaches_the_denoiser(tiny_model) -> None:
    """`stagediff serve dit --compile` sets the option, GetClusterInfo reports it, and the stage's
    make_denoiser wraps every block for compilation (each compiles on its first call)."""
    options = DitConfig.from_args(parse_serve(["dit", "--model", str(tiny_model), "--compile"])).options
    assert options.compile and options.describe()["compile"] == "regional"
    assert not DitConfig.from_args(parse_serve(["dit", "--model", str(tiny_model)])).options.compile
    denoiser = make_denoiser(tiny_model, CPU, torch.float32, DenoiserBuild(options=options))
    blocks = repeated_blocks(denoiser.transformer)
    assert len(blocks) == 2 and all(block._compiled_call_impl is not None for block in blocks)
    eager = make_denoiser(tiny_model, CPU, torch.float32, DenoiserBuild(options=ModelOptions()))
    assert all(block._compiled_call_impl is None for block in repeated_blocks(eager.transformer))


@pytest.mark.parametrize("name", UNVERIFIED)
def test_compile_is_refused_at_startup_where_unverified(tmp_path_factory, name: str) -> None:
    support = REGISTRY[name].support("compile")
    assert support.refused_at_startup
    model_dir = init_model(name, "tiny", tmp_path_factory.mktemp("models") / name, seed=0)
    with pytest.raises(SystemExit) as refused:
        DitConfig.from_args(parse_serve(["dit", "--model", str(model_dir), "--compile"]))
    assert f"the {name} family does not support --compile: {support.reason}" in str(refused.value)
