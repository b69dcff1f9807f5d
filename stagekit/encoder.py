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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeAlias

import torch
from PIL import Image

from stagekit.cache_defaults import DEFAULT_CACHE_BYTES, DEFAULT_CACHE_ENTRIES

logger = logging.getLogger(__name__)

# (namespace, model id, text, max sequence length); for input images (families whose encoder sees them),
# (namespace, model id, "image:" and the images' SHA-256 digests, IMAGE_KEY_LENGTH), which no text key has;
# for a text embedded together with the images (Qwen-Image-Edit), the text's key and the digests, a fifth
# entry that no other key has.
CacheKey = tuple[bytes, str, str, int] | tuple[bytes, str, str, int, str]
IMAGE_KEY_LENGTH = -1


# One text's embedding: a tensor, or, for a family with several text encoders, their tensors by name (FLUX's
# T5 sequence and CLIP pooled vector).
Embedding: TypeAlias = torch.Tensor | dict[str, torch.Tensor]


def entry_bytes(key: CacheKey, value: Embedding) -> int:
    """What an entry holds: its tensors' whole storages (a view keeps all of it alive) and its key's bytes."""
    namespace, model, text = key[:3]
    digests = sum(len(part.encode()) for part in key[4:])
    tensors = value.values() if isinstance(value, dict) else (value,)
    stored = sum(tensor.untyped_storage().nbytes() for tensor in tensors)
    return stored + len(namespace) + len(model.encode()) + len(text.encode()) + digests


class EmbeddingCache:
    """A thread-safe LRU map from a `CacheKey` to an embedding, bounded in bytes and in entries.

    Putting an entry evicts the least recently used ones until the total of `entry_bytes` fits in
    `max_bytes` and at most `max_entries` remain; an entry larger than `max_bytes` by itself is not kept.
    Either bound at 0 disables the cache.
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        if max_bytes < 0 or max_entries < 0:
            raise ValueError(f"max_bytes {max_bytes}, max_entries {max_entries}: use 0 or more")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[CacheKey, tuple[Embedding, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.total_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: CacheKey) -> Embedding | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: CacheKey, value: Embedding) -> None:
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


@dataclass(frozen=True)
class Truncation:
    """A text its family's pipeline cuts: the tokens it has and the tokens the embedding keeps, as the
    pipeline counts them (special tokens, and a chat template's, included)."""

    given: int
    kept: int
    # Which of the family's text encoders cuts it, for a family with several (FLUX's CLIP beside T5); "" for
    # the one that makes the sequence.
    encoder: str = ""


class Tokenizer(Protocol):
    """A Hugging Face tokenizer as the encoders call it: a batch of texts in, a BatchEncoding out."""

    def __call__(self, texts: list[str], /, **kwargs: Any) -> Any: ...


class PromptEncoder(ABC):
    """A family's text encoder with the cache in front of it.

    A family subclasses it with `embed_uncached(text, max_sequence_length) -> [L, dim]` (one text, exactly
    as its diffusers pipeline encodes it) and `batch(embeddings) -> {name: [N, ...]}` (the tensors the
    text encoder stage sends, batched over the request's texts; see families/base.py).
    """

    # The checkpoint's components it loads beside its transformers models (which the text encoder stage's memory
    # guard counts all of): LTX-2's connectors.
    other_components: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        model_id: str,
        device: torch.device,
        tokenizer: Tokenizer,
        text_encoder: torch.nn.Module,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
    ) -> None:
        self.model_id = model_id
        self.device = device
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder.eval()
        self.cache = EmbeddingCache(cache_bytes, cache_entries)

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        """The encoder's models by component name, as the stage reports their parameter bytes."""
        return {"text_encoder": self.text_encoder}

    @abstractmethod
    def embed_uncached(self, text: str, max_sequence_length: int) -> Embedding:
        """One text's embedding, exactly as the family's pipeline encodes it."""

    @abstractmethod
    def batch(self, embeddings: list[Any]) -> dict[str, torch.Tensor]:
        """The tensors the stage sends for the request's texts, batched over them."""

    def truncation(self, text: str, max_sequence_length: int) -> Truncation | None:
        """How the family's pipeline cuts `text` at `max_sequence_length`, or None when it keeps every token.

        The default is for a family whose pipeline cuts no text; one that truncates counts the text's tokens
        as its tokenizer call does, without the cut (the stage reports the cut to the caller).
        """
        return None

    # The name the image embedding travels under, for families whose encoder sees the input images.
    image_tensor_name = "image_embeds"
    # True for a family whose encoder embeds each text together with the request's images (Qwen2.5-VL in
    # Qwen-Image-Edit sees the image in the prompt): `embed_with_images_uncached` makes its embeddings, and
    # no separate image embedding is sent.
    texts_see_images = False

    def embed_with_images_uncached(
        self, text: str, images: list[Image.Image], max_sequence_length: int
    ) -> torch.Tensor:
        """One text's embedding made together with the request's images (RGB, in the family's role order),
        exactly as the family's pipeline makes it; only a family with `texts_see_images` implements it."""
        raise NotImplementedError(f"{type(self).__name__} does not embed texts with images")

    def embed_images_uncached(self, images: list[Image.Image]) -> torch.Tensor:
        """The embedding of the request's images (RGB, in the family's role order), as the pipeline makes it.

        Only a family whose conditioning encoder sees images implements it (Wan2.1 image-to-video's CLIP).
        """
        raise NotImplementedError(f"{type(self).__name__} does not embed images")

    @torch.no_grad()
    def encode_images(
        self, images: list[Image.Image], digests: list[str], namespace: bytes = b""
    ) -> tuple[torch.Tensor, bool]:
        """The images' embedding and whether it came from `namespace`'s cache, keyed on their digests."""
        key = (namespace, self.model_id, "image:" + ",".join(digests), IMAGE_KEY_LENGTH)
        cached = self.cache.get(key)
        if cached is not None:
            return cached, True
        embedding = self.embed_images_uncached(images)
        self.cache.put(key, embedding)
        return embedding, False

    @torch.no_grad()
    def encode_one(
        self,
        text: str,
        max_sequence_length: int,
        namespace: bytes = b"",
        images: Sequence[Image.Image] = (),
        digests: Sequence[str] = (),
    ) -> tuple[Embedding, bool]:
        """Returns one text's embedding and whether it was cached; only an entry put with the same
        `namespace` is a hit. With `images` (and their SHA-256 `digests`), the text is embedded together with
        them (`texts_see_images`), and cached on the digests too."""
        if images:
            if len(digests) != len(images):
                raise ValueError(f"{len(images)} images with {len(digests)} digests: one digest per image")
            key: CacheKey = (namespace, self.model_id, text, max_sequence_length, ",".join(digests))
        else:
            key = (namespace, self.model_id, text, max_sequence_length)
        cached = self.cache.get(key)
        if cached is not None:
            return cached, True
        if images:
            embedding = self.embed_with_images_uncached(text, list(images), max_sequence_length)
        else:
            embedding = self.embed_uncached(text, max_sequence_length)
        self.cache.put(key, embedding)
        return embedding, False

    def encode(
        self,
        texts: list[str],
        max_sequence_length: int,
        namespace: bytes = b"",
        images: Sequence[Image.Image] = (),
        digests: Sequence[str] = (),
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """Returns the batched tensors of `texts` and whether every text came from `namespace`'s cache.

        Texts are encoded one at a time, as the pipelines encode prompt and negative prompt in separate
        batches of one, so that results match them exactly; each together with `images` when given (a
        family with `texts_see_images`).
        """
        results = [self.encode_one(text, max_sequence_length, namespace, images, digests) for text in texts]
        return self.batch([embedding for embedding, _ in results]), all(hit for _, hit in results)
