"""Checkpoint safety under the strategy (2 processes, dp=2 with compression, so each rank also saves its own state).

- ``crashes``: a save of ``last.ckpt`` over the step-2 checkpoint is interrupted after each of its steps (a crash
  injected through ``checkpoint_files._reached``: the exception leaves the files as a kill at that point would), with
  the atomic directory exchange and with the two-rename fallback; then
  ``fit(ckpt_path=last.ckpt)`` must resume from step 2 (crash before the swap) or step 3 (after it) with the losses
  of an uninterrupted run, and the next save must clean up what the crash left.
- ``damaged``: copies of a good checkpoint with one defect each (a flipped byte, a shard or meta file from another
  step, missing files, a truncated .metadata, no manifest, planted pickles whose unpickling would create a marker
  file): resuming must raise on every rank, and no marker may exist.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import Compressed3DStrategy
from lightning_3d.checkpoint import files as ckpt
from tests.scenarios.common import LossRecorder, make_model, parse_args, trainer, write_report
from tests.scenarios.features import resumable_data

SMALL = dict(num_layers=2, hidden_size=32, num_heads=4)
# (step after which the save crashes, whether the filesystem may exchange directories atomically): the last two
# take the two-rename path of filesystems without renameat2(RENAME_EXCHANGE).
STAGES = {"written": True, "manifest": True, "exchanged": True, "moved_old": False, "moved_new": False}


class Payload:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): the stand-in for code a planted pickle runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


class Crash(Exception):
    pass


class Start(pl.Callback):
    def on_train_start(self, trainer, module) -> None:
        self.step = trainer.global_step


def strategy() -> Compressed3DStrategy:
    return Compressed3DStrategy(data_parallel_size=2, num_microbatches=2, cb_rank=4, cb_min_compression_ratio=0.0,
                                cb_lazy_error_propagation=True, sc_rank=4, sc_warmup=2)


def fit(steps: int, callbacks: list, ckpt_path: Path | None = None) -> None:
    saves = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    trainer(strategy(), steps, callbacks, enable_checkpointing=saves).fit(
        make_model(**SMALL), datamodule=resumable_data(8), ckpt_path=None if ckpt_path is None else str(ckpt_path))


def saver(folder: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, save_top_k=0, save_last=True, every_n_train_steps=1)


def outcome(run) -> list:
    """Every rank's (exception type, message) of ``run()``, or None where it returned."""
    try:
        run()
        mine = None
    except Exception as err:  # noqa: BLE001 - reported
        mine = [type(err).__name__, str(err)]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def on_rank0(action) -> None:
    """Rank 0 changes the shared folder while the others wait, before (they may still be reading it) and after."""
    dist.barrier()
    if dist.get_rank() == 0:
        action()
    dist.barrier()


def crashes(root: Path) -> dict:
    straight = LossRecorder()
    fit(4, [straight])
    folder = root / "run"
    fit(2, [saver(folder)])
    on_rank0(lambda: shutil.copytree(folder / "last.ckpt", root / "step2"))
    report = {"straight": straight.losses, "rank_state": sorted(os.listdir(root / "step2" / ckpt.RANK_STATE_DIR))}
    original, exchange = ckpt._reached, ckpt._exchange
    for stage, can_exchange in STAGES.items():
        on_rank0(lambda: (shutil.rmtree(folder), shutil.copytree(root / "step2", folder / "last.ckpt")))

        def crash(reached: str, stage=stage) -> None:
            if reached == stage:
                raise Crash(f"injected crash after {stage}")

        ckpt._reached = crash
        ckpt._exchange = exchange if can_exchange else (lambda a, b: False)
        try:
            crashed = outcome(lambda: fit(3, [saver(folder)], folder / "last.ckpt"))
        finally:
            ckpt._reached, ckpt._exchange = original, exchange
        after_crash = sorted(os.listdir(folder))
        start, losses = Start(), LossRecorder()
        fit(4, [start, losses, saver(folder)], folder / "last.ckpt")
        report[stage] = {"crash": crashed, "after_crash": after_crash, "resumed_from": start.step,
                         "losses": losses.losses, "after_resume": sorted(os.listdir(folder))}
    return report


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _rehash(path: Path) -> None:
    """A manifest that matches the (planted) files: only the refusal to unpickle them can stop the payload."""
    ckpt._write_manifest(path, {f: ckpt._digest(path / f) for f in ckpt._listing(path)}, 0)


def damaged(root: Path) -> dict:
    good, old = root / "run" / "last.ckpt", root / "step2"  # steps 4 and 2 (crashes ran first)
    variants = {
        "flipped_shard": lambda p: _flip(p / "__1_0.distcp"),
        "shard_of_other_step": lambda p: shutil.copy(old / "__0_0.distcp", p / "__0_0.distcp"),
        "meta_of_other_step": lambda p: shutil.copy(old / ckpt.META_FILE, p / ckpt.META_FILE),
        "missing_rank_state": lambda p: (p / ckpt.RANK_STATE_DIR / "rank1.pt").unlink(),
        "missing_shard": lambda p: (p / "__1_0.distcp").unlink(),
        "truncated_metadata": lambda p: (p / ".metadata").write_bytes((p / ".metadata").read_bytes()[:100]),
        "no_manifest": lambda p: (p / ckpt.MANIFEST_FILE).unlink(),
        "planted_meta": lambda p: (torch.save(Payload(root / "marker_meta"), p / ckpt.META_FILE), _rehash(p)),
        "planted_rank_state": lambda p: (torch.save(Payload(root / "marker_rank"), p / ckpt.RANK_STATE_DIR / "rank1.pt"),
                                         _rehash(p)),
        "planted_metadata": lambda p: ((p / ".metadata").write_bytes(pickle.dumps(Payload(root / "marker_metadata"))),
                                       _rehash(p)),
    }
    report = {}
    for name, damage in variants.items():
        path = root / "damaged" / name
        on_rank0(lambda: (shutil.copytree(good, path), damage(path)))
        report[name] = outcome(lambda: fit(5, [], path))
    report["markers"] = sorted(p.name for p in root.glob("marker*"))
    good_run = Start()
    fit(5, [good_run], good)  # the undamaged original still resumes
    report["good_resumed_from"] = good_run.step
    return report


def main() -> None:
    args = parse_args()
    root = Path(args.extra)
    report = {"crashes": crashes(root)}
    report["damaged"] = damaged(root)
    write_report(args.report, report)


if __name__ == "__main__":
    main()
