"""Ranks started by Lightning's launcher end with it: kill rank 0 (the launcher) of a 3-process CPU fit, and no rank
is alive 2 s later (lightning_3d/utils/orphans.py). A liveness property: the state of the processes is polled, the
bound is the one the strategy promises, not a speed figure."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_3d.utils import orphans
from tests.conftest import RENDEZVOUS
from tests.launch import ROOT

PROCESSES = 3


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its new parent, counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_ranks_exit_when_the_launcher_dies(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS and k != orphans.LAUNCHER_PID_VARIABLE}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    log = open(tmp_path / "fit.log", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "tests.scenarios.orphan_fit", str(tmp_path), str(PROCESSES)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        files = [tmp_path / f"rank{r}.pid" for r in range(PROCESSES)]
        deadline = time.monotonic() + 400  # start-up on a loaded 2-core machine; not a measured figure
        while not all(f.exists() for f in files):
            assert launcher.poll() is None, (tmp_path / "fit.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "fit.log").read_text()[-3000:]
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in files]
        assert pids[0] == launcher.pid and all(alive(p) for p in pids[1:]), pids  # every rank is training
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        killed = time.monotonic()
        while any(alive(p) for p in pids[1:]) and time.monotonic() < killed + 2.0:
            time.sleep(0.05)
        left = [p for p in pids[1:] if alive(p)]
        assert not left, f"ranks {left} still alive 2 s after their launcher was killed"
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's session: whatever is left of it
        except ProcessLookupError:
            pass
        log.close()


def test_the_watch_is_armed_only_in_a_child_of_the_launcher(monkeypatch) -> None:
    monkeypatch.delenv(orphans.LAUNCHER_PID_VARIABLE, raising=False)
    assert not orphans.exit_with_launcher()  # not launched by Lightning's launcher
    orphans.mark_launcher()
    assert os.environ[orphans.LAUNCHER_PID_VARIABLE] == str(os.getpid())
    assert not orphans.exit_with_launcher()  # the launcher itself
