"""What a run leaves behind and how it ends when a peer freezes.

``--mode freeze``: the last rank stops itself (SIGSTOP) at step 2; the others must fail within the strategy's
``timeout`` (every group the strategy creates carries it), not torch's 30-minute default. The test harness kills the
stopped rank.

``--mode fits``: ten fits in one process, each with its own trainer and strategy, counting file descriptors, threads
and process groups after every fit; then a second model fitted on a strategy that already trained another must end
exactly where a fresh strategy's run of it ends, and validate after fit must run on the kept groups.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_3d import Compressed3DStrategy
from tests.scenarios.common import TestData, make_model, trainer


class FreezeAt(pl.Callback):
    """Stop this process at ``step`` on ``rank``, after noting the wall-clock time in ``stamp`` for the test."""

    def __init__(self, rank: int, step: int, stamp: Path) -> None:
        self.rank, self.step, self.stamp = rank, step, stamp

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == self.step and trainer.global_rank == self.rank:
            self.stamp.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)


def freeze(args: argparse.Namespace) -> None:
    dp, pp, tp = args.layout
    world = dp * pp * tp
    # The default group is made here, with a generous timeout: processes started on a loaded machine reach the
    # rendezvous seconds apart. The strategy then finds it initialised, so only the groups it creates itself carry its
    # short timeout, and a failure within that timeout can only come from them.
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    strategy = Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                    num_microbatches=2, timeout=timedelta(seconds=args.timeout))
    freezer = FreezeAt(world - 1, 2, args.report.with_suffix(".frozen"))
    trainer(strategy, 20, callbacks=[freezer]).fit(make_model(num_layers=2), datamodule=TestData(8))


def resources() -> dict[str, int]:
    # The number of live process groups is only visible in c10d's private registry; the test reads it here (and only
    # here) because a leaked group is exactly what it must catch, and threads or descriptors alone would not name it.
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "tasks": len(os.listdir("/proc/self/task")),
        "groups": len(dist.distributed_c10d._world.pg_map),
    }


def fit(model, strategy: Compressed3DStrategy, steps: int = 2, **overrides) -> pl.Trainer:
    t = trainer(strategy, steps, **overrides)
    t.fit(model, datamodule=TestData(8))
    return t


def layout_strategy() -> Compressed3DStrategy:
    return Compressed3DStrategy(pipeline_parallel_size=2, num_microbatches=2, timeout=timedelta(seconds=60))


def seeded_model(seed: int):
    torch.manual_seed(seed)
    return make_model(num_layers=2)


def final_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fits(args: argparse.Namespace) -> None:
    counts = []
    for _ in range(10):
        fit(seeded_model(0), layout_strategy())
        counts.append(resources())
    # A different model (another init) on the same strategy, through the same trainer (Lightning refuses a strategy
    # instance that a trainer set up already in a second trainer), against a fresh strategy's run of it. The recipe's
    # learning-rate schedule lives in the scheduler each fit creates, so both runs take the same three steps.
    first = fit(seeded_model(1), layout_strategy())
    first.fit_loop.epoch_loop.max_steps = 5
    second = seeded_model(2)
    first.fit(second, datamodule=TestData(8))
    fresh = seeded_model(2)
    fresh_trainer = fit(fresh, layout_strategy(), steps=3)
    a, b = final_state(second), final_state(fresh)
    same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # The byte counts are per model too: the first model's traffic must not be carried into the second's.
    same_stats = first.strategy.communication_stats() == fresh_trainer.strategy.communication_stats()
    # Validate after fit runs on the groups the fit kept: its loss is the fit's own last validation loss.
    model = seeded_model(3)
    t = fit(model, layout_strategy(), limit_val_batches=2, val_check_interval=2)
    fit_val = float(t.callback_metrics["val_loss"])
    val = t.validate(model, datamodule=TestData(8), verbose=False)[0]["val_loss"]
    report = {"counts": counts, "same_as_fresh": same, "same_stats": same_stats, "fit_val": fit_val, "validate_val": float(val),
              "after_validate": resources()}
    rank = int(os.environ["RANK"])
    path = args.report if rank == 0 else args.report.with_suffix(f".r{rank}.json")
    path.write_text(json.dumps(report, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--mode", choices=["freeze", "fits"], required=True)
    parser.add_argument("--layout", type=int, nargs=3, default=(1, 2, 1))
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    freeze(args) if args.mode == "freeze" else fits(args)


if __name__ == "__main__":
    main()
