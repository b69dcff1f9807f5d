"""Tenants of the public API: who may call, how they are ranked, and how much they may ask for.

Tenants come from a YAML file (`--tenants FILE`, see deploy/tenants.example.yaml):

    tenants:
      - name: acme
        api_keys: ["sha256:<64 hex digits>"]
        priority: high          # high, normal (default) or low
        weight: 2               # share inside its priority class (default 1)
        quotas:                 # every quota is optional; absent means unlimited unless a default is shown
          max_running_jobs: 2
          max_queued_jobs: 20
          requests_per_minute: 60
          burst: 10
          max_height: 1024
          max_width: 1024
          max_pixels: 589824    # height * width
          max_frames: 81
          max_steps: 50
          max_output_frames: 321      # frames after interpolation (default 1025)
          max_output_pixels: 300000000  # output frames * height * width (default 2**29)
          max_watch_streams: 8        # WatchJob streams open at once (default 32)
          max_kept_jobs: 200          # finished jobs kept (default: the orchestrator's --max-kept-jobs)
          max_stored_bytes: 21474836480  # bytes of results and intermediates kept (default: its
                                         # --max-stored-bytes-per-tenant)
          adapters_per_minute: 12     # distinct LoRA adapters named in any minute (default: the
                                      # orchestrator's --adapters-per-minute)
        admin: false            # may call GetClusterInfo (default false)
        loras: ["style-*", "anime"]  # LoRA adapters of the DiT's --lora-dir it may use: names or shell
                                # patterns (default none); its own private ones (acme/*) are always allowed

Without a tenants file the registry is open: one tenant, "default", that every
caller is, with no key, an operator's rights (admin) and only the default quotas
on what a job produces (max_output_frames, max_output_pixels) and on open WatchJob
streams (for local use); it may use every public LoRA adapter.

API keys travel as `authorization: Bearer <key>` metadata. The file holds only
their SHA-256 (`sha256:<hex>`); `python -m services.orchestrator.tenants new-key`
makes a key and prints its hash. An unsalted fast hash is the right tool here,
unlike for passwords: keys are random 256-bit tokens, so there is nothing to
guess and no dictionary to precompute; salting or stretching only defends
low-entropy secrets, and would force every request to try every tenant's salt
with a slow function. With a fast unsalted hash, a request costs one SHA-256
and one dict lookup. That lookup does not compare the presented key with a
stored one, only digests: what its timing could reveal is a prefix of a digest,
which does not help to find a key that hashes to it.

Errors carry the status code a servicer should answer with (`error.code`):
UNAUTHENTICATED for a missing or wrong key, PERMISSION_DENIED for a request
beyond one of its tenant's size limits (retrying cannot help, though another
tenant could make it), and RESOURCE_EXHAUSTED with a retry delay for the rate
limit (waiting helps).
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import math
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol

import grpc
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

AUTHORIZATION_METADATA_KEY = "authorization"
KEY_HASH_PREFIX = "sha256:"
KEY_PREFIX = "sd_"
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

Clock = Callable[[], float]


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


class Tenant(BaseModel):
    """One tenant: its name, the hashes of its API keys, its priority class, weight and quotas."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=_TENANT_NAME)]
    api_keys: tuple[str, ...] = ()
    priority: PriorityClass = PriorityClass.NORMAL
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
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

    @field_validator("api_keys")
    @classmethod
    def _hashes_only(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for index, key in enumerate(keys):
            # Never repeat the value: it may be a key pasted in by mistake.
            if not _KEY_HASH.match(key):
                raise ValueError(
                    f"entry {index} is not a key hash; store 'sha256:<64 lowercase hex digits>' "
                    "(python -m services.orchestrator.tenants new-key prints one), never the key itself"
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


# --------------------------------------------------------------- errors --


class TenantConfigError(ValueError):
    """The tenants file is missing, not YAML, or fails validation; the message names the field."""


class TenantError(Exception):
    """A call refused on the tenant's account; `code` is the status to answer with."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class AuthenticationError(TenantError):
    """No key, a malformed authorization header, or a key no tenant has (UNAUTHENTICATED)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class LimitExceeded(TenantError):
    """A request beyond one of its tenant's size limits (PERMISSION_DENIED; retrying cannot help)."""

    code = grpc.StatusCode.PERMISSION_DENIED

    def __init__(self, tenant: str, field: str, value: int, limit: int, message: str) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.field = field
        self.value = value
        self.limit = limit


class RateLimited(TenantError):
    """The tenant's requests-per-minute are spent (RESOURCE_EXHAUSTED); `retry_after` is in seconds."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, tenant: str, retry_after: float, message: str) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.retry_after = retry_after


# ------------------------------------------------------------- keys --


def new_api_key() -> str:
    """A fresh API key: 256 random bits, URL-safe, with a prefix that secret scanners can spot."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """The form a key is stored in: `sha256:<hex>`."""
    return KEY_HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The key in `authorization: Bearer <key>`; raises AuthenticationError when absent or malformed."""
    values = [value for key, value in (metadata or ()) if key.lower() == AUTHORIZATION_METADATA_KEY]
    if not values:
        raise AuthenticationError(
            "missing API key: send metadata 'authorization: Bearer <key>' (ask the cluster's operator for a key)"
        )
    if len(values) > 1:
        raise AuthenticationError("more than one 'authorization' metadata entry; send exactly one")
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError("malformed 'authorization' metadata: expected 'Bearer <key>'")
    return token


# ---------------------------------------------------------- rate limit --


@dataclass
class _Bucket:
    capacity: int
    per_second: float
    tokens: float
    updated: float


class RateLimiter:
    """Per-tenant token buckets for `requests_per_minute`.

    Each tenant's bucket holds `burst` tokens and refills at
    requests_per_minute / 60 tokens a second; a request takes one. `clock`
    (monotonic seconds) is injectable so that tests can move time by hand.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def _bucket(self, tenant: Tenant) -> _Bucket | None:
        capacity = tenant.quotas.bucket_capacity
        if capacity is None:
            return None
        bucket = self._buckets.get(tenant.name)
        if bucket is None:
            per_second = tenant.quotas.requests_per_minute / 60.0
            bucket = _Bucket(capacity, per_second, float(capacity), self.clock())
            self._buckets[tenant.name] = bucket
        return bucket

    def acquire(self, tenant: Tenant) -> float:
        """Takes a token for one request: 0.0 when accepted, else the seconds until one would be.

        A refused request takes nothing, so a client that waits the returned
        time is accepted then (if no other request of the tenant came first).
        """
        bucket = self._bucket(tenant)
        if bucket is None:
            return 0.0
        now = self.clock()
        elapsed = max(0.0, now - bucket.updated)
        bucket.tokens = min(bucket.capacity, bucket.tokens + elapsed * bucket.per_second)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / bucket.per_second


# ------------------------------------------------------------ registry --


class SizedRequest(Protocol):
    """What check_request_limits reads: a GenerateRequest with every default filled in."""

    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    interpolation: Any  # InterpolationParams: enable, exp


def _interp_exp(request: SizedRequest) -> int:
    interpolation = request.interpolation
    return interpolation.exp if interpolation.enable and interpolation.exp > 0 else 0


def output_frames(request: SizedRequest) -> int:
    """Frames the job produces: the requested ones, and 2**exp - 1 more between each pair when interpolating."""
    return (request.num_frames - 1) * 2 ** _interp_exp(request) + 1


class TenantRegistry:
    """The tenants a server knows, and the per-request checks made on their behalf."""

    def __init__(
        self, tenants: Sequence[Tenant], *, open_tenant: Tenant | None = None, clock: Clock = time.monotonic
    ) -> None:
        """Prefer `from_file` or `open`. With `open_tenant`, every caller is that tenant."""
        self.tenants: Mapping[str, Tenant] = {tenant.name: tenant for tenant in tenants}
        self.open_tenant = open_tenant
        self.rate_limiter = RateLimiter(clock)
        self._by_digest = {key: tenant for tenant in tenants for key in tenant.api_keys}

    @classmethod
    def open(cls, *, clock: Clock = time.monotonic) -> TenantRegistry:
        """The registry without a tenants file: one tenant, 'default', no key needed, admin, default quotas."""
        tenant = Tenant(name=DEFAULT_TENANT_NAME, admin=True, loras=("*",))
        return cls([tenant], open_tenant=tenant, clock=clock)

    @classmethod
    def from_file(cls, path: str | Path, *, clock: Clock = time.monotonic) -> TenantRegistry:
        """Reads and validates a tenants YAML file; raises TenantConfigError naming the file and field."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as error:
            raise TenantConfigError(f"{path}: cannot read the tenants file: {error.strerror}") from None
        except yaml.YAMLError as error:
            raise TenantConfigError(f"{path}: not valid YAML: {error}") from None
        return cls.from_dict(data, source=str(path), clock=clock)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "tenants", clock: Clock = time.monotonic) -> TenantRegistry:
        """Validates already-parsed tenants data (the YAML file's content)."""
        try:
            parsed = _TenantsFile.model_validate(data)
        except ValidationError as error:
            raise TenantConfigError(f"{source}: " + _describe(error, data)) from None
        return cls(parsed.tenants, clock=clock)

    @property
    def is_open(self) -> bool:
        return self.open_tenant is not None

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant:
        """The tenant whose key the call presents; raises AuthenticationError (never repeating the key)."""
        if self.open_tenant is not None:
            return self.open_tenant
        key = bearer_token(metadata)
        tenant = self._by_digest.get(hash_api_key(key))
        if tenant is None:
            raise AuthenticationError("invalid API key: no tenant has this key (it may have been revoked)")
        return tenant

    def check_request_limits(self, tenant: Tenant, request: SizedRequest) -> None:
        """Raises LimitExceeded when a request exceeds its tenant's size, frame or step limits.

        Call it with the request completed with the model's defaults, so that an
        unset field is checked at the value that would really run.
        """
        quotas = tenant.quotas

        def refuse(field: str, value: int, limit: int, what: str) -> LimitExceeded:
            return LimitExceeded(
                tenant.name, field, value, limit, f"{field}: {what} exceeds tenant '{tenant.name}' limit of {limit}"
            )

        checks = (
            ("height", request.height, quotas.max_height),
            ("width", request.width, quotas.max_width),
            ("num_frames", request.num_frames, quotas.max_frames),
            ("num_inference_steps", request.num_inference_steps, quotas.max_steps),
        )
        for field, value, limit in checks:
            if limit is not None and value > limit:
                raise refuse(field, value, limit, str(value))
        pixels = request.height * request.width
        if quotas.max_pixels is not None and pixels > quotas.max_pixels:
            raise refuse(
                "height*width", pixels, quotas.max_pixels, f"{request.height}x{request.width} = {pixels} pixels"
            )
        frames_out = output_frames(request)
        if quotas.max_output_frames is not None and frames_out > quotas.max_output_frames:
            raise refuse(
                "output frames",
                frames_out,
                quotas.max_output_frames,
                f"{frames_out} ({request.num_frames} frames, interpolation.exp {_interp_exp(request)})",
            )
        pixels_out = frames_out * pixels
        if quotas.max_output_pixels is not None and pixels_out > quotas.max_output_pixels:
            raise refuse(
                "output pixels",
                pixels_out,
                quotas.max_output_pixels,
                f"{frames_out} frames of {request.height}x{request.width} = {pixels_out} pixels",
            )

    def check_rate(self, tenant: Tenant) -> None:
        """Takes one request from the tenant's rate limit; raises RateLimited with the wait when spent."""
        wait = self.rate_limiter.acquire(tenant)
        if wait > 0.0:
            rate = tenant.quotas.requests_per_minute
            raise RateLimited(
                tenant.name,
                wait,
                f"tenant '{tenant.name}' is over its limit of {rate:g} requests per minute; retry in {wait:.1f} s",
            )


def _describe(error: ValidationError, data: Any) -> str:
    """One line per problem, naming the field (and the tenant) without repeating any input."""
    lines = []
    for problem in error.errors(include_input=False, include_url=False):
        location = problem["loc"]
        parts: list[str] = []
        for part in location:
            if isinstance(part, int) and parts:
                parts[-1] += f"[{part}]"
            else:
                parts.append(str(part))
        if location[:1] == ("tenants",) and len(location) > 1 and isinstance(location[1], int):
            name = _tenant_name(data, location[1])
            if name is not None:
                parts[0] += f" ({name})"
        field = ".".join(parts) or "tenants"
        lines.append(f"{field}: {problem['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)


def _tenant_name(data: Any, index: int) -> str | None:
    try:
        name = data["tenants"][index]["name"]
    except (KeyError, IndexError, TypeError):
        return None
    return name if isinstance(name, str) else None


# ----------------------------------------------------------------- cli --


def main(argv: list[str] | None = None) -> int:
    """`new-key` makes a key and prints it once with its hash; `hash-key` hashes a key read from stdin;
    `check FILE` validates a tenants file."""
    parser = argparse.ArgumentParser(prog="python -m services.orchestrator.tenants", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("new-key", help="make an API key; prints the key (once) and the hash for the tenants file")
    commands.add_parser("hash-key", help="print the hash of a key read from standard input")
    check = commands.add_parser("check", help="validate a tenants file")
    check.add_argument("file")
    args = parser.parse_args(argv)

    if args.command == "new-key":
        key = new_api_key()
        print(f"key:  {key}")
        print(f"hash: {hash_api_key(key)}")
        print(
            "Give the key to the tenant; it is not stored anywhere. "
            "Add the hash to the tenant's api_keys in the tenants file.",
            file=sys.stderr,
        )
        return 0
    if args.command == "hash-key":
        key = sys.stdin.readline().strip()
        if not key:
            print("hash-key: no key on standard input", file=sys.stderr)
            return 2
        print(hash_api_key(key))
        return 0
    try:
        registry = TenantRegistry.from_file(args.file)
    except TenantConfigError as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{args.file}: {len(registry.tenants)} tenant(s): {', '.join(registry.tenants)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
