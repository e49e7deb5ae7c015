"""Run a scenario module in N local processes, the way torchrun would (env:// rendezvous on localhost).

Tests call ``run_scenario(world_size, "layouts", args)``; each process runs ``python -m
tests.scenarios.<name>`` with RANK/LOCAL_RANK/WORLD_SIZE set, so Lightning sees externally created
processes and its own launcher stays out of the way. Rank 0 writes a JSON report the test reads.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenario(world_size: int, name: str, args: list[str], report: Path, timeout: float = 600, nodes: int = 1) -> dict:
    """Start the processes, wait for all of them, fail loudly (with their output) if any fails or hangs."""
    port = free_port()
    per_node = world_size // nodes
    env_base = {
        **{k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE")},
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # each rank prints its threads' stacks into its log before the deadline (tests/scenarios/__init__.py)
        "L3D_STACKS_AFTER_S": str(max(1.0, timeout - 10)),
    }
    procs = []
    for rank in range(world_size):
        env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank % per_node), NODE_RANK=str(rank // per_node),
                   LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node))
        log = open(report.with_suffix(f".rank{rank}.log"), "w")
        cmd = [sys.executable, "-m", f"tests.scenarios.{name}", "--report", str(report), *args]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    deadline = time.monotonic() + timeout
    failed = None
    while any(p.poll() is None for p, _ in procs):
        if time.monotonic() > deadline:
            failed = f"timed out after {timeout}s"
            break
        bad = [i for i, (p, _) in enumerate(procs) if p.poll() not in (None, 0)]
        if bad:
            failed = f"rank {bad[0]} exited with {procs[bad[0]][0].returncode}"
            time.sleep(5)  # give the others a moment to report their side, then stop them
            break
        time.sleep(0.2)
    for p, log in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()
    codes = [p.returncode for p, _ in procs]
    if failed is None and any(codes):
        failed = f"exit codes {codes}"
    if failed:
        logs = "\n".join(
            f"----- rank {r} -----\n" + report.with_suffix(f".rank{r}.log").read_text()[-12000:] for r in range(world_size)
        )
        raise AssertionError(f"scenario {name} {args} failed: {failed}\n{logs}")
    return json.loads(report.read_text())
