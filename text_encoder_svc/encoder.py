"""Prompt encoding exactly as WanPipeline does it, with an LRU cache of embeddings.

Serving traffic repeats itself (the same negative prompt on every request, the
same prompt retried or re-run with another seed), so each encoded text is kept
in a bounded cache keyed by model, text and max length.
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


class EmbeddingCache:
    """A thread-safe LRU map from (model, text, max_length) to an embedding tensor."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str, int], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[str, str, int]) -> torch.Tensor | None:
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: tuple[str, str, int], value: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

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
        cache_size: int = 1024,
        load_threads: int = 4,
    ) -> None:
        model_dir = Path(model_dir)
        self.model_id = model_id
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        self.text_encoder = load_pretrained(
            UMT5EncoderModel, model_dir / "text_encoder", device=device, dtype=dtype, num_threads=load_threads
        ).eval()
        self.cache = EmbeddingCache(cache_size)

    @property
    def hidden_size(self) -> int:
        return self.text_encoder.config.d_model

    @torch.no_grad()
    def encode_one(self, text: str, max_sequence_length: int) -> tuple[torch.Tensor, bool]:
        """Returns the [max_sequence_length, dim] embedding of one text and whether it was cached.

        Texts are encoded one at a time, as WanPipeline encodes prompt and
        negative prompt in separate batches of one, so results match it exactly.
        """
        key = (self.model_id, text, max_sequence_length)
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

    def encode(self, texts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, bool]:
        """Returns [len(texts), max_sequence_length, dim] and whether every text came from the cache."""
        results = [self.encode_one(text, max_sequence_length) for text in texts]
        return torch.stack([embedding for embedding, _ in results]), all(hit for _, hit in results)
