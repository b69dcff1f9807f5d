"""The bounds of a prompt encoder's embedding cache (stagekit/encoder.py) when nothing sets them.

No torch here: the text encoder stage's options (`--embedding-cache-bytes`, `--embedding-cache-size`) take
their defaults from this module, and `stagediff up` reads those options without the servers' packages.
"""

from __future__ import annotations

# `--embedding-cache-bytes`: 32 of Wan's largest fp32 embeddings (512 tokens x 4096 x 4 bytes = 8 MiB each).
DEFAULT_CACHE_BYTES = 256 * 2**20
# `--embedding-cache-size`: bounds the entries too, for models whose embeddings are small.
DEFAULT_CACHE_ENTRIES = 1024
