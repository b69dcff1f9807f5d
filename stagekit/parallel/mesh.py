"""The DiT group's layout: one DeviceMesh with named dimensions.

Dimensions, outermost first: ``replica`` (ranks that compute the same thing; more
than 1 only when HSDP alone spreads the weights over more ranks than the compute
degrees use), ``cfg`` (one group per guidance branch), ``ring``
(strided groups), ``ulysses`` (contiguous groups), ``tp`` (innermost, so that
tensor-parallel peers are neighbours: on a GPU server, the same NVLink island).
Every degree multiplies into the world size. HSDP does not add ranks: it shards
each block's parameters over ``hsdp_shard_size`` of the same ranks (and
replicates over ``hsdp_replicate_size``), trading an all-gather per block for
memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("replica", "cfg", "ring", "ulysses", "tp")
# Each parallel method's flag, by its feature in the registry (families/base.py FEATURES).
METHOD_FLAGS = {
    "ulysses": "--ulysses-degree N",
    "ring": "--ring-degree N",
    "cfg_parallel": "--cfg-parallel-size 2",
    "tensor_parallel": "--tensor-parallel-size N",
    "hsdp": "--use-hsdp",
}


class FeatureSupport(Protocol):
    """One cell of a family's feature table (families/base.py Support)."""

    @property
    def supported(self) -> bool: ...

    @property
    def reason(self) -> str: ...


class SupportsFeatures(Protocol):
    """What the refusal below reads of a family (families/base.py Family)."""

    @property
    def name(self) -> str: ...

    def support(self, feature: str) -> FeatureSupport: ...


class ParallelConfigError(ValueError):
    """A layout that cannot work on this model or these devices; the message names the valid choices."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelConfig:
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_degree: int = 1
    tp_degree: int = 1
    use_hsdp: bool = False
    hsdp_shard_size: int = 1
    hsdp_replicate_size: int = 1

    @property
    def world_size(self) -> int:
        return self.cfg_degree * self.ring_degree * self.ulysses_degree * self.tp_degree

    @property
    def sequence_parallel(self) -> bool:
        return self.ulysses_degree * self.ring_degree > 1

    @property
    def shards_weights(self) -> bool:
        """Whether a rank holds only part of the weights (tensor parallelism or HSDP), and so reads only that part."""
        return self.tp_degree > 1 or (self.use_hsdp and self.hsdp_shard_size > 1)

    @property
    def replica_degree(self) -> int:
        if self.use_hsdp and self.world_size == 1:
            return self.hsdp_shard_size * self.hsdp_replicate_size
        return 1

    @property
    def total_ranks(self) -> int:
        """Processes the group starts: the compute degrees times the replicas."""
        return self.world_size * self.replica_degree

    def mesh_shape(self) -> tuple[int, ...]:
        return (self.replica_degree, self.cfg_degree, self.ring_degree, self.ulysses_degree, self.tp_degree)

    def describe(self) -> dict[str, str]:
        """The layout as GetClusterInfo reports it."""
        layout = {
            "world_size": str(self.total_ranks),
            "ulysses_degree": str(self.ulysses_degree),
            "ring_degree": str(self.ring_degree),
            "cfg_parallel_size": str(self.cfg_degree),
            "tensor_parallel_size": str(self.tp_degree),
            "mesh": " x ".join(f"{name}={size}" for name, size in zip(MESH_DIMS, self.mesh_shape(), strict=True)),
        }
        if self.use_hsdp:
            layout["hsdp_shard_size"] = str(self.hsdp_shard_size)
            layout["hsdp_replicate_size"] = str(self.hsdp_replicate_size)
        return layout

    def validate(self, num_heads: int, available_devices: int | None = None) -> None:
        """Refuses layouts that cannot work, naming what would.

        `available_devices` is the number of accelerators when running on them
        (None on the CPU, where any number of ranks can start).
        """
        for name, value in (
            ("--ulysses-degree", self.ulysses_degree),
            ("--ring-degree", self.ring_degree),
            ("--tensor-parallel-size", self.tp_degree),
            ("--hsdp-shard-size", self.hsdp_shard_size),
            ("--hsdp-replicate-size", self.hsdp_replicate_size),
        ):
            if value < 1:
                raise ParallelConfigError(f"{name} {value}: must be at least 1")
        if self.cfg_degree not in (1, 2):
            raise ParallelConfigError(
                f"--cfg-parallel-size {self.cfg_degree}: allowed 1 or 2 (one rank group per guidance branch)"
            )
        head_split = self.ulysses_degree * self.tp_degree
        if num_heads % head_split != 0:
            valid = _divisors(num_heads)
            raise ParallelConfigError(
                f"the model has {num_heads} attention heads, which --ulysses-degree {self.ulysses_degree} x "
                f"--tensor-parallel-size {self.tp_degree} = {head_split} does not divide; "
                f"Ulysses x TP must be one of {valid}"
            )
        if self.use_hsdp:
            hsdp_world = self.hsdp_shard_size * self.hsdp_replicate_size
            if hsdp_world != self.world_size and self.world_size != 1:
                raise ParallelConfigError(
                    f"--hsdp-shard-size {self.hsdp_shard_size} x --hsdp-replicate-size {self.hsdp_replicate_size} "
                    f"= {hsdp_world} must equal the world size {self.world_size} "
                    "(cfg x ring x ulysses x tp); valid shard sizes: "
                    f"{_divisors(self.world_size)}"
                )
            if self.tp_degree > 1:
                raise ParallelConfigError(
                    "--use-hsdp with --tensor-parallel-size > 1 is not supported: both shard the same weights; "
                    "use one of them"
                )
        elif self.hsdp_shard_size != 1 or self.hsdp_replicate_size != 1:
            raise ParallelConfigError("--hsdp-shard-size and --hsdp-replicate-size need --use-hsdp")
        if available_devices is not None and self.total_ranks > available_devices:
            raise ParallelConfigError(
                f"the layout needs {self.total_ranks} devices but {available_devices} are visible; "
                "lower the degrees or make more devices visible (CUDA_VISIBLE_DEVICES)"
            )


def build_mesh(config: ParallelConfig, device_type: str) -> DeviceMesh:
    """The compute mesh (replica, cfg, ring, ulysses, tp) over every rank of the default process group."""
    return init_device_mesh(device_type, config.mesh_shape(), mesh_dim_names=MESH_DIMS)


def build_hsdp_mesh(config: ParallelConfig, device_type: str) -> DeviceMesh:
    """The (replicate, shard) mesh fully_shard uses for HSDP, over the same ranks."""
    return init_device_mesh(
        device_type, (config.hsdp_replicate_size, config.hsdp_shard_size), mesh_dim_names=("replicate", "shard")
    )


def device_type_for(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def refuse_unsupported_methods(config: ParallelConfig, family: SupportsFeatures) -> None:
    """Refuses the parallel methods a family does not run, with the registry's reasons, naming what it runs."""
    used = {
        "ulysses": config.ulysses_degree > 1,
        "ring": config.ring_degree > 1,
        "cfg_parallel": config.cfg_degree > 1,
        "tensor_parallel": config.tp_degree > 1,
        "hsdp": config.use_hsdp,
    }
    refused = [feature for feature, on in used.items() if on and not family.support(feature).supported]
    if not refused:
        return
    flag = {feature: METHOD_FLAGS[feature].split()[0] for feature in refused}
    runs = " and ".join(METHOD_FLAGS[f] for f in METHOD_FLAGS if family.support(f).supported) or "on one rank only"
    reasons = "; ".join(f"{flag[feature]}: {family.support(feature).reason}" for feature in refused)
    raise ParallelConfigError(
        f"the {family.name} family does not support {', '.join(flag.values())}; it runs {runs} ({reasons})"
    )
