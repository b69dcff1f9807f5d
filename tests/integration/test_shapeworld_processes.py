"""The shape world: deterministic scenes, prompts that parse back, held-out splits, and a reading of the frames
that gets every rendered concept right and refuses to guess where the object is missing."""

from __future__ import annotations

import sys


def test_the_world_and_its_reading_import_no_torch() -> None:
    import subprocess

    code = "import sys, shapeworld.world, shapeworld.score, shapeworld.evaluation; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
