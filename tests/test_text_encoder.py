"""Prompt encoding matches WanPipeline's, and the embedding cache is a bounded LRU."""

from __future__ import annotations

import torch

from text_encoder_svc.encoder import EmbeddingCache, PromptEncoder


def test_embeddings_equal_wan_pipeline(tiny_model, reference_pipeline) -> None:
    encoder = PromptEncoder(tiny_model, "tiny", torch.device("cpu"), torch.float32)
    prompt, negative = "  a red   fox &amp; a hare ", "blurry"
    with torch.no_grad():  # as inside WanPipeline.__call__, which picks the same attention kernel
        expected_prompt, expected_negative = reference_pipeline.encode_prompt(
            prompt, negative, do_classifier_free_guidance=True, max_sequence_length=512
        )
    embeds, cached = encoder.encode([prompt, negative], 512)
    assert not cached
    assert torch.equal(embeds[0], expected_prompt[0]) and torch.equal(embeds[1], expected_negative[0])
    assert embeds.shape == (2, 512, encoder.hidden_size)


def test_repeated_texts_come_from_the_cache(tiny_model) -> None:
    encoder = PromptEncoder(tiny_model, "tiny", torch.device("cpu"), torch.float32, cache_size=8)
    first, hit = encoder.encode(["a fox", "blurry"], 64)
    assert not hit and encoder.cache.misses == 2
    again, hit = encoder.encode(["a fox", "blurry"], 64)
    assert hit and encoder.cache.hits == 2 and torch.equal(first, again)
    # The max length is part of the key.
    _, hit = encoder.encode(["a fox"], 32)
    assert not hit


def test_cache_evicts_the_least_recently_used() -> None:
    cache = EmbeddingCache(capacity=2)
    a, b, c = (torch.full((1,), float(i)) for i in range(3))
    cache.put(("m", "a", 8), a)
    cache.put(("m", "b", 8), b)
    assert cache.get(("m", "a", 8)) is a  # a is now the most recent
    cache.put(("m", "c", 8), c)
    assert cache.get(("m", "b", 8)) is None
    assert cache.get(("m", "a", 8)) is a and cache.get(("m", "c", 8)) is c
    assert len(cache) == 2


def test_zero_capacity_disables_the_cache() -> None:
    cache = EmbeddingCache(capacity=0)
    cache.put(("m", "a", 8), torch.zeros(1))
    assert cache.get(("m", "a", 8)) is None and len(cache) == 0
