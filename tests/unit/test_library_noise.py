"""The libraries' import-time warnings that say nothing about a deployment are dropped from the logs, and only
those (services/library_noise.py). That importing torchao after `services` logs nothing is
tests/integration/test_library_noise_processes.py's."""

from __future__ import annotations

import logging

import pytest

import services  # noqa: F401 - its import puts the filters on
from services.library_noise import drop_library_noise

SO_FILE = "/venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"


def test_torchaos_load_failures_and_torchs_enum_notice_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    drop_library_noise()  # a second time: no second filter
    assert len(logging.getLogger("torchao").filters) == 1
    with caplog.at_level(logging.DEBUG):
        # As torchao/__init__.py and torch/utils/_pytree.py log them.
        logging.getLogger("torchao").warning(f"Failed to load {SO_FILE}: Could not load this library: {SO_FILE}")
        logging.getLogger("torch.utils._pytree").warning(
            "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
            "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release.",
            "<enum 'KernelPreference'>",
        )
        logging.getLogger("torchao").warning("Skipping import of cpp extensions due to incompatible torch version.")
        logging.getLogger("torch.utils._pytree").warning("some other notice")
        logging.getLogger("services.other").warning(f"Failed to load {SO_FILE}: not torchao's")
    assert [(record.name, record.getMessage()) for record in caplog.records] == [
        ("torchao", "Skipping import of cpp extensions due to incompatible torch version."),
        ("torch.utils._pytree", "some other notice"),
        ("services.other", f"Failed to load {SO_FILE}: not torchao's"),
    ]
