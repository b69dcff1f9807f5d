"""Sizes on the orchestrator's flags (`--max-stored-bytes-per-tenant 20GiB`, `--min-free-bytes 5%`).

No torch here: the orchestrator's options (services/orchestrator/options.py) parse them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '1073741824', '512MiB', '1G' or '1.5GiB' (binary units); raises ValueError."""
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"'{text}' is not a size; use bytes or a number with K, M, G or T (binary: 1G = 2**30)")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class MinFree:
    """Space to keep free on the state directory's volume: bytes, or a percentage of the volume."""

    bytes: int = 0
    percent: float = 0.0

    @classmethod
    def parse(cls, text: str) -> MinFree:
        """'1GiB', '1073741824' or '5%'; raises ValueError."""
        text = str(text).strip()
        if text.endswith("%"):
            try:
                percent = float(text[:-1])
            except ValueError:
                percent = -1.0
            if not 0 <= percent < 100:
                raise ValueError(f"'{text}' is not a percentage from 0% to below 100%")
            return cls(percent=percent)
        return cls(bytes=parse_size(text))

    def of(self, total: int) -> int:
        """The bytes to keep free on a volume of `total` bytes."""
        return self.bytes if not self.percent else int(total * self.percent / 100)

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent else f"{self.bytes} bytes"
