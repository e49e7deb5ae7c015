"""``lightning-3d plan --verify``: run the plan's top candidates for a few steps each and keep the fastest measured.

Each candidate trains as ``lightning-3d fit --config`` runs it, in a fresh process (its own workers where it spans
several devices), on the machine the command runs on: its emitted YAML with only the run's length and its outputs
changed (``max_steps`` = warm-up + timed steps, no validation, checkpoints, logger or progress bar, the user's
callbacks replaced by a step timer). The timer (``StepTimer``) records each step from its batch start to its end
(device-synchronised on CUDA), on the first rank, and writes them as JSON; the candidate's time is the median of
its timed steps, over every repeat. With ``repeats`` > 1 the candidates run round-robin (one repeat of each, then
the next), so a drift of the host's speed during the verification reaches every candidate alike
(docs/planner.md, "Verifying a plan").
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml


class StepTimer(pl.Callback):
    """Seconds of each training step after ``warmup`` steps, written to ``out`` (JSON: ``{"steps_s": [...]}``) by the
    first rank when training ends."""

    def __init__(self, out: str, warmup: int = 1) -> None:
        self.out, self.warmup = out, int(warmup)
        self.steps_s: list[float] = []
        self._t0 = 0.0

    def _sync(self, trainer: pl.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, module, batch, idx) -> None:
        self._sync(trainer)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:
        self._sync(trainer)
        if trainer.global_step > self.warmup:
            self.steps_s.append(time.perf_counter() - self._t0)

    def on_train_end(self, trainer, module) -> None:
        if trainer.global_rank == 0:
            Path(self.out).write_text(json.dumps({"steps_s": self.steps_s}))


def check_verify_options(top: int, steps: int, warmup: int, repeats: int) -> None:
    for name, value, least in (("verify_top", top, 1), ("verify_steps", steps, 1), ("verify_warmup", warmup, 0),
                               ("verify_repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r} must be an integer >= {least} (--{name.replace('_', '-')}).")


def verification_config(cfg: dict, timings: Path, root: Path, steps: int, warmup: int) -> dict:
    """The candidate's config as the verification runs it: the same model, data, strategy and devices; ``warmup +
    steps`` optimizer steps, nothing written but the step times."""
    out = copy.deepcopy(cfg)
    trainer = out.setdefault("trainer", {})
    trainer.pop("max_epochs", None)
    trainer.pop("check_val_every_n_epoch", None)  # Lightning's default (1), with validation switched off below
    trainer.update(max_steps=warmup + steps, limit_val_batches=0, val_check_interval=None, num_sanity_val_steps=0,
                   enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=str(root),
                   callbacks=[{"class_path": "lightning_3d.planner.verify.StepTimer",
                               "init_args": {"out": str(timings), "warmup": warmup}}])
    return out


def run_candidate(cfg: dict, workdir: Path, steps: int, warmup: int, timeout_s: float) -> dict:
    """One fresh ``lightning-3d fit`` of ``cfg``: ``{"steps_s": [...]}``, or ``{"error": why}``."""
    workdir.mkdir(parents=True, exist_ok=True)
    timings = workdir / "steps.json"
    timings.unlink(missing_ok=True)
    path = workdir / "verify.yaml"
    path.write_text(yaml.safe_dump(verification_config(cfg, timings, workdir, steps, warmup), sort_keys=False))
    try:
        run = subprocess.run([sys.executable, "-m", "lightning_3d.cli", "fit", "--config", str(path)], cwd=workdir,
                             env=dict(os.environ), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:g} s"}
    if run.returncode != 0 or not timings.exists():
        lines = [ln for ln in (run.stderr or run.stdout).strip().splitlines() if ln.strip()]
        return {"error": f"exit code {run.returncode}: {lines[-1] if lines else 'no output'}"}
    steps_s = json.loads(timings.read_text())["steps_s"]
    return {"steps_s": steps_s} if steps_s else {"error": "no step was timed"}


def verify(p: Any, *, top: int = 3, steps: int = 5, warmup: int = 2, repeats: int = 1, timeout_s: float = 600.0,
           log=print) -> Any:
    """Run the first ``top`` candidates of the plan ``p`` (``planner.Plan``; ``warmup`` + ``steps`` steps each,
    ``repeats`` times round-robin) and return the plan reordered by measured median step: the fastest measured
    first, the failed ones after the measured, the unverified ones last in their predicted order; ``measured`` holds
    each verified candidate's steps."""
    check_verify_options(top, steps, warmup, repeats)
    chosen = list(range(min(top, len(p.configs))))
    runs: dict[int, list[float]] = {k: [] for k in chosen}
    errors: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="lightning3d-verify-") as tmp:
        for r in range(repeats):
            for k in chosen:
                if k in errors:
                    continue
                log(f"verify: PLAN.{k} (repeat {r + 1} of {repeats}), {warmup} + {steps} steps")
                out = run_candidate(p.configs[k], Path(tmp) / f"c{k}_r{r}", steps, warmup, timeout_s)
                if "error" in out:
                    errors[k] = out["error"]
                else:
                    runs[k] += out["steps_s"]
    measured = {k: ({"error": errors[k]} if k in errors else
                    {"median_s": round(statistics.median(runs[k]), 6), "steps_s": [round(x, 6) for x in runs[k]],
                     "predicted_s": round(p.predictions[k].step_time, 6)}) for k in chosen}
    ok = sorted((k for k in chosen if k not in errors), key=lambda k: measured[k]["median_s"])
    if not ok:
        raise RuntimeError("plan --verify: no candidate ran: " + "; ".join(f"PLAN.{k}: {e}" for k, e in errors.items()))
    order = ok + [k for k in chosen if k in errors] + [k for k in range(len(p.configs)) if k not in runs]
    return p.reordered(order, {i: measured[k] for i, k in enumerate(order) if k in measured})
