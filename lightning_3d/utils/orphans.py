"""Ranks started by Lightning's launcher exit as soon as their parent dies.

Lightning's script launcher runs rank 0 in the user's process and starts the other local ranks as its children. If
rank 0 is killed (``kill -9``, the OOM killer, a closed terminal), its children are reparented and run on until a
collective times out, seconds to the strategy's ``timeout`` later, holding their GPUs and memory. Two mechanisms
end them at once instead:

- Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (through ``ctypes``): the kernel kills the child when the parent
  exits, even while the child is blocked inside a collective's C code.
- Everywhere (and as a second line on Linux): a daemon thread polls ``os.getppid()`` and ends the process with
  ``os._exit`` once the parent it was started by is gone.

The parent's pid travels to the children in the environment (:data:`LAUNCHER_PID_VARIABLE`, set by the strategy in
rank 0 before the launcher starts them), so a child that starts after its parent already died notices too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

LAUNCHER_PID_VARIABLE = "L3D_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.2
_watching: list[int] = []  # the parent pid a watchdog thread of this process watches, if any


def mark_launcher() -> None:
    """In the launching process (rank 0): let the children it starts know who their parent is."""
    os.environ[LAUNCHER_PID_VARIABLE] = str(os.getpid())


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_gone(parent: int) -> None:
    sys.stderr.write(f"lightning_3d: rank process {os.getpid()} exits: its launcher (rank 0, pid {parent}) died.\n")
    sys.stderr.flush()
    os._exit(1)


def exit_with_launcher() -> bool:
    """In a child of Lightning's launcher: exit as soon as that parent dies. True where armed (a child whose parent
    is the launcher named in the environment); a no-op elsewhere and when already armed."""
    value = os.environ.get(LAUNCHER_PID_VARIABLE, "")
    if not value.isdigit() or int(value) == os.getpid():
        return False
    parent = int(value)
    if _watching:
        return True
    _set_parent_death_signal()
    if os.getppid() != parent:  # died before the signal was armed (or this process is not its child)
        if not _alive(parent):
            _parent_gone(parent)
        return False

    def watch() -> None:
        event = threading.Event()
        while not event.wait(_POLL_S):
            if os.getppid() != parent:
                _parent_gone(parent)

    _watching.append(parent)
    threading.Thread(target=watch, name="lightning_3d-parent-watch", daemon=True).start()
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
