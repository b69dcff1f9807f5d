"""The configuration every stage service runs with (its options: services/stage_options.py).

Built once in the stage's `main` from its parsed options: `StageConfig.from_options` reads the checkpoint
(the only read of its configs in the stage process, so its traits are read once) and the server section
(services/server_config.py); `__post_init__` refuses counts that leave no room to work. Each stage's own
configuration embeds a `StageConfig` and adds its section; `services/stage_main.py` starts the stage from it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from services.checkpoint import CheckpointSpec, read_checkpoint
from services.component_identity import IdentityError, Served, StageIdentity, identify_stage
from services.server import DEFAULT_GRACE_SECONDS
from services.server_config import ServerConfig

MAX_DRAIN_GRACE_S = 24 * 3600.0  # a day: beyond it, a call is stuck rather than long


@dataclass(frozen=True)
class StageConfig:
    """What every `stagediff serve <stage>` runs with."""

    stage: str
    """The stage kind served (services/stage_table.py), as named in messages and logs."""
    checkpoint: CheckpointSpec | None
    """The checkpoint --model names, read once; None for a stage started without --model (only a stage that
    does not read the checkpoint allows that)."""
    device: str
    """auto, cpu, cuda or cuda:N (--device); resolved when the stage process starts."""
    dtype: str
    """auto, float32, bfloat16 or float16 (--dtype); resolved against the device when the process starts."""
    threads: int
    """torch intra-op threads; 0: torch's default (--threads)."""
    num_weight_load_threads: int
    """Threads reading safetensors shards (--num-weight-load-threads, 1 or more)."""
    multithread_weight_load: bool
    """False: read shards one at a time, in one thread (--disable-multithread-weight-load)."""
    server: ServerConfig
    """The gRPC server: address, limits, credentials, logging and metrics."""
    drain_grace_s: float = DEFAULT_GRACE_SECONDS
    """How long the calls in flight may run on after SIGTERM (--drain-grace, 0 to MAX_DRAIN_GRACE_S)."""
    identity: StageIdentity = StageIdentity({}, {}, ())
    """The components the stage holds and the models it serves (--model, then each --also-serve, whose
    components for this stage are checked to be the same files), as StageInfo reports them."""

    def __post_init__(self) -> None:
        if self.num_weight_load_threads < 1:
            raise ValueError(f"--num-weight-load-threads {self.num_weight_load_threads}: use 1 or more")
        if not (math.isfinite(self.drain_grace_s) and 0 <= self.drain_grace_s <= MAX_DRAIN_GRACE_S):
            raise ValueError(f"--drain-grace {self.drain_grace_s}: use 0 to {MAX_DRAIN_GRACE_S:.0f} seconds")

    @property
    def prog(self) -> str:
        """The command that starts this stage, which begins each refusal."""
        return f"stagediff serve {self.stage}"

    @property
    def load_threads(self) -> int:
        """Threads that read the weights while the stage loads."""
        return self.num_weight_load_threads if self.multithread_weight_load else 1

    @classmethod
    def from_options(
        cls, stage: str, args: argparse.Namespace, checkpoint: CheckpointSpec | None = None
    ) -> StageConfig:
        """The configuration the parsed options of `stage` give; raises ValueError (CheckpointError included)
        naming the first flag or checkpoint problem. `checkpoint`: `--model` as the stage's own config has
        already read it, so that it is read once."""
        if checkpoint is None and args.model is not None:
            checkpoint = read_checkpoint(args.model, args.model_name)
        also = [read_checkpoint(path) for path in getattr(args, "also_serve", None) or []]
        if also and checkpoint is None:
            raise ValueError("--also-serve: give --model too; it names the checkpoint whose weights are loaded")
        served = [Served(spec.model_id, spec.path, spec.traits) for spec in ([checkpoint] if checkpoint else []) + also]
        ids = [item.model_id for item in served]
        if len(set(ids)) < len(ids):
            raise ValueError(f"--also-serve: the model ids {', '.join(ids)} repeat one; each checkpoint serves one id")
        try:
            identity = identify_stage(stage, served) if served else StageIdentity({}, {}, ())
        except IdentityError as error:
            raise ValueError(str(error)) from None
        return cls(
            stage=stage,
            checkpoint=checkpoint,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            num_weight_load_threads=args.num_weight_load_threads,
            multithread_weight_load=not args.disable_multithread_weight_load,
            server=ServerConfig.from_options(args),
            drain_grace_s=args.drain_grace,
            identity=identity,
        )

    @classmethod
    def from_args(cls, stage: str, args: argparse.Namespace, checkpoint: CheckpointSpec | None = None) -> StageConfig:
        """`from_options`, exiting with `stagediff serve <stage>: <problem>` instead of raising."""
        try:
            return cls.from_options(stage, args, checkpoint)
        except ValueError as error:
            raise SystemExit(f"stagediff serve {stage}: {error}") from None
