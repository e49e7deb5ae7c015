"""A long CPU fit under Lightning's own launcher (this script is rank 0; it starts the other ranks as its children):
every rank writes ``rank<r>.pid`` into DIR once it has trained a step, then training goes on until it is killed.
``tests/test_orphans.py`` kills rank 0 and checks that its children end with it.

    python -m tests.scenarios.orphan_fit DIR PROCESSES
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl

from lightning_3d import Compressed3DStrategy
from tests.scenarios.common import TestData, make_model


class WritePid(pl.Callback):
    def __init__(self, directory: Path) -> None:
        self.directory, self.done = directory, False

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if not self.done:
            self.done = True
            tmp = self.directory / f"rank{trainer.global_rank}.tmp"
            tmp.write_text(str(os.getpid()))
            tmp.rename(self.directory / f"rank{trainer.global_rank}.pid")


def main() -> None:
    directory, processes = Path(sys.argv[1]), int(sys.argv[2])
    trainer = pl.Trainer(accelerator="cpu", devices=processes, strategy=Compressed3DStrategy(compression=False),
                         max_steps=100_000, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=[WritePid(directory)])
    trainer.fit(make_model(num_layers=2), datamodule=TestData(processes * 2, n=100_000))


if __name__ == "__main__":
    main()
