"""What every family's prompt encoder shares: an LRU cache of embeddings and the loop around it.

Serving traffic repeats itself (the same negative prompt on every request, the
same prompt retried or re-run with another seed), so each encoded text is kept
in a cache keyed by namespace, model, text and max length, bounded in bytes.

The namespace keeps tenants apart. A cache hit shows (in `EncodeResponse.cache_hit`
and in the stage timings a client gets back), so a cache shared by every caller
would let one tenant test whether another recently sent an exact prompt. The
orchestrator sends an opaque per-tenant namespace with each request (an HMAC of
the tenant's name; see services/orchestrator/cache_namespace.py): entries are
shared only within one tenant, and the stage never learns who the tenant is.
Requests without a namespace (direct callers, older orchestrators) share the
empty one among themselves.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict

import torch

from text_encoder_svc.options import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES

logger = logging.getLogger(__name__)

# (namespace, model id, text, max sequence length)
CacheKey = tuple[bytes, str, str, int]


def entry_bytes(key: CacheKey, value: torch.Tensor) -> int:
    """What an entry holds: its tensor's whole storage (a view keeps all of it alive) and its key's bytes."""
    namespace, model, text, _ = key
    return value.untyped_storage().nbytes() + len(namespace) + len(model.encode()) + len(text.encode())


class EmbeddingCache:
    """A thread-safe LRU map from a `CacheKey` to an embedding tensor, bounded in bytes and in entries.

    Putting an entry evicts the least recently used ones until the total of `entry_bytes` fits in
    `max_bytes` and at most `max_entries` remain; an entry larger than `max_bytes` by itself is not kept.
    Either bound at 0 disables the cache.
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        if max_bytes < 0 or max_entries < 0:
            raise ValueError(f"max_bytes {max_bytes}, max_entries {max_entries}: use 0 or more")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[CacheKey, tuple[torch.Tensor, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.total_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: CacheKey) -> torch.Tensor | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: CacheKey, value: torch.Tensor) -> None:
        size = entry_bytes(key, value)
        if self.max_bytes == 0 or self.max_entries == 0 or size > self.max_bytes:
            return
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self.total_bytes -= previous[1]
            self._entries[key] = (value, size)
            self.total_bytes += size
            while self.total_bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.total_bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)


class PromptEncoder(ABC):
    """A family's text encoder with the cache in front of it.

    A family subclasses it with `embed_uncached(text, max_sequence_length) -> [L, dim]` (one text, exactly
    as its diffusers pipeline encodes it) and `batch(embeddings) -> {name: [N, ...]}` (the tensors the
    text encoder stage sends, batched over the request's texts; see families/base.py).
    """

    def __init__(
        self,
        model_id: str,
        device: torch.device,
        tokenizer: object,
        text_encoder: torch.nn.Module,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
    ) -> None:
        self.model_id = model_id
        self.device = device
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder.eval()
        self.cache = EmbeddingCache(cache_bytes, cache_entries)

    @abstractmethod
    def embed_uncached(self, text: str, max_sequence_length: int) -> torch.Tensor:
        """One text's embedding, exactly as the family's pipeline encodes it."""

    @abstractmethod
    def batch(self, embeddings: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the stage sends for the request's texts, batched over them."""

    @torch.no_grad()
    def encode_one(self, text: str, max_sequence_length: int, namespace: bytes = b"") -> tuple[torch.Tensor, bool]:
        """Returns one text's embedding and whether it was cached; only an entry put with the same
        `namespace` is a hit."""
        key = (namespace, self.model_id, text, max_sequence_length)
        cached = self.cache.get(key)
        if cached is not None:
            return cached, True
        embedding = self.embed_uncached(text, max_sequence_length)
        self.cache.put(key, embedding)
        return embedding, False

    def encode(
        self, texts: list[str], max_sequence_length: int, namespace: bytes = b""
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """Returns the batched tensors of `texts` and whether every text came from `namespace`'s cache.

        Texts are encoded one at a time, as the pipelines encode prompt and negative prompt in separate
        batches of one, so that results match them exactly.
        """
        results = [self.encode_one(text, max_sequence_length, namespace) for text in texts]
        return self.batch([embedding for embedding, _ in results]), all(hit for _, hit in results)
