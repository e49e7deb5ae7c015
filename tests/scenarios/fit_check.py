"""The fit check on every rank: a layout that cannot fit the (injected) device memory stops on every rank with the
same message before any collective; "warn" trains with a warning; a layout that fits trains; a module the memory
model does not know is not checked, nor is validation. A healthy fit at the end proves no rank was left inside a collective
(and records the steps of its garbage collections on each rank).

Each rank writes what it saw to ``<report>.rank<r>.json`` (the test compares the ranks' messages).
"""

from __future__ import annotations

import gc
import json
import os
import warnings

import torch.distributed as dist

from lightning_3d import Compressed3DStrategy
from lightning_3d.strategies.fit_check import CAPACITY_ENV, GIB, RESERVE
from tests.scenarios.common import FullCollections, LossRecorder, TestData, make_model, parse_args, trainer, write_report
from tests.scenarios.errors import PlainModule

TINY_GIB = (RESERVE + 2**20) / GIB  # 1 MiB above the reserve: the tiny GPT's weights alone are more
LARGE_GIB = 64.0


def main() -> None:
    args = parse_args()
    w = args.world
    seen: dict = {}

    def fit(strategy, module=None, data=None, capacity=None):
        os.environ[CAPACITY_ENV] = str(capacity)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer(strategy, 1).fit(module or make_model(), datamodule=data or (TestData(8) if module is None else None))
            return {"error": None, "warnings": [str(c.message) for c in caught if "GPU memory" in str(c.message)],
                    "estimate": strategy.memory_estimate is not None}
        except Exception as error:  # noqa: BLE001 - the point is to see which error it is
            return {"error": f"{type(error).__name__}: {error}", "estimate": None}
        finally:
            del os.environ[CAPACITY_ENV]

    def pipeline(**kw):
        return Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w, **kw)

    seen["too_small"] = fit(pipeline(), capacity=TINY_GIB)
    seen["too_small_warn"] = fit(pipeline(memory_check="warn"), capacity=TINY_GIB)
    seen["too_small_off"] = fit(pipeline(memory_check="off"), capacity=TINY_GIB)
    seen["large"] = fit(pipeline(), capacity=LARGE_GIB)
    seen["own_model"] = fit(Compressed3DStrategy(), PlainModule(), capacity=TINY_GIB)
    os.environ[CAPACITY_ENV] = str(TINY_GIB)  # validation holds no gradients or optimizer state: not checked
    strategy = pipeline()
    trainer(strategy, 1, limit_val_batches=1).validate(make_model(), datamodule=TestData(8))
    seen["validate"] = {"estimate": strategy.memory_estimate is not None}
    del os.environ[CAPACITY_ENV]
    # The group still works after all of the above; the strategy's garbage collections (gc_interval) run on every
    # rank at the same steps, with automatic collection off throughout (tests/test_gc_control.py compares the ranks).
    recorder, collections = LossRecorder(), FullCollections()
    trainer(pipeline(gc_interval=2), 5, [recorder, collections]).fit(make_model(), datamodule=TestData(8))
    seen["healthy_losses"] = recorder.losses
    seen["gc"] = {"steps": collections.steps, "enabled_in_batches": collections.enabled_in_batches,
                  "enabled_after": gc.isenabled(), "frozen_after": gc.get_freeze_count()}
    rank = dist.get_rank()
    args.report.with_suffix(f".rank{rank}.json").write_text(json.dumps(seen, indent=1))
    dist.barrier()
    write_report(args.report, {"ranks": w})


if __name__ == "__main__":
    main()
