"""Resharding: a checkpoint saved at (2,2,2) resumes under other layouts with the same next-step loss.

``--extra save,DIR``: (8 processes) for GPT and then T5: train straight for 3 steps; train 2 steps saving a
checkpoint in DIR/<model>; resume it at (1,4,2) for the third step. ``--extra resume,DIR,dp,pp,tp``: resume both
checkpoints in that layout. Both recipes share the spawned process groups (starting them is the expensive part).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes import T5
from lightning_3d.recipes.data import ResumableDataLoader, ResumableDistributedSampler
from tests.scenarios.common import LossRecorder, make_model, parse_args, trainer, write_report
from tests.scenarios.features import resumable_data
from tests.scenarios.t5_layouts import MODEL as T5_MODEL
from tests.scenarios.t5_layouts import Pairs

GLOBAL_BATCH = 8


def strategy(dp: int, pp: int, tp: int) -> Compressed3DStrategy:
    return Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                num_microbatches=4, compression=False)


def t5_model() -> T5:
    """The tiny preset with the T5 scenarios' overrides: 4 encoder + 4 decoder blocks (the preset's 2 + 2 would
    leave pp=4 one block a stage; 8 give (1,4,2) two a stage with a cut at the encoder/decoder seam, and (2,2,2) a
    stage per stack), hidden 32 and vocabulary 300 (padded to 384 at tp=1, 512 at tp=2: the padding reshards)."""
    return T5("tiny", **T5_MODEL)


def t5_data(global_batch: int) -> pl.LightningDataModule:
    """(input, target) pairs with encoder padding and -100 label tails, through the resumable loader."""

    class Data(pl.LightningDataModule):
        def train_dataloader(self) -> ResumableDataLoader:
            kw = self.trainer.strategy.distributed_sampler_kwargs
            dataset = Pairs(64)
            sampler = ResumableDistributedSampler(dataset, num_replicas=kw["num_replicas"], rank=kw["rank"], shuffle=True, seed=3)
            return ResumableDataLoader(dataset, batch_size=global_batch // kw["num_replicas"], sampler=sampler)

    return Data()


RECIPES = {"gpt": (make_model, resumable_data), "t5": (t5_model, t5_data)}


def resume(recipe: str, path: str, dp: int, pp: int, tp: int) -> float:
    model, data = RECIPES[recipe]
    recorder = LossRecorder()
    trainer(strategy(dp, pp, tp), 3, [recorder]).fit(model(), datamodule=data(GLOBAL_BATCH), ckpt_path=path)
    return recorder.losses[-1]


def save(recipe: str, folder: Path) -> dict:
    """Losses of 3 straight steps at (2,2,2), the path of a checkpoint after 2, and its third step at (1,4,2)."""
    model, data = RECIPES[recipe]
    straight = LossRecorder()
    trainer(strategy(2, 2, 2), 3, [straight]).fit(model(), datamodule=data(GLOBAL_BATCH))
    saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    trainer(strategy(2, 2, 2), 2, [saver], enable_checkpointing=True).fit(model(), datamodule=data(GLOBAL_BATCH))
    path = str(next(folder.glob("*.ckpt")))
    return {"straight": straight.losses, "checkpoint": path, "1,4,2": resume(recipe, path, 1, 4, 2)}


def main() -> None:
    args = parse_args()
    mode, folder, *layout = args.extra.split(",")
    if mode == "save":
        write_report(args.report, {recipe: save(recipe, Path(folder) / recipe) for recipe in RECIPES})
    else:
        dp, pp, tp = (int(x) for x in layout)
        write_report(args.report, {recipe: resume(recipe, str(next((Path(folder) / recipe).glob("*.ckpt"))), dp, pp, tp)
                                   for recipe in RECIPES})


if __name__ == "__main__":
    main()
