"""Started with plain `python`: Lightning's own launcher spawns the second process. One rank fails mid-run."""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch

from lightning_3d import Compressed3DStrategy
from tests.scenarios.common import TestData, make_model


class FailOnRank(pl.Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_start(self, trainer, module) -> None:
        # each rank's share of the cores (the strategy's setup; the test runs this job without OMP_NUM_THREADS)
        print(f"rank {trainer.global_rank} intra-op threads {torch.get_num_threads()}"
              f" OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}", flush=True)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == 2 and trainer.global_rank == self.rank:
            raise RuntimeError(f"simulated failure on rank {self.rank}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, required=True)
    args = parser.parse_args()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=Compressed3DStrategy(pipeline_parallel_size=2, num_microbatches=2),
                         max_steps=50, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         use_distributed_sampler=False, callbacks=[FailOnRank(args.fail_rank)])
    trainer.fit(make_model(), datamodule=TestData(8))


if __name__ == "__main__":
    main()
