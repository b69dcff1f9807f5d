"""Ctrl-C during a client's cleanup: `interrupts_ignored` holds SIGINT off while a job is being cancelled.

The first Ctrl-C during a call cancels the job the call started; a second one during that cancel must not
abandon it (the job would run on for the server's detach grace). Inside `interrupts_ignored()` SIGINT is
ignored, so the block (bounded by its own timeout) runs to its end; the first interrupt is already on its way.
Only the main thread receives SIGINT (and only it may change its handler): elsewhere the block changes nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupts_ignored() -> Iterator[None]:
    """Runs the block with SIGINT ignored (in the main thread; elsewhere as it is), then restores its handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
