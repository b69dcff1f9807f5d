"""A service started by a supervisor (`stagediff up`) ends when the supervisor does, however it ends.

`stagediff up` starts each service in a session of its own, so a signal to its terminal does not reach them;
were `up` killed outright (SIGKILL, the OOM killer), they would run on for good, holding their ports, their memory
and the state dir's lock. So the supervisor gives each service two ways to notice its end, and the service
answers either with SIGTERM to itself (its graceful shutdown: calls in flight drain within its grace):

- the read end of a pipe whose write end only the supervisor holds (`SUPERVISOR_FD_ENV` names the descriptor):
  the kernel closes it when the supervisor exits, and a thread here reading it sees the end of the file. This
  works on every POSIX system.
- on Linux, also `prctl(PR_SET_PDEATHSIG, SIGTERM)`: the kernel signals the service when the thread that
  started it exits, even while the service's Python code cannot run (a long call into C while loading). Since
  it follows the thread, a supervisor asks for it (`SUPERVISOR_PID_ENV`) only when it starts the service from
  its main thread, which lives as long as it does.

`watch_supervisor` sets both up; it runs first thing in `stagediff serve`. It takes the variables out of the
environment, so processes the service starts in turn (a DiT's ranks) do not watch a descriptor they lack.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

SUPERVISOR_FD_ENV = "STAGEDIFF_SUPERVISOR_FD"  # the pipe's read end, inherited from the supervisor
SUPERVISOR_PID_ENV = "STAGEDIFF_SUPERVISOR_PID"  # the supervisor's pid, to catch its end before the watch began
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def watch_supervisor() -> None:
    """Ends this process (SIGTERM to itself) once the supervisor that started it has ended; nothing when no
    supervisor started it."""
    fd_text = os.environ.pop(SUPERVISOR_FD_ENV, None)
    pid_text = os.environ.pop(SUPERVISOR_PID_ENV, None)
    if pid_text is not None and pid_text.isdigit():
        _signal_on_parent_death()
        if os.getppid() != int(pid_text):
            _terminate()  # the supervisor ended before the signal above was set up
    if fd_text is None or not fd_text.isdigit():
        return
    fd = int(fd_text)
    with contextlib.suppress(OSError):
        os.set_inheritable(fd, False)
    threading.Thread(target=_wait_for_end, args=(fd,), name="supervisor-watch", daemon=True).start()


def _signal_on_parent_death() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _wait_for_end(fd: int) -> None:
    """Blocks until the supervisor's end of the pipe closes (nothing is ever written to it), then ends this
    process; returns where the descriptor cannot be read (no supervisor's pipe)."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        return
    _terminate()


def _terminate() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
