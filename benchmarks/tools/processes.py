"""Stopping a torchrun launch completely. torchrun starts each worker in a session of its own, so a signal to torchrun
(or to its process group) can leave workers running, holding the GPUs and their ports through whatever the machine
runs next; these helpers find every process below a launcher and stop them all."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (Linux /proc), children first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in parents.get(p, [])]
        found += children
        frontier = children
    return found


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_launch(proc: subprocess.Popen, stacks_first: bool = False) -> None:
    """SIGKILL ``proc`` and everything below it, then reap it. ``stacks_first`` sends SIGUSR1 to the workers first and
    gives them 3 s: workers that registered ``faulthandler`` on it print every thread's stack into their logs."""
    workers = descendants(proc.pid)
    if stacks_first:
        signal_all(workers, signal.SIGUSR1)
        time.sleep(3)
    signal_all([proc.pid, *workers], signal.SIGKILL)
    proc.wait()
