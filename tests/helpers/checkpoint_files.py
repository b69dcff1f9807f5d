"""Checkpoint folders with small files standing in for the weights: what component identities are read from."""

from __future__ import annotations

import json
from pathlib import Path

from families.base import Family

# What each pipeline's model_index.json must name for its family to be recognised (families/registry.py).
_FAMILY_ENTRIES = {
    "wan2.2-i2v-a14b": {"transformer_2": ["diffusers", "X"], "boundary_ratio": 0.9},
}


def fake_checkpoint(root: Path, family: Family, text: bytes = b"umt5", vae: bytes = b"vae") -> Path:
    """A checkpoint of `family` whose text encoder and VAE files hold `text` and `vae`; its transformer holds its
    folder's name (so that no two checkpoints share one)."""
    components = {"text_encoder": text, "tokenizer": b"spiece", "vae": vae, "transformer": root.name.encode()}
    for name, weights in components.items():
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps({"name": name}))
        (root / name / "model.safetensors").write_bytes(weights)
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    index = {"_class_name": family.class_name, **{name: ["diffusers", "X"] for name in [*components, "scheduler"]}}
    index["image_encoder"] = [None, None]  # a component left out
    index.update(_FAMILY_ENTRIES.get(family.name, {}))
    (root / "model_index.json").write_text(json.dumps(index))
    return root
