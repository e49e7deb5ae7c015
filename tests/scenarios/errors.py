"""Every bad input raises its error on every rank, before any collective that the others would wait in.

The cases run one after another in one process group: if one rank raised while another went on into a
collective, the next case would hang and the test's timeout would fire. A healthy fit at the end proves
the group is still usable, and a case is ok only if every rank saw its message.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_3d import Compressed3DStrategy, MicroBatches
from tests.scenarios.common import SEQ, VOCAB, LossRecorder, TestData, Tokens, all_max, make_model, parse_args, trainer, write_report


class PlainModule(pl.LightningModule):
    """A LightningModule without the Parallel3DModule protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch["x"]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader([{"x": torch.ones(4)}] * 8, batch_size=4)


class OddMicroBatches(TestData):
    def train_dataloader(self):
        first = next(iter(super().train_dataloader()))
        mbs = [first, first, first]
        return DataLoader([MicroBatches(mbs)], batch_size=None)


class BadTokens(TestData):
    """Batches the model cannot read: an input or a label id equal to the vocabulary size, or sequences longer
    than the model's positions. Only one pipeline stage reads each (embeddings first, labels last)."""

    def __init__(self, kind: str) -> None:
        super().__init__(8)
        self.kind = kind

    def train_dataloader(self):
        data = Tokens(8, seq=SEQ + 4 if self.kind == "long" else SEQ)
        data.data[3, -1 if self.kind == "label" else 5] = VOCAB  # column 5 is an input (and a label); -1 a label only
        return DataLoader(data, batch_size=8)


def expect(name: str, message: str, fit) -> dict:
    try:
        fit()
    except Exception as error:  # noqa: BLE001 - the point is to see which error it is
        text = f"{type(error).__name__}: {error}"
        return {"case": name, "ok": message in text, "error": text[:600]}
    return {"case": name, "ok": False, "error": "no error raised"}


def main() -> None:
    args = parse_args()
    w = args.world

    def fit(strategy, module=None, data=None, steps=1):
        trainer(strategy, steps).fit(module or make_model(), datamodule=data or (TestData(8) if module is None else None))

    cases = [
        expect("sizes", f"= {2 * w}, but the job has {w} processes",
               lambda: fit(Compressed3DStrategy(data_parallel_size=2, pipeline_parallel_size=w, num_microbatches=w))),
        expect("more stages than layers", "every stage needs at least one layer",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w), make_model(num_layers=1), TestData(8))),
        expect("interleaving split", "does not divide evenly",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w, schedule="interleaved_1f1b"),
                           make_model(num_layers=2 * w + 1), TestData(8))),
        expect("heads over tp", f"tensor_parallel_size={w} does not divide the model's num_heads=3",
               lambda: fit(Compressed3DStrategy(tensor_parallel_size=w), make_model(num_heads=3), TestData(8))),
        expect("batch into micro-batches", "cannot be split into num_microbatches=3",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=3, schedule="gpipe"))),
        expect("variable count for interleaving", "(3) to be a multiple of pipeline_parallel_size",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w, schedule="interleaved_1f1b"),
                           make_model(), OddMicroBatches(8))),
        expect("plain module with pp", "does not implement num_pipeline_layers, build_pipeline_stages",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w), PlainModule())),
        expect("plain module with tp", "Implement the `lightning_3d.Parallel3DModule` protocol",
               lambda: fit(Compressed3DStrategy(tensor_parallel_size=w), PlainModule())),
        expect("plain module with micro-batches", "num_microbatches=2 needs the `lightning_3d.Parallel3DModule` protocol",
               lambda: fit(Compressed3DStrategy(num_microbatches=2), PlainModule())),
        expect("input id outside the vocabulary", f"input_ids holds token id {VOCAB}, outside the model's vocabulary of {VOCAB}",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w), make_model(), BadTokens("id"))),
        expect("label outside the vocabulary", f"labels holds token id {VOCAB}, outside the model's vocabulary of {VOCAB}",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w), make_model(), BadTokens("label"))),
        expect("sequence longer than the positions", f"input_ids has sequence length {SEQ + 4}, but the model has {SEQ} positions",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w), make_model(), BadTokens("long"))),
    ]
    recorder = LossRecorder()  # the group still works after all of the above
    trainer(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w), 2, [recorder]).fit(make_model(), datamodule=TestData(8))
    for case in cases:  # rank 0 reports; ok only where every rank raised the expected message
        case["ok"] = all_max(0.0 if case["ok"] else 1.0) == 0.0
    write_report(args.report, {"cases": cases, "healthy_losses": recorder.losses, "tokens": len(Tokens())})


if __name__ == "__main__":
    main()
