"""Garbage-collection control of Compressed3DStrategy (``gc_interval``, ``gc_freeze``; strategies/gc_control.py):
automatic collection off during a run and given back after it (also when it raises), full collections exactly at the
configured steps and evaluation batches, ``gc.freeze`` after the first and undone at teardown, ``None`` leaving
Python's collector alone, bad values refused. Every rank collecting at the same steps: tests/scenarios/fit_check.py."""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_3d import Compressed3DStrategy
from lightning_3d.strategies.gc_control import GarbageCollection
from tests.scenarios.common import FullCollections


@pytest.fixture(autouse=True)
def python_gc_state():
    """Every test starts with Python's default (enabled, nothing frozen) and must leave it so."""
    assert gc.isenabled() and gc.get_freeze_count() == 0
    yield
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    gc.enable()
    gc.unfreeze()
    assert enabled and frozen == 0


class Probe(BoringModel):
    """Records, at every training and validation batch, whether automatic collection is on and how many objects
    are frozen; raises in the training step ``fail_at`` (a global step) if given."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.enabled: list[bool] = []
        self.frozen: list[int] = []
        self.val_enabled: list[bool] = []

    def training_step(self, batch, batch_idx):
        self.enabled.append(gc.isenabled())
        self.frozen.append(gc.get_freeze_count())
        if self.trainer.global_step == self.fail_at:
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.val_enabled.append(gc.isenabled())
        return super().validation_step(batch, batch_idx)


def make_trainer(strategy: Compressed3DStrategy, steps: int, callbacks=(), **overrides) -> pl.Trainer:
    settings = dict(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, limit_val_batches=0, callbacks=list(callbacks))
    settings.update(overrides)
    return pl.Trainer(**settings)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(gc_interval=0), ValueError, r"`gc_interval=0` must be a positive number of optimizer steps between the"
                                          r" strategy's garbage collections \(e.g. 50\), or None to leave Python's"),
        (dict(gc_interval=-5), ValueError, r"`gc_interval=-5` must be a positive number"),
        (dict(gc_interval=2.5), ValueError, r"`gc_interval=2.5` must be a positive number"),
        (dict(gc_interval=True), ValueError, r"`gc_interval=True` must be a positive number"),
        (dict(gc_freeze="yes"), TypeError, r"`gc_freeze='yes'` must be True or False"),
    ],
)
def test_bad_values_are_refused(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        Compressed3DStrategy(**kwargs)


def test_defaults() -> None:
    control = Compressed3DStrategy().garbage_collection
    assert (control.interval, control.freeze) == (50, True)


def test_collects_at_exactly_the_configured_steps_with_automatic_collection_off() -> None:
    strategy, seen, module = Compressed3DStrategy(gc_interval=3), FullCollections(), Probe()
    make_trainer(strategy, 10, [seen]).fit(module)
    assert seen.steps == [3, 6, 9] == strategy.garbage_collection.collected_at_steps
    assert module.enabled == [False] * 10 and seen.enabled_in_batches == [False] * 10
    # Frozen after the first collection (before the batch of step 3), unfrozen at teardown (the fixture checks it).
    assert [n > 0 for n in module.frozen] == [False] * 3 + [True] * 7
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_once_per_optimizer_step_under_gradient_accumulation() -> None:
    strategy, seen = Compressed3DStrategy(gc_interval=2), FullCollections()
    make_trainer(strategy, 5, [seen], accumulate_grad_batches=3).fit(Probe())
    assert seen.steps == [2, 4]


def test_given_back_when_training_step_raises() -> None:
    strategy, module = Compressed3DStrategy(gc_interval=1), Probe(fail_at=3)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        make_trainer(strategy, 10).fit(module)
    assert module.enabled == [False] * 4 and module.frozen[-1] > 0  # it was off and frozen when it raised
    assert gc.isenabled() and gc.get_freeze_count() == 0 and not strategy.garbage_collection.active


def test_none_keeps_pythons_behaviour(monkeypatch) -> None:
    calls, strategy, module = [], Compressed3DStrategy(gc_interval=None), Probe()
    collect = gc.collect
    # Counted from the first batch on (a new run's setup collects the previous run's destroyed groups: process_groups).
    monkeypatch.setattr(gc, "collect", lambda *a: (calls.append(a) if module.enabled else None) or collect(*a))
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    make_trainer(strategy, 4, limit_val_batches=2, val_check_interval=2).fit(module)
    assert module.enabled == [True] * 4 and module.val_enabled == [True] * 4 and calls == []


def test_a_process_with_collection_off_keeps_it_off() -> None:
    gc.disable()
    try:
        module = Probe()
        make_trainer(Compressed3DStrategy(gc_interval=2), 3).fit(module)
        assert not gc.isenabled() and module.enabled == [False] * 3
    finally:
        gc.enable()


def test_no_freeze_without_gc_freeze() -> None:
    strategy, seen, module = Compressed3DStrategy(gc_interval=2, gc_freeze=False), FullCollections(), Probe()
    make_trainer(strategy, 5, [seen]).fit(module)
    assert seen.steps == [2, 4] and module.frozen == [0] * 5


def test_a_users_own_freeze_is_left_alone() -> None:
    keep = [[object()] for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        module = Probe()
        make_trainer(Compressed3DStrategy(gc_interval=1), 3).fit(module)
        # Neither frozen more (the count only drops, as frozen objects die) nor unfrozen.
        assert max(module.frozen) <= frozen and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    del keep


def test_evaluation_batches_are_counted_and_validation_refreezes(monkeypatch) -> None:
    # fit: 6 steps, validation of 3 batches after steps 2, 4 and 6 (9 batches: collections at the 2nd, 4th, 6th, 8th).
    strategy, seen, module = Compressed3DStrategy(gc_interval=2), FullCollections(), Probe()
    make_trainer(strategy, 6, [seen], limit_val_batches=3, val_check_interval=2).fit(module)
    assert strategy.garbage_collection.collected_at_steps == [2, 4]  # step 6 ends the fit: no batch follows it
    assert len(seen.steps) == 2 + 4 and module.val_enabled == [False] * 9
    # The training collections freeze (the first, and the first after a validation); evaluation ones do not in a fit.
    assert [n > 0 for n in module.frozen] == [False] * 2 + [True] * 4
    # validate / test alone: collections every 2nd batch, the first one freezes.
    calls, seen_in = [], []
    collect, freeze = gc.collect, gc.freeze
    monkeypatch.setattr(gc, "collect",
                        lambda *a: (calls.append("collect") if module.val_enabled else None) or collect(*a))
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze") or freeze())
    for run, limit in (("validate", "limit_val_batches"), ("test", "limit_test_batches")):
        module, strategy = Probe(), Compressed3DStrategy(gc_interval=2)
        module.test_step = lambda batch, batch_idx, module=module: module.validation_step(batch, batch_idx)
        getattr(make_trainer(strategy, 6, **{limit: 5 if run == "validate" else 3}), run)(module, verbose=False)
        seen_in.append(calls[:])
        calls.clear()
        assert module.val_enabled == [False] * (5 if run == "validate" else 3)
        assert not strategy.garbage_collection.active
    assert seen_in == [["collect", "freeze", "collect"], ["collect", "freeze"]]


def test_stop_is_idempotent_and_start_twice_changes_nothing() -> None:
    control = GarbageCollection(4, True)
    control.start("fit")
    control.start("fit")
    assert not gc.isenabled()
    control.stop()
    control.stop()
    assert gc.isenabled()
