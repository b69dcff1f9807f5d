"""The text-encoder stage's configuration: built once in `main` from its parsed options, checked, then handed down.

`TextEncoderConfig` embeds the configuration every stage shares (services/stage_config.py) and adds the
embedding cache's bounds; nothing below `main` reads the parsed options.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.stage_config import StageConfig


@dataclass(frozen=True)
class EmbeddingCacheConfig:
    """The bounds of the LRU cache of embeddings (stagekit/encoder.py); either one 0 disables it."""

    max_bytes: int
    """Bytes of embeddings kept (--embedding-cache-bytes, 0 or more)."""
    max_entries: int
    """Texts kept, within `max_bytes` (--embedding-cache-size, 0 or more)."""

    def __post_init__(self) -> None:
        for flag, value in (("--embedding-cache-bytes", self.max_bytes), ("--embedding-cache-size", self.max_entries)):
            if value < 0:
                raise ValueError(f"{flag} {value}: use 0 or more (0 disables the cache)")

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> EmbeddingCacheConfig:
        """The cache bounds the parsed options give; raises ValueError naming the first out of bounds."""
        return cls(max_bytes=args.embedding_cache_bytes, max_entries=args.embedding_cache_size)


@dataclass(frozen=True)
class TextEncoderConfig:
    """What `stagediff serve text-encoder` runs with (text_encoder_svc/options.py has each flag's help)."""

    stage: StageConfig
    """The options every stage shares: checkpoint, device, server."""
    cache: EmbeddingCacheConfig
    """The embedding cache's bounds."""
