"""The tenants file: its schema (tenants, priority classes, quotas, models) and how it is read and validated.

The file's format, with every field, is shown in deploy/tenants.example.yaml; `Quotas` says what each quota
bounds and which have defaults. A tenant may be limited to some models (`models`, ids or fnmatch patterns) and
given quotas per model (`model_quotas`, which take precedence over its `quotas` for that model's jobs). The file
holds only the SHA-256 of each API key (`sha256:<hex>`, see keys.py), never a key. A file that cannot be read,
is not YAML, or fails validation raises TenantConfigError with one line per problem, naming the field (and the
tenant) without repeating any input.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_TENANT_NAME = "default"
_KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
_TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# Defaults of the quotas on what a job produces. 1025 frames is a 65-frame video interpolated 16x; 2**29
# pixels (1.5 GiB of RGB) is 321 frames of 1280x720 with room to spare.
DEFAULT_MAX_OUTPUT_FRAMES = 1025
DEFAULT_MAX_OUTPUT_PIXELS = 2**29
DEFAULT_MAX_WATCH_STREAMS = 32
# A tenant's LoRA allow-list: at most this many names or patterns, each at most this long.
MAX_LORA_PATTERNS = 256
MAX_LORA_PATTERN_CHARS = 129
# A tenant's model allow-list, bounded the same way; and its per-model quotas, keyed by model ids (at most as long
# as a request's model id, services/orchestrator/request_bounds.py).
MAX_MODEL_PATTERNS = 256
MAX_MODEL_PATTERN_CHARS = 129
MAX_MODEL_QUOTAS = 256
MAX_MODEL_ID_CHARS = 128


class TenantConfigError(ValueError):
    """The tenants file is missing, not YAML, or fails validation; the message names the field. `problems` holds
    each problem on its own, named by the file and the field's path (the message alone, when there is one)."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems) or [message]


class PriorityClass(enum.StrEnum):
    """Priority classes, highest first.

    The scheduler serves a waiting job of a higher class before any of a lower
    one; inside a class, tenants share the running slots in proportion to
    their weights. `rank` orders them: 0 is served first.
    """

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        return _PRIORITY_RANKS[self]


_PRIORITY_RANKS = {PriorityClass.HIGH: 0, PriorityClass.NORMAL: 1, PriorityClass.LOW: 2}


class Quotas(BaseModel):
    """A tenant's limits; None means unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_running_jobs: Annotated[int, Field(gt=0)] | None = None
    max_queued_jobs: Annotated[int, Field(gt=0)] | None = None
    requests_per_minute: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    # Requests the bucket holds: how many may arrive at once after a quiet spell.
    # Default: one minute's worth (requests_per_minute, at least 1).
    burst: Annotated[int, Field(gt=0)] | None = None
    max_height: Annotated[int, Field(gt=0)] | None = None
    max_width: Annotated[int, Field(gt=0)] | None = None
    max_pixels: Annotated[int, Field(gt=0)] | None = None
    max_frames: Annotated[int, Field(gt=0)] | None = None
    max_steps: Annotated[int, Field(gt=0)] | None = None
    # What a job produces, after interpolation: these bound the disk and the wire, and they have defaults
    # (the open tenant included); `null` in the file lifts them.
    max_output_frames: Annotated[int, Field(gt=0)] | None = DEFAULT_MAX_OUTPUT_FRAMES
    max_output_pixels: Annotated[int, Field(gt=0)] | None = DEFAULT_MAX_OUTPUT_PIXELS
    # WatchJob streams the tenant may hold open at once (each replays a whole result).
    max_watch_streams: Annotated[int, Field(gt=0)] | None = DEFAULT_MAX_WATCH_STREAMS
    # What the tenant keeps in the orchestrator's state dir: finished jobs, and bytes of results and
    # intermediates. Absent (or null): the orchestrator's --max-kept-jobs and --max-stored-bytes-per-tenant.
    max_kept_jobs: Annotated[int, Field(gt=0)] | None = None
    max_stored_bytes: Annotated[int, Field(gt=0)] | None = None
    # Distinct LoRA adapters its requests may name in any minute (services/orchestrator/adapter_rate.py).
    # Absent (or null): the orchestrator's --adapters-per-minute.
    adapters_per_minute: Annotated[int, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _burst_needs_a_rate(self) -> Quotas:
        if self.burst is not None and self.requests_per_minute is None:
            raise ValueError("burst: set only together with requests_per_minute")
        return self

    @property
    def bucket_capacity(self) -> int | None:
        """Token-bucket size for the rate limit, or None when there is no rate limit."""
        if self.requests_per_minute is None:
            return None
        return self.burst if self.burst is not None else max(1, math.ceil(self.requests_per_minute))


# Quotas that bound a tenant as a whole (its request rate, open streams, storage, adapter loads), not its jobs on
# one model: `quotas` only, never `model_quotas`.
TENANT_WIDE_QUOTAS = (
    "requests_per_minute",
    "burst",
    "max_watch_streams",
    "max_kept_jobs",
    "max_stored_bytes",
    "adapters_per_minute",
)


class Tenant(BaseModel):
    """One tenant: its name, the hashes of its API keys, its priority class, weight, whether its jobs may be
    preempted, its quotas, and the models it may use with their own quotas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=_TENANT_NAME)]
    api_keys: tuple[str, ...] = ()
    priority: PriorityClass = PriorityClass.NORMAL
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    # False: its jobs never yield their DiT slot to a waiting job of a higher class (services/orchestrator/
    # preemption.py); they still wait for slots like any other.
    preemptible: bool = True
    quotas: Quotas = Quotas()
    # An operator's tenant: may read the cluster's internals (GetClusterInfo: endpoints, devices, weights,
    # every tenant's load). The open tenant of a cluster without a tenants file is one too.
    admin: bool = False
    # LoRA adapters it may use (services/orchestrator/lora_access.py): names or fnmatch patterns of the adapters
    # at the top of the DiT's --lora-dir. Adapters in its own subdirectory ("NAME/...") need no entry, and no
    # pattern reaches another tenant's.
    loras: Annotated[
        tuple[Annotated[str, Field(min_length=1, max_length=MAX_LORA_PATTERN_CHARS)], ...],
        Field(max_length=MAX_LORA_PATTERNS),
    ] = ()
    # Models it may use: ids or fnmatch patterns of the ids ListModels shows ("wan-*"). Empty: every model.
    models: Annotated[
        tuple[Annotated[str, Field(min_length=1, max_length=MAX_MODEL_PATTERN_CHARS)], ...],
        Field(max_length=MAX_MODEL_PATTERNS),
    ] = ()
    # Quotas of its jobs on one model (model id -> Quotas): a field set there takes precedence over `quotas` for
    # that model's jobs (`quotas_for`); a field left out falls back to `quotas`. An id no stage serves (yet) is
    # allowed: models come and go at run time.
    model_quotas: Annotated[
        dict[Annotated[str, Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)], Quotas],
        Field(max_length=MAX_MODEL_QUOTAS),
    ] = {}

    # model_quotas is a dict, which cannot be hashed: equal tenants have equal names and keys.
    def __hash__(self) -> int:
        return hash((self.name, self.api_keys))

    def may_use(self, model: str) -> bool:
        """Whether the tenant may use the model with this id: every model without a `models` list."""
        return not self.models or any(fnmatchcase(model, pattern) for pattern in self.models)

    def quotas_for(self, model: str) -> Quotas:
        """The quotas of the tenant's jobs on `model`: its `quotas`, with the fields set in `model_quotas[model]`
        taking precedence (`null` there lifts a limit for that model)."""
        override = self.model_quotas.get(model)
        if override is None:
            return self.quotas
        return self.quotas.model_copy(update={name: getattr(override, name) for name in override.model_fields_set})

    @field_validator("model_quotas")
    @classmethod
    def _per_model_quotas_only(cls, quotas: dict[str, Quotas]) -> dict[str, Quotas]:
        for model, entry in quotas.items():
            wide = [name for name in TENANT_WIDE_QUOTAS if name in entry.model_fields_set]
            if wide:
                raise ValueError(
                    f"'{model}': {', '.join(wide)} bound the tenant as a whole, not one model; set them in quotas"
                )
        return quotas

    @field_validator("api_keys")
    @classmethod
    def _hashes_only(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for index, key in enumerate(keys):
            # Never repeat the value: it may be a key pasted in by mistake.
            if not _KEY_HASH.match(key):
                raise ValueError(
                    f"entry {index} is not a key hash; store 'sha256:<64 lowercase hex digits>' "
                    "(stagediff tenants new-key prints one), never the key itself"
                )
        return keys


class _TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: Annotated[list[Tenant], Field(min_length=1)]

    @model_validator(mode="after")
    def _consistent(self) -> _TenantsFile:
        names: set[str] = set()
        owners: dict[str, str] = {}
        for tenant in self.tenants:
            if tenant.name in names:
                raise ValueError(f"tenant name '{tenant.name}' appears twice")
            names.add(tenant.name)
            if not tenant.api_keys:
                raise ValueError(f"tenant '{tenant.name}': api_keys must hold at least one key hash")
            for key in tenant.api_keys:
                if key in owners:
                    raise ValueError(f"tenants '{owners[key]}' and '{tenant.name}' share an API key hash")
                owners[key] = tenant.name
        return self


def read_tenants_file(path: Path) -> Any:
    """The parsed content of a tenants YAML file; raises TenantConfigError naming the file."""
    try:
        return yaml.safe_load(path.read_text())
    except OSError as error:
        raise TenantConfigError(f"{path}: cannot read the tenants file: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise TenantConfigError(f"{path}: not valid YAML: {error}") from None


def parse_tenants(data: Any, source: str) -> list[Tenant]:
    """The tenants of already-parsed tenants data; raises TenantConfigError naming `source` and each field."""
    try:
        parsed = _TenantsFile.model_validate(data)
    except ValidationError as error:
        problems = _describe(error, data)
        raise TenantConfigError(
            f"{source}: " + "; ".join(problems), [f"{source}: {problem}" for problem in problems]
        ) from None
    return parsed.tenants


def _describe(error: ValidationError, data: Any) -> list[str]:
    """One line per problem, naming the field (and the tenant) without repeating any input."""
    lines = []
    for problem in error.errors(include_input=False, include_url=False):
        location = problem["loc"]
        parts: list[str] = []
        for part in location:
            if isinstance(part, int) and parts:
                parts[-1] += f"[{part}]"
            elif isinstance(part, str) and len(part) > MAX_MODEL_ID_CHARS:  # a mapping's key, too long to repeat
                parts.append(f"<a key of {len(part)} characters>")
            else:
                parts.append(str(part))
        if location[:1] == ("tenants",) and len(location) > 1 and isinstance(location[1], int):
            name = _tenant_name(data, location[1])
            if name is not None:
                parts[0] += f" ({name})"
        field = ".".join(parts) or "tenants"
        lines.append(f"{field}: {problem['msg'].removeprefix('Value error, ')}")
    return lines


def _tenant_name(data: Any, index: int) -> str | None:
    try:
        name = data["tenants"][index]["name"]
    except (KeyError, IndexError, TypeError):
        return None
    return name if isinstance(name, str) else None
