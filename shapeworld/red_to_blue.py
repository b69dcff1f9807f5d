"""A LoRA adapter for the demo model that paints red objects blue, constructed rather than trained.

    python -m shapeworld.red_to_blue --out shapeworld/adapters/red_to_blue.safetensors

The demo's text encoder is a frozen random UMT5 that keeps each word's identity in its output, and the DiT reads
the colour from the colour word's embedding. The DiT's first layer to see the embeddings is
`condition_embedder.text_embedder.linear_1` (64 -> 128, per token), so the adapter is a low-rank delta D on that
layer, fitted in closed form:

- Encode every training-template prompt with "red" and with "blue", with each other colour, and lines of the
  tokenizer's own corpus that do not say "red", all with the pipeline's own `encode_prompt`.
- Ridge least squares: D x_red = W (x_blue - x_red) on the tokens of red prompts (W is linear_1's weight), and
  D x = 0 on the other colours' prompts and the corpus (which keeps D off words the templates do not use). The
  colour words' rows weigh COLOUR_WEIGHT times the others, or the many other tokens hold the red word back.
- Truncate D by SVD to rank RANK, as lora_B @ lora_A with lora_alpha = rank (scale 1); D is nearly rank one.

Padding tokens are zero embeddings, which D leaves at zero. The printed check reports, on the training and the
held-out templates, how far the red word moves towards blue (1 is all the way) and the largest change of any other
token relative to it. The file is `WanPipeline.save_lora_weights`' format (`pipe.load_lora_weights`, --lora-dir).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from families.init_model import training_corpus
from shapeworld.demo_model import CHECKPOINT, SEQUENCE_LENGTH, TOKENIZER
from shapeworld.world import (
    BACKGROUNDS,
    COLOURS,
    HELD_OUT_TEMPLATES,
    MOTION_PHRASES,
    MOTIONS,
    SHAPES,
    TRAINING_TEMPLATES,
    Concept,
)

if TYPE_CHECKING:  # diffusers is imported where it is used
    from diffusers import WanPipeline

SOURCE, TARGET = "red", "blue"
LAYER = "condition_embedder.text_embedder.linear_1"
RANK = 1
COLOUR_WEIGHT = 100.0
CORPUS_SENTENCES = 1000  # generated sentences of the tokenizer's corpus (besides its prose) kept unchanged
RIDGE = 1.0
BATCH = 64  # prompts encoded at once (each is padded to SEQUENCE_LENGTH tokens)


def prompts(colour: str, templates: tuple[str, ...]) -> list[str]:
    """Every (shape, motion, background) in `colour` with every template, the motion phrasings taken in turn."""
    combinations = itertools.product(SHAPES, MOTIONS, BACKGROUNDS, templates)
    return [
        Concept(shape, colour, motion, background).prompt(template, index % len(MOTION_PHRASES[motion]))
        for index, (shape, motion, background, template) in enumerate(combinations)
    ]


def embed(pipe: WanPipeline, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 UMT5 embeddings of the texts' tokens [tokens, 64], padding left out, and their token ids."""
    rows, ids = [], []
    for start in range(0, len(texts), BATCH):
        batch = texts[start : start + BATCH]
        embeds, _ = pipe.encode_prompt(batch, do_classifier_free_guidance=False, max_sequence_length=SEQUENCE_LENGTH)
        tokens = pipe.tokenizer(
            batch, padding="max_length", max_length=SEQUENCE_LENGTH, truncation=True, return_tensors="pt"
        )
        mask = tokens.attention_mask.bool()
        rows.append(embeds[mask].double())
        ids.append(tokens.input_ids[mask])
    return torch.cat(rows), torch.cat(ids)


def encode_world(pipe: WanPipeline, templates: tuple[str, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per colour, the token embeddings and ids of `prompts(colour, templates)`; the colours' rows align."""
    return {colour: embed(pipe, prompts(colour, templates)) for colour in COLOURS}


def encode_corpus(pipe: WanPipeline) -> torch.Tensor:
    """Token embeddings of the tokenizer's training corpus, less the lines that say the source colour."""
    lines = training_corpus(CORPUS_SENTENCES, TOKENIZER["corpus_names"])
    return embed(pipe, [line for line in lines if SOURCE not in line.lower()])[0]


def fit_delta(
    weight: torch.Tensor, world: dict[str, tuple[torch.Tensor, torch.Tensor]], corpus: torch.Tensor
) -> torch.Tensor:
    """D [out, 64] by weighted ridge least squares (see the module docstring)."""
    (red, red_ids), (blue, blue_ids) = world[SOURCE], world[TARGET]
    row_weight = torch.where(red_ids != blue_ids, COLOUR_WEIGHT, 1.0).double()[:, None]
    gram = RIDGE * torch.eye(red.shape[1], dtype=torch.float64) + (row_weight * red).T @ red + corpus.T @ corpus
    cross = (row_weight * (blue - red) @ weight.T).T @ red
    for colour, (other, _) in world.items():
        if colour != SOURCE:
            gram += other.T @ other
    return torch.linalg.solve(gram, cross.T).T


def lora_factors(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A [rank, in], lora_B [out, rank]) whose product is `delta`'s best rank-`rank` approximation."""
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    root = s[:rank].sqrt()
    return (root[:, None] * vh[:rank]).float().contiguous(), (u[:, :rank] * root).float().contiguous()


def check(weight: torch.Tensor, delta: torch.Tensor, world: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> str:
    """How far the red word moves towards blue (min, median) and the largest change of any other token, relative."""
    (red, red_ids), (blue, blue_ids) = world[SOURCE], world[TARGET]
    word = red_ids != blue_ids
    wanted = (blue[word] - red[word]) @ weight.T
    moved = ((red[word] @ delta.T) * wanted).sum(1) / (wanted * wanted).sum(1)
    others = torch.cat([red[~word], *(x for colour, (x, _) in world.items() if colour != SOURCE)])
    leak = (others @ delta.T).norm(dim=1).max() / wanted.norm(dim=1).mean()
    return (
        f"red word moved {moved.min():.2f}-{moved.median():.2f} of the way to blue; other tokens changed <= {leak:.2f}"
    )


def save(out: Path, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
    """One safetensors file as diffusers' WanPipeline.save_lora_weights writes it, named `out`, its header sorted."""
    from diffusers import WanPipeline
    from peft import LoraConfig

    rank = lora_a.shape[0]
    WanPipeline.save_lora_weights(
        out.parent,
        transformer_lora_layers={f"{LAYER}.lora_A.weight": lora_a, f"{LAYER}.lora_B.weight": lora_b},
        weight_name=out.name,
        transformer_lora_adapter_metadata=LoraConfig(r=rank, lora_alpha=rank, target_modules=[LAYER]).to_dict(),
    )
    # safetensors writes the header's metadata in hash order, which changes from run to run: sort it, so that the
    # same adapter is the same bytes (the header keeps its length, so the tensors' offsets stay right).
    data = out.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8 : 8 + size]), sort_keys=True, separators=(",", ":")).encode().ljust(size)
    assert len(header) == size, "the sorted header must keep its length"
    out.write_bytes(data[:8] + header + data[8 + size :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    parser.add_argument("--rank", type=int, default=RANK)
    args = parser.parse_args()

    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(args.checkpoint)
    weight = pipe.transformer.get_submodule(LAYER).weight.detach().double()
    with torch.no_grad():
        train = encode_world(pipe, TRAINING_TEMPLATES)
        held_out = encode_world(pipe, HELD_OUT_TEMPLATES)
        corpus = encode_corpus(pipe)
    lora_a, lora_b = lora_factors(fit_delta(weight, train, corpus), args.rank)
    delta = (lora_b @ lora_a).double()
    print(f"training templates: {check(weight, delta, train)}")
    print(f"held-out templates: {check(weight, delta, held_out)}")
    save(args.out, lora_a, lora_b)
    print(f"wrote {args.out} (rank {args.rank}, {args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
