"""The interpolation stage's configuration: built once in `main` from its parsed options, then handed down.

`InterpConfig` embeds the configuration every stage shares (services/stage_config.py) and adds the learned
model, if any; nothing below `main` reads the parsed options.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.stage_config import StageConfig


@dataclass(frozen=True)
class InterpConfig:
    """What `stagediff serve interp` runs with (interp_svc/options.py has each flag's help)."""

    stage: StageConfig
    """The options every stage shares: checkpoint (optional here), device, server."""
    model_path: str
    """RIFE flownet.pkl served (--interp-model-path); empty: optical flow, no weights."""

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> InterpConfig:
        """The configuration the parsed options give; raises ValueError naming the first problem."""
        return cls(stage=StageConfig.from_options("interp", args), model_path=args.interp_model_path)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InterpConfig:
        """`from_options`, exiting with `stagediff serve interp: <problem>` instead of raising."""
        try:
            return cls.from_options(args)
        except ValueError as error:
            raise SystemExit(f"stagediff serve interp: {error}") from None
