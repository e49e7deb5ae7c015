"""Run a scenario module in N local processes, the way torchrun would (env:// rendezvous on localhost).

Tests call ``run_scenario(world_size, "layouts", args)``; each rank runs ``tests.scenarios.<name>`` as ``__main__``
with RANK/LOCAL_RANK/WORLD_SIZE set, so Lightning sees externally created processes and its own launcher stays out
of the way. Rank 0 writes a JSON report the test reads.

The ranks are forked from one launcher process (``python -m tests.launch``) that has imported torch, Lightning and
lightning_3d once: on a machine with fewer cores than ranks, importing them in every rank was a large part of each
scenario's time. The launcher runs with the ranks' environment (only the rank variables differ; the one thing read
from them at import, Lightning's rank for its rank-zero logging, is set again in each rank). It is single-threaded in
Python when it forks, as Lightning's own ``ddp_fork`` launcher is, and each rank then runs as a fresh ``python -m``
would: its log on stdout/stderr, ``__main__`` the scenario, a normal interpreter exit. With ``L3D_TEST_DEVICE=cuda``
the launcher imports nothing before the fork and each rank imports for itself, as before.

On CPU, ranks other than 0 end after every exit handler has run (the library's own, which destroy the process groups,
among them) without the interpreter's final teardown of its modules: that teardown is seconds of CPU per process with
torch and Lightning loaded, and it ran for every rank on a machine with fewer cores than ranks. Rank 0 still exits
through the whole shutdown, so every launch keeps checking that a rank ends cleanly after the library's teardown.
The launcher, which only imported and forked, ends the same way as ranks 1 and up.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


_SKIP_TEARDOWN: list[int] = []  # in a forked rank: the exit code to end with once the exit handlers have run


def _end_after_exit_handlers() -> None:
    """Registered before anything is imported, so that it runs after every other exit handler (atexit runs them in
    reverse order); in a rank that skips the interpreter's final teardown (see the module's docstring), it ends there."""
    if _SKIP_TEARDOWN:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_SKIP_TEARDOWN[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_log(report: Path, rank: int) -> Path:
    return report.with_suffix(f".rank{rank}.log")


def run_scenario(world_size: int, name: str, args: list[str], report: Path, timeout: float = 600, nodes: int = 1) -> dict:
    """Start the processes, wait for all of them, fail loudly (with their output) if any fails or hangs."""
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", *RANK_VARIABLES)},
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # each rank prints its threads' stacks into its log before the deadline (tests/scenarios/__init__.py)
        "L3D_STACKS_AFTER_S": str(max(1.0, timeout - 10)),
    }
    status = report.with_suffix(".launch.json")
    status.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tests.launch", str(world_size), str(nodes), name, str(report), str(timeout), *args]
    with open(report.with_suffix(".launch.log"), "w") as log:
        launcher = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:  # the launcher keeps the deadline itself; this one only guards against the launcher hanging
            launcher.wait(timeout=timeout + 120)
        except subprocess.TimeoutExpired:
            pass
        finally:  # the launcher and every rank it forked share its session's process group
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    failed = json.loads(status.read_text())["failed"] if status.exists() else (
        f"the launcher exited with {launcher.returncode}: {report.with_suffix('.launch.log').read_text()[-4000:]}")
    if failed:
        logs = "\n".join(
            f"----- rank {r} -----\n" + (rank_log(report, r).read_text()[-12000:] if rank_log(report, r).exists() else "")
            for r in range(world_size)
        )
        raise AssertionError(f"scenario {name} {args} failed: {failed}\n{logs}")
    return json.loads(report.read_text())


def _run_rank(rank: int, world_size: int, nodes: int, name: str, report: Path, args: list[str]) -> int:
    """In the forked child: become rank ``rank`` and run the scenario as ``python -m`` would; the exit code."""
    import runpy
    import traceback

    per_node = world_size // nodes
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % per_node), NODE_RANK=str(rank // per_node),
                      LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node))
    log = os.open(rank_log(report, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # Lightning reads the rank from the environment when it is imported (here: in the launcher, before the fork)
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    rank_zero_only.rank = rank
    module = f"tests.scenarios.{name}"
    # Data-loader workers start from a fork server (recipes/data/loader.worker_options), which this rank starts with a
    # fresh interpreter at its first worker; each worker then imports the scenario (torch, Lightning, lightning_3d) to
    # unpickle its dataset, once per fit. Imported once in the fork server instead, as tests/conftest.py does for the
    # in-process tests; the workers are still started the library's way.
    import multiprocessing

    multiprocessing.set_forkserver_preload([module])
    sys.argv = [module, "--report", str(report), *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _launch(world_size: int, nodes: int, name: str, report: Path, timeout: float, args: list[str]) -> str | None:
    """Fork the ranks, wait for all of them; None, or why the run failed."""
    pids = []
    for rank in range(world_size):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank ends here, through the exit handlers (and, rank 0, the interpreter's whole shutdown)
            code = _run_rank(rank, world_size, nodes, name, report, args)
            if rank > 0 and os.environ.get("L3D_TEST_DEVICE", "cpu") == "cpu":
                _SKIP_TEARDOWN.append(code)
            raise SystemExit(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    failed = None
    while len(codes) < len(pids):
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        if len(codes) == len(pids):
            break
        if time.monotonic() > deadline:
            failed = f"timed out after {timeout}s"
            break
        bad = [r for r, c in sorted(codes.items()) if c != 0]
        if bad:
            failed = f"rank {bad[0]} exited with {codes[bad[0]]}"
            time.sleep(5)  # give the others a moment to report their side, then stop them
            break
        time.sleep(0.2)
    for rank, pid in enumerate(pids):
        if rank not in codes:
            os.kill(pid, signal.SIGKILL)
            codes[rank] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if failed is None and any(codes.values()):
        failed = f"exit codes {[codes[r] for r in range(world_size)]}"
    return failed


def main() -> None:
    world_size, nodes, name, report, timeout, *args = sys.argv[1:]
    atexit.register(_end_after_exit_handlers)  # first: it runs last
    if os.environ.get("L3D_TEST_DEVICE", "cpu") == "cpu":
        # what every rank imports, once, before the fork (see the module's docstring). Not for GPU runs: a CUDA
        # driver that something initialised at import time in the launcher would not work in the forked ranks.
        import lightning.pytorch  # noqa: F401
        import torch  # noqa: F401

        import lightning_3d  # noqa: F401

    report = Path(report)
    failed = _launch(int(world_size), int(nodes), name, report, float(timeout), args)
    report.with_suffix(".launch.json").write_text(json.dumps({"failed": failed}))
    # The launcher only imported and forked: its own teardown, which the test waits for, would check nothing.
    _SKIP_TEARDOWN.append(0)


if __name__ == "__main__":
    main()
