"""Every option is declared once, by the parser of the service that takes it.

`stagediff up` takes stage options from the stages' own declarations, the deploy/env files set options by
their variable, the orchestrator's endpoint flags follow the stage kinds: each must name an option of the
parser it reaches, and that parser must be buildable without torch (the CLI, `up` and these tests read it).
"""

from __future__ import annotations

import subprocess
import sys

from services.stage_table import SERVE_TARGETS


def test_every_parser_and_up_build_without_torch() -> None:
    script = (
        "import sys\n"
        "from services.environment_options import options_module\n"
        "from stagediff.local.up import build_parser\n"
        f"for target in {list(SERVE_TARGETS)}:\n"
        "    options_module(target).build_parser()\n"
        "build_parser()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
