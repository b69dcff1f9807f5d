"""bench/weight_loading.py's bookkeeping: the bytes a load brought in, and the class it loads."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.weight_loading import model_class_named, unique_bytes  # noqa: E402


def test_a_tied_weight_is_counted_once() -> None:
    """UMT5's embedding is `shared` and `encoder.embed_tokens`: one tensor, read once, counted once."""
    embedding = torch.nn.Embedding(10, 4)
    model = torch.nn.ModuleDict({"shared": embedding, "embed_tokens": embedding, "proj": torch.nn.Linear(4, 2)})
    state = model.state_dict()
    assert len(state) == 4
    assert unique_bytes(state) == (10 * 4 + 4 * 2 + 2) * 4


def test_model_classes_come_from_diffusers_or_transformers() -> None:
    assert model_class_named("WanTransformer3DModel").__module__.startswith("diffusers.")
    assert model_class_named("UMT5EncoderModel").__module__.startswith("transformers.")
