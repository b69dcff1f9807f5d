"""Warnings that libraries log while they are imported and that say nothing about this deployment: dropped,
by logger and message, from every server process's logs.

torchao, which transformers imports wherever it is installed, tries each of its compiled extensions and logs
one warning per library built for another Python, torch or GPU ("Failed to load .../_C_mxfp8...so: ..."); the
kernels the DiT's quantization runs work without them (dit_svc/quantization.py). It then registers Enum classes
with torch's pytree, which torch logs as deprecated ("<enum ...> is an Enum subclass and is now natively
supported by torch.compile ..."). Only these records are dropped, by filters on the loggers that emit them; any
other record of those loggers, and every record of the others, still reaches the logs.

The filters go on when `services` is imported (services/__init__.py), before any stage module imports
diffusers or transformers: in each service's process, and in each rank process a stage spawns, which imports
services.rank_group before the stage's code.
"""

from __future__ import annotations

import logging
import re

# Logger -> the messages of it that are dropped (matched from the start).
NOISE = {
    "torchao": re.compile(r"Failed to load \S+\.so: "),
    "torch.utils._pytree": re.compile(r"<enum '\w+'> is an Enum subclass and is now natively supported by torch"),
}


class _DropMatching(logging.Filter):
    """Drops the records whose message matches `pattern`."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def drop_library_noise() -> None:
    """Puts the filters on their loggers; a second call adds nothing."""
    for name, pattern in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropMatching) for existing in logger.filters):
            logger.addFilter(_DropMatching(pattern))
