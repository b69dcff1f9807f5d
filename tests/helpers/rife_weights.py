"""RIFE 4.22 lite weights at the published keys and shapes (tests/data), drawn at random."""

from __future__ import annotations

from pathlib import Path

import torch

STATE_DICT_TSV = Path(__file__).parents[1] / "data" / "rife-4.22-lite-state-dict.tsv"


def published_shapes() -> dict[str, tuple[int, ...]]:
    """Key -> shape of the published 4.22.lite flownet.pkl, keys with their `module.` prefix."""
    shapes: dict[str, tuple[int, ...]] = {}
    for line in STATE_DICT_TSV.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, shape = line.split("\t")
        shapes[key] = tuple(int(size) for size in shape.strip("[]").split(","))
    return shapes


def random_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random small weights under exactly the published keys and shapes."""
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randn(shape, generator=generator) * 0.05 for key, shape in published_shapes().items()}
