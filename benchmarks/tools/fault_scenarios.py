"""Fault scenarios on a 2-process job: a frozen rank (SIGSTOP) and a killed rank (SIGKILL), reporting the time from
the fault to the end of the job and the processes left over.

Each scenario starts a fresh data-parallel fit of GPT-tiny under Lightning's own launcher (the worker below; rank 0
is the launcher, rank 1 its child) with ``Compressed3DStrategy(timeout=--timeout)``, waits until both ranks have
trained ``--warm-steps`` steps, sends the signal to ``--victim`` (rank 1 by default; rank 0 is the launcher) and
polls until every process of the job has ended or ``--deadline`` seconds passed. Reported per scenario: seconds from
the signal to the launcher's exit and to the last rank's end, the launcher's exit code, and the pids still alive at
the deadline (then killed, so nothing outlives the script).

- GPU (what it is for): ``--backend nccl`` on a 2-GPU machine, with NCCL's own timeout handling:
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (torch's watchdog aborts the communicator and ends the process when a
  collective exceeds the timeout) and ``TORCH_NCCL_BLOCKING_WAIT=0``; the expected end of the job is within the
  timeout plus the watchdog's poll.
- CPU self-check: ``--backend gloo`` (the default when no GPU is visible) runs the same scenarios with gloo.

    python benchmarks/tools/fault_scenarios.py --backend nccl --timeout 60          # 2 GPUs
    python benchmarks/tools/fault_scenarios.py --backend gloo --timeout 20          # CPU self-check
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SCENARIOS = {"frozen": signal.SIGSTOP, "killed": signal.SIGKILL}


def alive(pid: int) -> bool:
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


def worker(args: argparse.Namespace) -> None:
    """One rank of the job (Lightning's launcher starts rank 1 from rank 0 running this same command)."""
    import lightning.pytorch as pl

    from lightning_3d import Compressed3DStrategy
    from lightning_3d.recipes import GPT
    from lightning_3d.recipes.data import SyntheticLMDataModule

    class Ready(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == args.warm_steps:
                path = args.dir / f"rank{trainer.global_rank}.pid"
                path.with_suffix(".tmp").write_text(str(os.getpid()))
                path.with_suffix(".tmp").rename(path)

    gpu = args.backend == "nccl"
    data = SyntheticLMDataModule(vocab_size=512, seq_length=64, batch_size=4)
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu", devices=2, max_steps=1_000_000, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=Compressed3DStrategy(process_group_backend=args.backend, timeout=timedelta(seconds=args.timeout),
                                      compression=False),
        callbacks=[Ready()],
    )
    trainer.fit(GPT("tiny", vocab_size=512, seq_length=64), datamodule=data)


def scenario(name: str, args: argparse.Namespace) -> dict:
    directory = args.out_dir / name
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("rank*"):
        old.unlink()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK",
                                                            "LOCAL_WORLD_SIZE", "MASTER_PORT", "L3D_LAUNCHER_PID")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
               TORCH_NCCL_BLOCKING_WAIT="0", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--backend", args.backend, "--timeout",
           str(args.timeout), "--warm-steps", str(args.warm_steps), "--dir", str(directory)]
    log = open(directory / "job.log", "w")
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result: dict = {"scenario": name, "backend": args.backend, "timeout_s": args.timeout, "victim": args.victim}
    try:
        files = [directory / f"rank{r}.pid" for r in range(2)]
        start = time.monotonic()
        while not all(f.exists() for f in files):
            if launcher.poll() is not None or time.monotonic() - start > args.start_deadline:
                result["error"] = "the job did not start: " + (directory / "job.log").read_text()[-2000:]
                return result
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in files]
        os.kill(pids[args.victim], SCENARIOS[name])
        fault = time.monotonic()
        launcher_end = None
        while time.monotonic() - fault < args.deadline:
            if launcher_end is None and launcher.poll() is not None:
                launcher_end = time.monotonic() - fault
            if launcher_end is not None and not any(alive(p) for p in pids):
                break
            time.sleep(0.1)
        left = [p for p in pids if alive(p)]
        result.update(pids=pids, launcher_exit_s=launcher_end, launcher_code=launcher.poll(),
                      all_ended_s=None if left else time.monotonic() - fault, left_over=left)
        return result
    finally:
        for pid in [launcher.pid] + [int(f.read_text()) for f in directory.glob("rank*.pid")]:
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process takes SIGKILL too; CONT for clarity
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="nccl on 2 GPUs; gloo on CPU (default: nccl if 2 GPUs are visible, else gloo)")
    parser.add_argument("--timeout", type=float, default=30.0, help="the strategy's collective timeout, seconds")
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=sorted(SCENARIOS))
    parser.add_argument("--victim", type=int, choices=(0, 1), default=1, help="rank to freeze or kill (0: the launcher)")
    parser.add_argument("--warm-steps", type=int, default=3, help="steps both ranks train before the fault")
    parser.add_argument("--deadline", type=float, default=None, help="seconds to wait after the fault (default 3 x timeout + 30)")
    parser.add_argument("--start-deadline", type=float, default=600.0)
    parser.add_argument("--out-dir", type=Path, default=Path("fault_scenarios"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backend is None:
        import torch

        args.backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    if args.worker:
        worker(args)
        return 0
    args.deadline = args.deadline or 3 * args.timeout + 30
    results = [scenario(name, args) for name in args.scenarios]
    for r in results:
        if "error" in r:
            print(f"{r['scenario']:7s} {r['backend']}: {r['error']}")
            continue
        print(f"{r['scenario']:7s} {r['backend']} timeout {r['timeout_s']:g} s, rank {r['victim']}: launcher exit after"
              f" {r['launcher_exit_s'] if r['launcher_exit_s'] is None else round(r['launcher_exit_s'], 1)} s"
              f" (code {r['launcher_code']}), all ended after"
              f" {r['all_ended_s'] if r['all_ended_s'] is None else round(r['all_ended_s'], 1)} s, left over:"
              f" {r['left_over'] or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r and not r["left_over"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
