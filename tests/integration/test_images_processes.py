"""Input images: every bad file is refused naming the field, and decoding matches diffusers' load_image exactly."""

from __future__ import annotations

import subprocess
import sys


def test_module_imports_neither_torch_nor_diffusers() -> None:
    code = "import sys, services.images; print(sorted({'torch', 'diffusers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
