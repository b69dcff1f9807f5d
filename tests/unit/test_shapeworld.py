"""The shape world: deterministic scenes, prompts that parse back, held-out splits, and a reading of the frames
that gets every rendered concept right and refuses to guess where the object is missing."""

from __future__ import annotations

import numpy as np
import pytest

from shapeworld.evaluation import SPLITS, evaluation_set, summarise
from shapeworld.score import ATTRIBUTES, read_video, score
from shapeworld.world import (
    HELD_OUT_COMBINATIONS,
    HELD_OUT_TEMPLATES,
    MOTION_PHRASES,
    TRAINING_TEMPLATES,
    Concept,
    all_concepts,
    parse_prompt,
    render,
    sample_scene,
    training_concepts,
)


def test_scenes_and_frames_are_deterministic_in_the_seed() -> None:
    concept = Concept("triangle", "cyan", "growing", "checkered")
    first = render(sample_scene(concept, np.random.default_rng(7)), 9, 64, 64)
    again = render(sample_scene(concept, np.random.default_rng(7)), 9, 64, 64)
    other = render(sample_scene(concept, np.random.default_rng(8)), 9, 64, 64)
    assert first.dtype == np.uint8 and first.shape == (9, 64, 64, 3)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_nine_frames_sample_the_path_of_seventeen() -> None:
    scene = sample_scene(Concept("circle", "red", "right", "dark"), np.random.default_rng(0))
    assert np.array_equal(render(scene, 9, 64, 64), render(scene, 17, 64, 64)[::2])


@pytest.mark.parametrize("num_frames", [9, 17])
def test_the_reading_gets_every_rendered_concept_right(num_frames: int) -> None:
    rng = np.random.default_rng(num_frames)
    wrong = []
    for concept in all_concepts():
        reading = read_video(render(sample_scene(concept, rng), num_frames, 64, 64))
        if not all(score(reading, concept).values()):
            wrong.append((concept, reading))
    assert not wrong, wrong[:3]


def test_the_reading_works_at_other_sizes() -> None:
    # At 32x32 an object is about 6 pixels across: too few for its outline, so the shape is not read there.
    rng = np.random.default_rng(3)
    for concept in all_concepts()[::7]:
        for (height, width), attributes in (((32, 32), ("colour", "motion", "background")), ((48, 80), ATTRIBUTES)):
            reading = read_video(render(sample_scene(concept, rng), 13, height, width))
            result = score(reading, concept)
            assert all(result[name] for name in attributes), (concept, height, width, reading)


def test_a_video_without_the_object_reads_as_missing() -> None:
    blank = np.full((9, 64, 64, 3), 120, dtype=np.uint8)
    reading = read_video(blank)
    assert reading.shape is reading.colour is reading.motion is None
    assert reading.background == "gray"
    assert score(reading, Concept("circle", "red", "still", "gray")) == {
        "shape": False,
        "colour": False,
        "motion": False,
        "background": True,
    }
    noise = np.random.default_rng(0).integers(0, 256, (9, 64, 64, 3), dtype=np.uint8)
    assert not all(score(read_video(noise), Concept("circle", "red", "still", "gray")).values())
    with pytest.raises(ValueError, match="uint8"):
        read_video(blank.astype(np.float32))


def test_every_prompt_parses_back_to_its_concept() -> None:
    for concept in all_concepts():
        for template in TRAINING_TEMPLATES + HELD_OUT_TEMPLATES:
            for phrase in range(len(MOTION_PHRASES[concept.motion])):
                assert parse_prompt(concept.prompt(template, phrase)) == concept
    with pytest.raises(ValueError, match="one colour"):
        parse_prompt("a circle moving left on a dark background")
    with pytest.raises(ValueError, match="one motion"):
        parse_prompt("a red circle on a dark background")
    with pytest.raises(ValueError, match="shape 'hexagon'"):
        Concept("hexagon", "red", "left", "dark")


def test_held_out_combinations_are_out_of_training_and_their_parts_are_in() -> None:
    trained = training_concepts()
    assert not any(concept.held_out for concept in trained)
    seen = {(c.colour, c.shape, c.motion) for c in trained}
    assert seen.isdisjoint(HELD_OUT_COMBINATIONS)
    for colour, shape, motion in HELD_OUT_COMBINATIONS:
        assert any(c.colour == colour for c in trained)
        assert any(c.shape == shape for c in trained)
        assert any(c.motion == motion for c in trained)
    assert set(TRAINING_TEMPLATES).isdisjoint(HELD_OUT_TEMPLATES)


def test_the_evaluation_set_is_fixed_and_covers_every_split() -> None:
    cases = evaluation_set()
    assert len(cases) >= 40 and cases == evaluation_set()
    assert {case.split for case in cases} == set(SPLITS)
    for case in cases:
        assert parse_prompt(case.prompt) == case.concept
        held_out_template = any(case.prompt == case.concept.prompt(t, p) for t in HELD_OUT_TEMPLATES for p in range(4))
        assert case.concept.held_out == (case.split in ("held-out combination", "held-out both"))
        assert held_out_template == (case.split in ("held-out phrasing", "held-out both"))
    scores = [{name: index % 2 == 0 for name in ATTRIBUTES} for index in range(len(cases))]
    summary = summarise(cases, scores)
    assert summary["overall"]["all"] == 0.5 and summary["overall"]["videos"] == len(cases)
