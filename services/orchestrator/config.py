"""The orchestrator's configuration: built once from its parsed options in `main`, checked, then handed down.

`OrchestratorConfig.from_options` reads the parsed `stagediff serve orchestrator` options (options.py);
`__post_init__` refuses values that leave no room to work, with the message `main` gives the parser's
error (naming the flag and what is allowed). Nothing below `main` reads the parsed options themselves.
The public server's address, limits, TLS files and logging are the `ServerConfig` every gRPC service shares
(services/server_config.py); the cluster secret and the stage channels' TLS are read in `main` by their shared
helpers (services/auth.py).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.orchestrator.discovery import StageSources
from services.orchestrator.preemption import CheckpointPolicy, PreemptionPolicy
from services.orchestrator.sizes import MinFree
from services.orchestrator.stage_clients import STAGE_ORDER
from services.orchestrator.store_location import (
    LocalBlobsLocation,
    PostgresLocation,
    S3Location,
    SqliteLocation,
    blobs_location,
    store_location,
)
from services.server_config import ServerConfig

# Each count flag and the least value it allows, in the order they are checked.
_LEAST = (
    ("max_running_jobs", "--max-running-jobs", 1),
    ("max_queued_jobs", "--max-queued-jobs", 1),
    ("stage_retries", "--stage-retries", 0),
    ("max_kept_jobs", "--max-kept-jobs", 1),
    ("max_job_attempts", "--max-job-attempts", 1),
    ("adapters_per_minute", "--adapters-per-minute", 0),
)
# The step-scheduling flags, each with the policy field it sets and the least value it allows.
_STEP_LEAST = (
    ("max_preemptions", "--max-preemptions", 0),
    ("preemption_protect_steps", "--preemption-protect-steps", 0),
    ("checkpoint_every", "--checkpoint-every", 0),
    ("checkpoint_min_steps", "--checkpoint-min-steps", 0),
)
MAX_DETACH_GRACE_S = 3600
MAX_COLD_START_S = 24 * 3600  # a day: a pool that takes longer to start is not starting
MAX_PRESIGN_S = 7 * 24 * 3600  # S3's longest presigned URL


@dataclass(frozen=True)
class OrchestratorConfig:
    """What `stagediff serve orchestrator` runs with (options.py has each flag's help)."""

    server: ServerConfig
    """The public gRPC server: address, limits, credentials, logging and metrics (shared with the stages)."""
    # The endpoints of each stage kind given (`--<stage> HOST:PORT[,HOST:PORT...]`); kinds without are absent.
    stage_endpoints: Mapping[str, str]
    max_running_jobs: int
    max_queued_jobs: int
    stage_retries: int
    detach_grace_s: float
    health_interval_s: float
    replica_wait_s: float
    # How long a call waits for a replica where none serves its model (a pool at zero); 0: replica_wait_s.
    cold_start_timeout_s: float
    # The tenants YAML file; None: the open registry.
    tenants_file: str | None
    state_dir: str
    # Where job records live (SQLite in state_dir, or PostgreSQL) and where files live (None: state_dir).
    store: SqliteLocation | PostgresLocation
    store_password_file: str | None
    blobs: LocalBlobsLocation | S3Location | None
    # Seconds a presigned download URL of a result lives; 0: downloads are not presigned.
    presign_downloads_s: int
    # With PostgreSQL: where peers reach this replica (None: this host's name and port), and the leases.
    advertise: str | None
    leader_lease_s: float
    job_lease_s: float
    drain_grace_s: float
    # How long a job runs on past a finished stage before its output is written to the store (kept_outputs.py).
    keep_outputs_after_s: float
    max_kept_jobs: int
    max_stored_bytes_per_tenant: int
    # Seconds a finished job is kept; 0: no age limit.
    job_retention_s: float
    min_free: MinFree
    max_job_attempts: int
    adapters_per_minute: int
    # --[no-]batch-per-tenant; None: on with a tenants file, off without (options.batch_per_tenant).
    batch_per_tenant: bool | None
    # Who yields a DiT slot to a waiting job (--preemption, --max-preemptions, --preemption-protect-steps).
    preemption: PreemptionPolicy = PreemptionPolicy()
    # How often a running job's denoising state is saved (--checkpoint-every, --checkpoint-min-steps).
    checkpoint: CheckpointPolicy = CheckpointPolicy()

    def __post_init__(self) -> None:
        for name, flag, least in _LEAST:
            value = getattr(self, name)
            if value < least:
                raise ValueError(f"{flag} {value}: use {least} or more")
        if not (math.isfinite(self.job_retention_s) and self.job_retention_s >= 0):
            raise ValueError(f"--job-retention {self.job_retention_s}: use 0 (no age limit) or more seconds")
        if self.max_stored_bytes_per_tenant < 1:
            raise ValueError(f"--max-stored-bytes-per-tenant {self.max_stored_bytes_per_tenant}: use 1 byte or more")
        if not 0 <= self.presign_downloads_s <= MAX_PRESIGN_S:
            raise ValueError(f"--presign-downloads {self.presign_downloads_s}: use 0 (off) to {MAX_PRESIGN_S} seconds")
        if self.presign_downloads_s and not isinstance(self.blobs, S3Location):
            raise ValueError("--presign-downloads: only with --blobs s3://... (the store signs the URLs)")
        if not (math.isfinite(self.leader_lease_s) and 3.0 <= self.leader_lease_s <= 600.0):
            raise ValueError(f"--leader-lease {self.leader_lease_s}: use 3 to 600 seconds")
        if not (math.isfinite(self.job_lease_s) and 3.0 <= self.job_lease_s <= 3600.0):
            raise ValueError(f"--job-lease {self.job_lease_s}: use 3 to 3600 seconds")
        if not (math.isfinite(self.drain_grace_s) and 0 <= self.drain_grace_s <= MAX_DETACH_GRACE_S):
            raise ValueError(f"--drain-grace {self.drain_grace_s}: use 0 to {MAX_DETACH_GRACE_S} seconds")
        if self.advertise is not None and (":" not in self.advertise or not self.advertise.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"--advertise '{self.advertise}': use HOST:PORT")
        if not (math.isfinite(self.keep_outputs_after_s) and 0 <= self.keep_outputs_after_s <= MAX_DETACH_GRACE_S):
            raise ValueError(f"--keep-outputs-after {self.keep_outputs_after_s}: use 0 to {MAX_DETACH_GRACE_S} seconds")
        if not (math.isfinite(self.cold_start_timeout_s) and 0 <= self.cold_start_timeout_s <= MAX_COLD_START_S):
            raise ValueError(
                f"--cold-start-timeout {self.cold_start_timeout_s}: use 0 to {MAX_COLD_START_S:.0f} seconds"
            )
        if not (math.isfinite(self.detach_grace_s) and 0 <= self.detach_grace_s <= MAX_DETACH_GRACE_S):
            raise ValueError(f"--detach-grace {self.detach_grace_s}: use 0 to {MAX_DETACH_GRACE_S} seconds")

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> OrchestratorConfig:
        """The configuration the parsed options give; raises ValueError naming the first flag out of bounds."""
        endpoints = {stage: getattr(args, stage.replace("-", "_")) for stage in STAGE_ORDER}
        for stage, value in endpoints.items():
            if value is not None:
                StageSources.parse(stage, value)  # ValueError naming the flag and the source
        if args.store_password_file and not args.store:
            raise ValueError("--store-password-file: only with --store postgresql://...")
        if args.blobs_endpoint and not args.blobs:
            raise ValueError("--blobs-endpoint: only with --blobs s3://...")
        for name, flag, least in _STEP_LEAST:
            value = getattr(args, name)
            if value < least:
                raise ValueError(f"{flag} {value}: use {least} or more")
        return cls(
            server=ServerConfig.from_options(args),
            stage_endpoints={stage: value for stage, value in endpoints.items() if value is not None},
            max_running_jobs=args.max_running_jobs,
            max_queued_jobs=args.max_queued_jobs,
            stage_retries=args.stage_retries,
            detach_grace_s=args.detach_grace,
            health_interval_s=args.health_interval,
            replica_wait_s=args.replica_wait,
            cold_start_timeout_s=args.cold_start_timeout,
            tenants_file=args.tenants or None,
            state_dir=args.state_dir,
            store=store_location(args.store) if args.store else SqliteLocation(Path(args.state_dir)),
            store_password_file=args.store_password_file,
            blobs=blobs_location(args.blobs, endpoint=args.blobs_endpoint, checksums=args.blobs_checksums)
            if args.blobs
            else None,
            presign_downloads_s=args.presign_downloads,
            advertise=args.advertise,
            leader_lease_s=args.leader_lease,
            job_lease_s=args.job_lease,
            drain_grace_s=args.drain_grace,
            keep_outputs_after_s=args.keep_outputs_after,
            max_kept_jobs=args.max_kept_jobs,
            max_stored_bytes_per_tenant=args.max_stored_bytes_per_tenant,
            job_retention_s=args.job_retention,
            min_free=args.min_free_bytes,
            max_job_attempts=args.max_job_attempts,
            adapters_per_minute=args.adapters_per_minute,
            batch_per_tenant=args.batch_per_tenant,
            preemption=PreemptionPolicy(
                enabled=args.preemption == "on",
                max_preemptions=args.max_preemptions,
                protect_last_steps=args.preemption_protect_steps,
            ),
            checkpoint=CheckpointPolicy(every=args.checkpoint_every, min_steps=args.checkpoint_min_steps),
        )
