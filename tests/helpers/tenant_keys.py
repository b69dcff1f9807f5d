"""A tenants file for a test cluster: each tenant with one new API key and the adapters it may name."""

from __future__ import annotations

from pathlib import Path

import yaml

from services.orchestrator.tenants import hash_api_key, new_api_key


def tenants_file(directory: Path, allowed: dict[str, list[str]]) -> tuple[Path, dict[str, str]]:
    """Writes `directory`/tenants.yaml; returns its path and each tenant's key. `allowed`: tenant -> adapters."""
    keys = {name: new_api_key() for name in allowed}
    path = directory / "tenants.yaml"
    tenants = [
        {"name": name, "api_keys": [hash_api_key(keys[name])], "loras": loras} for name, loras in allowed.items()
    ]
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path, keys
