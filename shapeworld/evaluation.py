"""The prompts the demo model is scored on, and the summary of the scores.

`evaluation_set()` is a fixed list of prompt x seed pairs that mixes four splits:

    seen            a training combination, said with a training template
    held-out phrasing   a training combination, said with a template never used in training
    held-out combination  a (colour, shape, motion) never shown in training, with a training template
    held-out both   a held-out combination with a held-out template

Every held-out combination is in it once with each kind of template, and the concepts are otherwise drawn
from a fixed generator, so the set is the same on every machine. `summarise` turns the per-video scores into
the fractions bench/demo_quality.py reports: per attribute, all attributes at once, per split.

numpy only, like the rest of shapeworld.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from shapeworld.score import ATTRIBUTES
from shapeworld.world import (
    BACKGROUNDS,
    HELD_OUT_COMBINATIONS,
    HELD_OUT_TEMPLATES,
    MOTION_PHRASES,
    TRAINING_TEMPLATES,
    Concept,
    training_concepts,
)

TARGET_ALL = 0.85  # fraction of videos that must be right on every attribute
SPLITS = ("seen", "held-out phrasing", "held-out combination", "held-out both")
EVALUATION_SEED = 20261201


@dataclass(frozen=True)
class Case:
    """One generation to score: the prompt, the seed of the request, what the prompt says and its split."""

    prompt: str
    seed: int
    concept: Concept
    split: str


def evaluation_set(seeds: Iterable[int] = (0, 1), seen_prompts: int = 12) -> list[Case]:
    """len(seeds) x (2 x len(HELD_OUT_COMBINATIONS) + 2 x seen_prompts) cases; 96 with the defaults."""
    rng = random.Random(EVALUATION_SEED)
    backgrounds = sorted(BACKGROUNDS)
    prompts: list[tuple[str, Concept, str]] = []
    for colour, shape, motion in HELD_OUT_COMBINATIONS:
        for templates, split in ((TRAINING_TEMPLATES, "held-out combination"), (HELD_OUT_TEMPLATES, "held-out both")):
            concept = Concept(shape, colour, motion, rng.choice(backgrounds))
            prompts.append(
                (concept.prompt(rng.choice(templates), rng.randrange(len(MOTION_PHRASES[motion]))), concept, split)
            )
    seen = rng.sample(training_concepts(), 2 * seen_prompts)
    for index, concept in enumerate(seen):
        templates, split = (TRAINING_TEMPLATES, "seen") if index % 2 == 0 else (HELD_OUT_TEMPLATES, "held-out phrasing")
        prompts.append(
            (concept.prompt(rng.choice(templates), rng.randrange(len(MOTION_PHRASES[concept.motion]))), concept, split)
        )
    return [Case(prompt, seed, concept, split) for seed in seeds for prompt, concept, split in prompts]


def summarise(cases: list[Case], scores: list[dict[str, bool]]) -> dict:
    """Fractions correct per attribute and for all attributes at once, overall and per split."""

    def fractions(indices: list[int]) -> dict[str, float]:
        count = max(1, len(indices))
        result = {name: round(sum(scores[i][name] for i in indices) / count, 4) for name in ATTRIBUTES}
        result["all"] = round(sum(all(scores[i].values()) for i in indices) / count, 4)
        result["videos"] = len(indices)
        return result

    everything = list(range(len(cases)))
    return {
        "overall": fractions(everything),
        "per_split": {split: fractions([i for i in everything if cases[i].split == split]) for split in SPLITS},
    }
