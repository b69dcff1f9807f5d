"""Training the demo model's `WanTransformer3DModel` with flow matching on the autoencoder's latents.

- **Data.** Scenes of the training concepts, each rendered at 17 frames and at 9 (the same path sampled half as
  densely), encoded by the trained autoencoder (posterior mean) and normalised with the per-channel statistics
  that go into the VAE's config (`latents_mean`, `latents_std`), as WanPipeline de-normalises them. Steps
  alternate between the two lengths, so the model serves both.
- **Text.** Every training prompt (each training template with each motion phrase, for every training concept)
  is embedded once by the serving code's own `WanPromptEncoder` (UMT5, zero past the text, 512 positions), so
  training sees exactly the embeddings a request gets. Each step draws one prompt per scene.
- **Flow matching** as the Wan scheduler samples it: x_t = (1 - sigma) x_0 + sigma noise, the model predicts
  noise - x_0 at timestep 1000 sigma, with sigma = shift u / (1 + (shift - 1) u), u uniform.
- **Classifier-free guidance**: a prompt is replaced by the empty prompt's embedding (the pipeline's default
  negative prompt) with probability `unconditional_probability`.
- **The padding folded, exactly.** In Wan's cross-attention (no positional encoding there) every zero padding
  position of the 512 gives the same key and value, and N equal keys weigh in the softmax as one key with log N
  added to its logit. So training feeds the text positions, one padding position and that log N as an additive
  mask (`FoldedPadding`): the same function as the 512 positions the model serves with, at a fraction of the
  cost. The saved model has the library's own processors.
- An exponential moving average of the weights is what gets saved.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel

from shapeworld.train_vae import fast_rms_norm, to_model_range
from shapeworld.world import MOTION_PHRASES, TRAINING_TEMPLATES, Concept, render, sample_scene


@dataclass(frozen=True)
class DitSchedule:
    scenes: int = 2000  # distinct training videos (each at both lengths)
    frames: tuple[int, ...] = (9, 17)
    size: int = 64
    steps: int = 10000
    batch: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    unconditional_probability: float = 0.1
    # Of the training sigmas: most steps at high noise, where the prompt decides where the object goes (at
    # low noise the noisy video already shows it, and the words barely change the loss).
    shift: float = 6.0
    ema_decay: float = 0.995
    grad_clip: float = 1.0


@dataclass
class LatentSet:
    """Normalised latents of every scene at each length, and the concept each shows."""

    latents: dict[int, torch.Tensor]  # frames -> [N, C, T', h, w]
    concepts: list[Concept]
    mean: torch.Tensor  # [C] per-channel statistics of the raw latents
    std: torch.Tensor


def encode_scenes(
    vae: AutoencoderKLWan,
    concepts: list[Concept],
    schedule: DitSchedule,
    seed: int,
    on_progress: Callable[[int, int], None],
    batch: int = 16,
) -> LatentSet:
    """Renders `schedule.scenes` scenes (concepts in turn) and encodes each at every length in `schedule.frames`."""
    rng = np.random.default_rng(seed)
    chosen = [concepts[index % len(concepts)] for index in rng.permutation(schedule.scenes)]
    scenes = [sample_scene(concept, rng) for concept in chosen]
    raw: dict[int, list[torch.Tensor]] = {frames: [] for frames in schedule.frames}
    done = 0
    with torch.no_grad(), fast_rms_norm():
        for start in range(0, len(scenes), batch):
            group = scenes[start : start + batch]
            for frames in schedule.frames:
                video = to_model_range(
                    np.stack([render(scene, frames, schedule.size, schedule.size) for scene in group])
                )
                raw[frames].append(vae.encode(video).latent_dist.mode())
            done += len(group)
            on_progress(done, len(scenes))
    stacked = {frames: torch.cat(parts) for frames, parts in raw.items()}
    # Per-channel statistics over every latent of every length, as the published checkpoints give them.
    channels = torch.cat([latents.transpose(0, 1).flatten(1) for latents in stacked.values()], dim=1)
    mean, std = channels.mean(dim=1), channels.std(dim=1)
    shape = (1, -1, 1, 1, 1)
    normalised = {frames: (latents - mean.view(shape)) / std.view(shape) for frames, latents in stacked.items()}
    return LatentSet(latents=normalised, concepts=chosen, mean=mean, std=std)


def training_prompts(concept: Concept) -> list[str]:
    """Every way the training templates say `concept`."""
    return [
        concept.prompt(template, phrase)
        for template in TRAINING_TEMPLATES
        for phrase in range(len(MOTION_PHRASES[concept.motion]))
    ]


class FoldedPadding:
    """Cross-attention processor that adds log(padding count) to the logit of the one padding position kept."""

    def __init__(self, inner: Callable[..., torch.Tensor], padding: int) -> None:
        self.inner = inner
        self.padding = padding

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Any = None,
    ) -> torch.Tensor:
        assert encoder_hidden_states is not None  # installed on cross-attention only
        bias = torch.zeros(1, 1, 1, encoder_hidden_states.shape[1], dtype=hidden_states.dtype)
        bias[..., -1] = math.log(self.padding)
        return self.inner(attn, hidden_states, encoder_hidden_states, bias, rotary_emb)


@contextlib.contextmanager
def folded_padding(transformer: WanTransformer3DModel, padding: int) -> Iterator[None]:
    """Every block's cross-attention folds its `padding` trailing padding positions into the last one given."""
    originals = [block.attn2.processor for block in transformer.blocks]
    for block, original in zip(transformer.blocks, originals, strict=True):
        block.attn2.set_processor(FoldedPadding(original, padding))
    try:
        yield
    finally:
        for block, original in zip(transformer.blocks, originals, strict=True):
            block.attn2.set_processor(original)


class PromptBank:
    """The embedding of every training prompt, kept to its length (the rest is zero).

    `batch` gives them as `longest` text positions and one padding position, which `folded_padding` counts as
    the `sequence_length - longest` padding positions the pipeline would give.
    """

    def __init__(
        self,
        embed_many: Callable[[list[str]], torch.Tensor],
        concepts: list[Concept],
        sequence_length: int,
        batch: int = 64,
    ) -> None:
        self.sequence_length = sequence_length
        self.prompts = {concept: training_prompts(concept) for concept in set(concepts)}
        texts = sorted({text for texts in self.prompts.values() for text in texts} | {""})
        self.embeddings: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for start in range(0, len(texts), batch):
                group = texts[start : start + batch]
                for text, embedding in zip(group, embed_many(group), strict=True):
                    self.embeddings[text] = _trim(embedding)
        self.dim = self.embeddings[""].shape[-1]
        self.longest = max(embedding.shape[0] for embedding in self.embeddings.values())
        if self.longest >= sequence_length:
            raise ValueError(f"a training prompt fills all {sequence_length} positions; nothing to fold")

    @property
    def folded_padding(self) -> int:
        """How many padding positions the one padding position of a batch stands for."""
        return self.sequence_length - self.longest

    def batch(
        self, concepts: list[Concept], rng: np.random.Generator, unconditional_probability: float
    ) -> torch.Tensor:
        """[B, longest + 1, dim]: one prompt per concept (the empty one with the given probability)."""
        out = torch.zeros(len(concepts), self.longest + 1, self.dim)
        for row, concept in enumerate(concepts):
            texts = self.prompts[concept]
            text = "" if rng.random() < unconditional_probability else texts[rng.integers(len(texts))]
            embedding = self.embeddings[text]
            out[row, : embedding.shape[0]] = embedding
        return out


def train_dit(
    transformer: WanTransformer3DModel,
    data: LatentSet,
    prompts: PromptBank,
    schedule: DitSchedule,
    seed: int,
    on_step: Callable[[int, dict[str, float]], None],
) -> tuple[WanTransformer3DModel, dict[str, float]]:
    """Trains `transformer`; returns its moving average and the mean losses of the last 100 steps."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    average = copy.deepcopy(transformer).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(
        transformer.parameters(), lr=schedule.learning_rate, weight_decay=schedule.weight_decay, betas=(0.9, 0.99)
    )
    lengths = sorted(data.latents)
    recent: list[float] = []
    transformer.train()
    with folded_padding(transformer, prompts.folded_padding):
        for step in range(schedule.steps):
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(schedule, step)
            # One length per step, in turn; a batch of its scenes, each with one of its prompts (or none).
            latents = data.latents[lengths[step % len(lengths)]]
            rows = rng.integers(0, latents.shape[0], schedule.batch)
            clean = latents[torch.from_numpy(rows)]
            embeddings = prompts.batch([data.concepts[i] for i in rows], rng, schedule.unconditional_probability)
            u = torch.rand(schedule.batch, generator=generator)
            sigma = (schedule.shift * u / (1 + (schedule.shift - 1) * u)).view(-1, 1, 1, 1, 1)
            noise = torch.randn(clean.shape, generator=generator)
            noisy = (1 - sigma) * clean + sigma * noise
            timestep = sigma.flatten() * 1000
            prediction = transformer(
                hidden_states=noisy, timestep=timestep, encoder_hidden_states=embeddings, return_dict=False
            )[0]
            loss = (prediction - (noise - clean)).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(transformer.parameters(), schedule.grad_clip)
            optimizer.step()
            decay = min(schedule.ema_decay, (1 + step) / (10 + step))
            with torch.no_grad():
                for kept, current in zip(average.parameters(), transformer.parameters(), strict=True):
                    kept.lerp_(current, 1 - decay)
            recent = [*recent[-99:], float(loss.detach())]
            on_step(step, {"loss": recent[-1]})
    transformer.eval()
    return average, {"loss": round(sum(recent) / len(recent), 5)}


def _learning_rate(schedule: DitSchedule, step: int) -> float:
    warmup = min(1.0, (step + 1) / schedule.warmup_steps)
    return schedule.learning_rate * warmup * 0.5 * (1.0 + math.cos(math.pi * step / schedule.steps))


def _trim(embedding: torch.Tensor) -> torch.Tensor:
    """[L, D] without its zero tail (the pipeline zeroes every position past the text)."""
    nonzero = embedding.abs().sum(dim=-1).nonzero()
    length = int(nonzero[-1]) + 1 if len(nonzero) else 0
    return embedding[:length].clone()
