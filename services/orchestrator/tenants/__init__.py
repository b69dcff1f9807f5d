"""Tenants of the public API: who may call, how they are ranked, which models they may use, and how much they may
ask for.

Tenants come from a YAML file (`--tenants FILE`, its format in deploy/tenants.example.yaml), read and
validated by schema.py; without one the registry is open (registry.py). API keys are stored as their
SHA-256 only (keys.py); `stagediff tenants new-key` makes one (cli.py). Each
tenant's request rate is a token bucket (rate_limit.py). Refusals carry the status code a servicer answers
with (errors.py).
"""

from services.orchestrator.tenants.cli import main
from services.orchestrator.tenants.errors import (
    AuthenticationError,
    LimitExceeded,
    ModelNotAllowed,
    RateLimited,
    TenantError,
)
from services.orchestrator.tenants.keys import (
    AUTHORIZATION_METADATA_KEY,
    KEY_HASH_PREFIX,
    KEY_PREFIX,
    bearer_token,
    hash_api_key,
    new_api_key,
)
from services.orchestrator.tenants.rate_limit import Clock, RateLimiter
from services.orchestrator.tenants.registry import (
    SizedRequest,
    TenantRegistry,
    TenantScheduling,
    output_frames,
    visible_models,
)
from services.orchestrator.tenants.schema import (
    DEFAULT_MAX_OUTPUT_FRAMES,
    DEFAULT_MAX_OUTPUT_PIXELS,
    DEFAULT_MAX_WATCH_STREAMS,
    DEFAULT_TENANT_NAME,
    MAX_LORA_PATTERN_CHARS,
    MAX_LORA_PATTERNS,
    MAX_MODEL_ID_CHARS,
    MAX_MODEL_PATTERN_CHARS,
    MAX_MODEL_PATTERNS,
    MAX_MODEL_QUOTAS,
    TENANT_WIDE_QUOTAS,
    PriorityClass,
    Quotas,
    Tenant,
    TenantConfigError,
)

__all__ = [
    "AUTHORIZATION_METADATA_KEY",
    "DEFAULT_MAX_OUTPUT_FRAMES",
    "DEFAULT_MAX_OUTPUT_PIXELS",
    "DEFAULT_MAX_WATCH_STREAMS",
    "DEFAULT_TENANT_NAME",
    "KEY_HASH_PREFIX",
    "KEY_PREFIX",
    "MAX_LORA_PATTERNS",
    "MAX_LORA_PATTERN_CHARS",
    "MAX_MODEL_ID_CHARS",
    "MAX_MODEL_PATTERNS",
    "MAX_MODEL_PATTERN_CHARS",
    "MAX_MODEL_QUOTAS",
    "TENANT_WIDE_QUOTAS",
    "AuthenticationError",
    "Clock",
    "LimitExceeded",
    "ModelNotAllowed",
    "PriorityClass",
    "Quotas",
    "RateLimited",
    "RateLimiter",
    "SizedRequest",
    "Tenant",
    "TenantConfigError",
    "TenantError",
    "TenantRegistry",
    "TenantScheduling",
    "bearer_token",
    "hash_api_key",
    "main",
    "new_api_key",
    "output_frames",
    "visible_models",
]
