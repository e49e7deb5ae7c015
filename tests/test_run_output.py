"""What a run prints on the Python path (lightning_3d/strategies/run_output.py): the strategy installs the whole-model
summary and the step progress bar in place of Lightning's defaults, keeps a user's own, and silences Lightning's notices
that say nothing about the run (in-process, one CPU process)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelSummary, RichProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_3d import Compressed3DStrategy
from lightning_3d.callbacks import ParallelModelSummary, StepProgressBar

NOTICES = ("tensorboardX", "LeafSpec", "Total length of `list` across ranks is zero")


class MySummary(ModelSummary):
    """A summary of the user's own class: left alone."""


def fit(tmp_path, callbacks=()) -> tuple[pl.Trainer, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(), max_steps=1,
                             default_root_dir=tmp_path, callbacks=list(callbacks), enable_checkpointing=False)
        trainer.fit(BoringModel(), val_dataloaders=[])  # what the recipes' data modules return for val_fraction=0
    return trainer, [str(w.message) for w in caught]


def test_the_strategy_installs_its_summary_and_bar_and_silences_the_notices(tmp_path, single_process):
    trainer, messages = fit(tmp_path)
    kinds = {type(c) for c in trainer.callbacks}
    assert ParallelModelSummary in kinds and StepProgressBar in kinds, kinds
    assert not {ModelSummary, RichProgressBar} & kinds, kinds
    for notice in NOTICES:
        assert not [m for m in messages if notice in m], (notice, messages)


def test_a_summary_of_the_users_own_class_is_kept(tmp_path, single_process):
    trainer, _ = fit(tmp_path, [MySummary(max_depth=2)])
    (summary,) = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    assert type(summary) is MySummary and summary._max_depth == 2


@pytest.mark.parametrize("needs", [("input_length", "target_length"), ()])
def test_flops_per_token_reads_its_arguments_from_the_data_module(needs):
    """T5's flops_per_token(input_length, target_length) takes the data module's lengths; GPT's needs none; a data
    module without them leaves the line out instead of crashing the summary."""
    from types import SimpleNamespace

    from lightning_3d.strategies.run_output import model_flops_per_token

    class Module:
        def flops_per_token(self, *args, **kwargs):
            return float(sum(kwargs.values()) or 7)

    if needs:
        Module.flops_per_token = lambda self, input_length, target_length: float(input_length * 1000 + target_length)
    data = SimpleNamespace(input_length=128, target_length=29)
    assert model_flops_per_token(SimpleNamespace(datamodule=data), Module()) == (128029.0 if needs else 7.0)
    assert model_flops_per_token(SimpleNamespace(datamodule=None), Module()) == (None if needs else 7.0)
