"""Prompt encoding exactly as WanPipeline does it, with an LRU cache of embeddings.

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
from collections import OrderedDict
from pathlib import Path

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import AutoTokenizer, UMT5EncoderModel

from services.weights import load_pretrained

logger = logging.getLogger(__name__)

# `--embedding-cache-bytes`: 32 of Wan's largest fp32 embeddings (512 tokens x 4096 x 4 bytes = 8 MiB each).
DEFAULT_CACHE_BYTES = 256 * 2**20
# `--embedding-cache-size`: bounds the entries too, for models whose embeddings are small.
DEFAULT_CACHE_ENTRIES = 1024

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


class PromptEncoder:
    """UMT5 prompt encoder with WanPipeline's tokenization, truncation and zero padding."""

    def __init__(
        self,
        model_dir: str | Path,
        model_id: str,
        device: torch.device,
        dtype: torch.dtype,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        load_threads: int = 4,
    ) -> None:
        model_dir = Path(model_dir)
        self.model_id = model_id
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        self.text_encoder = load_pretrained(
            UMT5EncoderModel, model_dir / "text_encoder", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        self.cache = EmbeddingCache(cache_bytes, cache_entries)

    @property
    def hidden_size(self) -> int:
        return self.text_encoder.config.d_model

    @torch.no_grad()
    def encode_one(self, text: str, max_sequence_length: int, namespace: bytes = b"") -> tuple[torch.Tensor, bool]:
        """Returns the [max_sequence_length, dim] embedding of one text and whether it was cached.

        Texts are encoded one at a time, as WanPipeline encodes prompt and
        negative prompt in separate batches of one, so results match it exactly.
        Only an entry put with the same `namespace` is a hit.
        """
        key = (namespace, self.model_id, text, max_sequence_length)
        cached = self.cache.get(key)
        if cached is not None:
            return cached, True
        inputs = self.tokenizer(
            [prompt_clean(text)],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = inputs.attention_mask
        length = int(mask.gt(0).sum())
        hidden = self.text_encoder(inputs.input_ids.to(self.device), mask.to(self.device)).last_hidden_state[0]
        embedding = torch.zeros_like(hidden)
        embedding[:length] = hidden[:length]  # zero past the text, as WanPipeline does
        embedding = embedding.cpu()
        self.cache.put(key, embedding)
        return embedding, False

    def encode(self, texts: list[str], max_sequence_length: int, namespace: bytes = b"") -> tuple[torch.Tensor, bool]:
        """Returns [len(texts), max_sequence_length, dim] and whether every text came from `namespace`'s cache."""
        results = [self.encode_one(text, max_sequence_length, namespace) for text in texts]
        return torch.stack([embedding for embedding, _ in results]), all(hit for _, hit in results)
