"""The kinds of stage a cluster can run: one entry per stage.

A stage kind is a gRPC service in its own package (`<package>.service` has a `main(argv)` that serves it,
`<package>.options` declares its flags once, without torch) with its proto service in
protos/stagediff/v1/stages.proto. The orchestrator takes one `--<name>` endpoint
flag per kind, `stagediff serve <name>` starts it, and `stagediff up` starts the ones the served model's
chain uses (each family declares its chain in families/). Adding a stage kind is: its package, its proto
service, and one entry here (docs/design.md, "How to add a stage").

This module imports nothing heavy: the client, the CLI and the orchestrator read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageKind:
    name: str  # the stage's name on the command line, in metrics, logs and job events
    module: str  # the module whose main(argv) serves it
    service: str  # its proto service (full name), which health checks ask about
    default_port: int
    # Whether the stage loads the served diffusers checkpoint (--model DIR). The interpolator does not:
    # its weights are its own (--model-path).
    reads_checkpoint: bool
    summary: str
    # How long its calls in flight may run on after SIGTERM (--drain-grace): its longest call at real size,
    # so that an upgrade or a scale-in finishes the work instead of redoing it on another replica.
    drain_grace_s: float
    # Whether one replica may serve several models whose checkpoints hold the same files for it
    # (`--also-serve DIR`: services/component_identity.py); the DiT and the interpolator serve one.
    shares_components: bool = False


STAGES: dict[str, StageKind] = {
    stage.name: stage
    for stage in (
        StageKind(
            name="text-encoder",
            module="text_encoder_svc.service",
            service="stagediff.v1.TextEncoder",
            default_port=50061,
            reads_checkpoint=True,
            summary="prompts -> the embeddings the DiT takes",
            drain_grace_s=30.0,
            shares_components=True,
        ),
        StageKind(
            name="dit",
            module="dit_svc.service",
            service="stagediff.v1.Denoiser",
            default_port=50062,
            reads_checkpoint=True,
            summary="embeddings and a seed -> latents, one latent frame at a time",
            drain_grace_s=600.0,
        ),
        StageKind(
            name="vae",
            module="vae_svc.service",
            service="stagediff.v1.VaeDecoder",
            default_port=50063,
            reads_checkpoint=True,
            summary="latent frames -> uint8 frames",
            drain_grace_s=120.0,
            shares_components=True,
        ),
        StageKind(
            name="interp",
            module="interp_svc.service",
            service="stagediff.v1.Interpolator",
            default_port=50064,
            reads_checkpoint=False,
            summary="frames -> denser frames (RIFE), when a request asks for interpolation",
            drain_grace_s=120.0,
        ),
    )
}

# `stagediff serve` targets: the orchestrator, its HTTP gateway and every stage kind.
SERVE_TARGETS: dict[str, str] = {
    "orchestrator": "services.orchestrator.service",
    "http": "services.gateway.service",
} | {name: stage.module for name, stage in STAGES.items()}
