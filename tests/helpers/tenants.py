"""The example tenants file shipped in deploy/."""

from __future__ import annotations

from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "tenants.example.yaml"
