"""Planned steps cross from DataLoader workers to training unchanged and as one buffer per dtype; plans are done ahead
of training: with a training step slower than planning, no step waits for its plan (``PlanWaits``), and the counter
does count the steps that do wait (planning in the training process, or a planner slower than the step)."""

from __future__ import annotations

import copy as copy_module
import pickle
import threading
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_3d.dynamic import RECOMPUTE_KEY, DynamicMicroBatcher, PlannedMicroBatches, PlanWaits, background
from lightning_3d.pipeline.microbatch import MicroBatches
from tests.scenarios.dynamic import Ragged, pad_collate
from tests.scenarios.dynamic_costs import TINY, ToyCostModel

STEP_SECONDS = 0.2  # the test model's step; planning a 16-sample batch with the toy cost model takes milliseconds
STEPS = 8


class SlowModel(nn.Module):
    """A tiny language model whose forward sleeps: a training step much slower than planning, without timing the
    planner."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(300, 8), nn.Linear(8, 300)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        time.sleep(STEP_SECONDS)
        return self.out(self.embed(ids))


def train(model: nn.Module, batches, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, mbs in enumerate(batches):
        assert isinstance(mbs, MicroBatches) and mbs.orders is not None
        ids = torch.cat([mb["input_ids"].flatten() for mb in mbs])[None]  # one forward (one sleep) per step
        labels = torch.cat([mb["labels"].flatten() for mb in mbs])
        nn.functional.cross_entropy(model(ids)[0], labels, ignore_index=-100).backward()
        opt.step()
        opt.zero_grad()
        if step + 1 == steps:
            return


def batcher(collate=pad_collate) -> DynamicMicroBatcher:
    return DynamicMicroBatcher(collate, shape=TINY, dp=1, pp=2, dp_rank=0, memory_budget=3e5, cost_model=ToyCostModel(),
                               max_seq_len=16)


def test_a_planned_step_crosses_processes_as_one_buffer_per_dtype_and_unchanged() -> None:
    data = Ragged(n=32)
    b = batcher()
    local = b([data[i] for i in range(16)])
    assert isinstance(local, PlannedMicroBatches) and local.planned_at is not None and len(local) >= 2
    local[0][RECOMPUTE_KEY] = True  # a non-tensor leaf travels as it is
    local[0]["pair"] = (torch.ones(2, dtype=torch.bool), "x")
    shallow = copy_module.copy(local)
    assert type(shallow) is PlannedMicroBatches and shallow[0] is local[0] and shallow.planned_at == local.planned_at
    copy = pickle.loads(pickle.dumps(local))
    assert type(copy) is MicroBatches and copy.orders == local.orders and copy.planned_at == local.planned_at
    assert copy.plan == local.plan and len(copy) == len(local)
    for a, c in zip(local, copy):
        assert a.keys() == c.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], c[key]) and a[key].dtype == c[key].dtype
    assert copy[0][RECOMPUTE_KEY] is True and copy[0]["pair"][1] == "x" and torch.equal(copy[0]["pair"][0], torch.ones(2, dtype=torch.bool))

    loader = DataLoader(data, batch_size=16, collate_fn=b, num_workers=1, prefetch_factor=2)
    for step, mbs in enumerate(loader):
        expected = b([data[i] for i in range(16 * step, 16 * step + 16)])
        assert mbs.orders == expected.orders and len(mbs) == len(expected)
        for got, want in zip(mbs, expected):
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])
        # Every tensor of the step is a view of one shared buffer (all int64 here): one storage crossed.
        assert len({mb[k].untyped_storage().data_ptr() for mb in mbs for k in ("input_ids", "labels")}) == 1


def test_no_step_waits_for_its_plan_when_the_step_is_slower_than_planning() -> None:
    loader = DataLoader(Ragged(n=16 * (STEPS + 6)), batch_size=16, collate_fn=batcher(), num_workers=1,
                        prefetch_factor=2)
    waits = PlanWaits()
    train(SlowModel(), waits.wrap(background(loader, ahead=2)), STEPS)
    report = waits.summary()
    assert report["steps"] == STEPS and report["steps_waiting_for_plan"] == 0
    # Plans were done at least two steps before training asked for them (from step 3 on, where that is possible).
    assert report["plan_lead_min"] >= 2
    assert report["startup_waiting_for_plan"] == 1  # the first step is asked for as the loader starts


def test_the_counter_counts_steps_that_wait_for_their_plan() -> None:
    # Planning in the training process (no workers): every step is asked for before it is planned.
    waits = PlanWaits()
    loader = DataLoader(Ragged(n=16 * 4), batch_size=16, collate_fn=batcher(), num_workers=0)
    for _ in waits.wrap(loader):
        pass
    assert waits.summary()["steps_waiting_for_plan"] == 3 and waits.waited() == [True] * 4


class SlowCollate:
    """Collation (and so planning) slower than the training step, which here does nothing."""

    def __call__(self, samples, seq_len, target_len=None):
        time.sleep(0.05)
        return pad_collate(samples, seq_len, target_len)


def test_a_planner_slower_than_the_step_makes_every_step_wait() -> None:
    loader = DataLoader(Ragged(n=16 * 5), batch_size=16, collate_fn=batcher(SlowCollate()), num_workers=1,
                        prefetch_factor=2)
    waits = PlanWaits()
    assert sum(1 for _ in waits.wrap(background(loader, ahead=2))) == 5
    assert waits.summary()["steps_waiting_for_plan"] == 4  # each collates two or more micro-batches: >= 0.1 s


def test_background_raises_the_sources_error_and_stops_when_closed() -> None:
    def source():
        yield 1
        yield 2
        raise ValueError("bad sample 7")

    it = background(source(), ahead=1)
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(ValueError, match="bad sample 7"):
        next(it)

    before = threading.active_count()
    produced = []

    def endless():
        for i in range(10**9):
            produced.append(i)
            yield i

    it = background(endless(), ahead=2)
    assert next(it) == 0
    it.close()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before and len(produced) <= 4  # the thread stopped: 1 taken, 2 queued, 1 held
    with pytest.raises(ValueError, match="ahead must be a positive number of batches, got 0"):
        next(background([], ahead=0))


def test_the_multitask_modules_training_loader_fetches_ahead_records_waits_and_counts_consumed_steps(tmp_path) -> None:
    """``MultiTaskDataModule`` with workers: planned steps arrive through the background hand-off, ``plan_waits``
    records each step the training loop took, and the resumable position counts those steps only (not the ones the
    thread fetched ahead), so a checkpoint resumes at the next untrained batch."""
    from types import SimpleNamespace

    from lightning_3d.recipes import GPT
    from tests.test_multitask import module

    dm = module(tmp_path, microbatching="dynamic", memory_budget_gb=0.02, num_workers=1, global_batch_size=4)
    strategy = SimpleNamespace(dims=SimpleNamespace(dp=1, pp=1, tp=1), schedule="1f1b", virtual_stages=1,
                               pipeline_layer_split=None)
    dm.trainer = SimpleNamespace(lightning_module=GPT("tiny", vocab_size=dm.vocab_size, seq_length=256),
                                 strategy=strategy, precision="32-true")
    loader = dm.train_dataloader()
    it = iter(loader)
    taken = [next(it) for _ in range(3)]
    time.sleep(0.5)  # the thread fetches ahead meanwhile
    assert all(isinstance(b, MicroBatches) and b.orders is not None for b in taken)
    assert loader.state_dict()["consumed"] == 3 * 4
    report = dm.plan_waits.summary()
    assert report["steps"] == 3 and report["startup_steps"] == 1
    assert all(p is not None for p in dm.plan_waits.planned)  # every step came from the planner, stamped
    expected = dm.collator(1, 0)([dm.train_dataset[i] for i in list(iter(loader.sampler))[4:8]])
    assert [mb["input_ids"].shape for mb in taken[1]] == [mb["input_ids"].shape for mb in expected]
