"""Every parallel layout of the DiT gives the final latents of one rank (gloo, 2 and 4 ranks)."""

from __future__ import annotations

import pytest

from stagekit.parallel import ParallelConfig, ParallelConfigError


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (ParallelConfig(ulysses_degree=3), ["4 attention heads", "[1, 2, 4]"]),
        (ParallelConfig(ulysses_degree=2, tp_degree=4), ["Ulysses x TP", "[1, 2, 4]"]),
        (ParallelConfig(cfg_degree=3), ["--cfg-parallel-size 3", "1 or 2"]),
        (ParallelConfig(ulysses_degree=0), ["--ulysses-degree 0", "at least 1"]),
        (ParallelConfig(ulysses_degree=2, use_hsdp=True, hsdp_shard_size=3), ["must equal the world size 2", "[1, 2]"]),
        (ParallelConfig(hsdp_shard_size=2), ["need --use-hsdp"]),
        (ParallelConfig(ulysses_degree=4), ["needs 4 devices but 2 are visible"]),
    ],
)
def test_impossible_layouts_are_refused_naming_valid_choices(config, words) -> None:
    with pytest.raises(ParallelConfigError) as raised:
        config.validate(num_heads=4, available_devices=2)
    for word in words:
        assert word in str(raised.value)
