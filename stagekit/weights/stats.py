"""What one load read and how long it took: `LoadStats`, kept on the loaded model and logged."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

# Attribute of a model returned by `load_pretrained` holding its `LoadStats`.
STATS_ATTR = "weight_load_stats"


@dataclass(frozen=True)
class ShardStats:
    """What reading one safetensors file cost."""

    file: str
    bytes: int
    seconds: float


@dataclass
class LoadStats:
    """What one `load_pretrained` call read and how long it took (seconds: the whole call)."""

    total_bytes: int = 0
    seconds: float = 0.0
    threads: int = 1
    tensors: int = 0
    shards: list[ShardStats] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.total_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def load_stats(model: nn.Module) -> LoadStats:
    """The `LoadStats` of a model returned by `load_pretrained`."""
    return getattr(model, STATS_ATTR)


def describe(model: nn.Module) -> dict[str, Any]:
    """`LoadStats` of a loaded model as plain JSON-able values, for logs and `stagediff info`."""
    stats = load_stats(model)
    return {
        "bytes": stats.total_bytes,
        "seconds": round(stats.seconds, 4),
        "gb_per_s": round(stats.gb_per_s, 3),
        "threads": stats.threads,
        "tensors": stats.tensors,
        "shards": len(stats.shards),
    }


def finish_stats(
    model: nn.Module, model_class: type[nn.Module], directory: Path, stats: LoadStats, start: float
) -> nn.Module:
    """Records the call's seconds in `stats`, keeps them on `model` (`load_stats`) and logs them."""
    stats.seconds = time.perf_counter() - start
    setattr(model, STATS_ATTR, stats)
    logger.info(
        "loaded %s from %s: %d tensors, %.3f GB in %.3f s (%.2f GB/s, %d threads)",
        model_class.__name__,
        directory,
        stats.tensors,
        stats.total_bytes / 1e9,
        stats.seconds,
        stats.gb_per_s,
        stats.threads,
    )
    return model
