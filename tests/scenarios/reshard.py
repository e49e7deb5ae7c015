"""Resharding: a checkpoint saved at (2,2,2) resumes under other layouts with the same next-step loss.

``--extra save,DIR``: (8 processes) train straight for 3 steps; train 2 steps saving a checkpoint in DIR;
resume it at (1,4,2) for the third step. ``--extra resume,DIR,dp,pp,tp``: resume it in that layout.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import Compressed3DStrategy
from tests.scenarios.common import LossRecorder, make_model, parse_args, trainer, write_report
from tests.scenarios.features import resumable_data

GLOBAL_BATCH = 8


def strategy(dp: int, pp: int, tp: int) -> Compressed3DStrategy:
    return Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                num_microbatches=4, compression=False)


def resume(path: str, dp: int, pp: int, tp: int) -> float:
    recorder = LossRecorder()
    trainer(strategy(dp, pp, tp), 3, [recorder]).fit(make_model(), datamodule=resumable_data(GLOBAL_BATCH), ckpt_path=path)
    return recorder.losses[-1]


def main() -> None:
    args = parse_args()
    mode, folder, *layout = args.extra.split(",")
    if mode == "save":
        straight = LossRecorder()
        trainer(strategy(2, 2, 2), 3, [straight]).fit(make_model(), datamodule=resumable_data(GLOBAL_BATCH))
        saver = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
        trainer(strategy(2, 2, 2), 2, [saver], enable_checkpointing=True).fit(make_model(), datamodule=resumable_data(GLOBAL_BATCH))
        path = str(next(Path(folder).glob("*.ckpt")))
        write_report(args.report, {"straight": straight.losses, "checkpoint": path, "1,4,2": resume(path, 1, 4, 2)})
    else:
        path = str(next(Path(folder).glob("*.ckpt")))
        dp, pp, tp = (int(x) for x in layout)
        write_report(args.report, {"loss": resume(path, dp, pp, tp)})


if __name__ == "__main__":
    main()
