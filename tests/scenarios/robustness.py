"""Options that used to be accepted and ignored, SC's link decision across a resume, tied-name checks and the
non-finite step policy, in one process group of two ranks.

- Errors (every rank raises, before any collective: the next case would hang otherwise): a typo in
  ``pipeline_tied_parameters`` at pp = 2, tied weights untied by ``parallelize_stage`` at tp = 2, ``trainer.predict``
  at pp = 2, a ZeroRedundancyOptimizer, ``on_nonfinite="raise"``, too many non-finite steps in a row.
- SC's decision: saved under a "slow" link probe, resumed under a "fast" one, the run goes on compressing and its
  losses equal an uninterrupted run's bit for bit (and the other way round: saved fast, resumed slow, no SC).
- Non-finite steps (exact, SC, CB with LEP): a NaN loss on one replica at step K skips the step everywhere: parameters
  and optimizer state after it equal those before it, compression state stays finite, and training goes on.
- The lazy verdict (fused AdamW: the flag skips the step on the device, the host reads it a step later): the same
  parameters, optimizer state and losses as the synchronous verdict bit for bit around a skipped step (data parallel,
  shard_optimizer_state, tensor parallel), the host's
  reads of the flag counted (none of a step's own before its update), "raise" one step late with the parameters from
  before the bad step, a bad last step acted on at fit's end, the streak limit, and no checkpoint after a bad step.
- strict_loading=False: a checkpoint lacking a parameter of the model loads, keeping the model's own value.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.api
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_3d import Compressed3DStrategy
from tests.scenarios.common import LossRecorder, TestData, make_model, parse_args, trainer, write_report
from tests.scenarios.features import resumable_data

LAYERS = 4  # small and fast; every stage still holds whole blocks


def expect(name: str, message: str, fit) -> dict:
    """As errors.expect, but DCP's CheckpointException (which gathers every rank's error) is a BaseException."""
    try:
        fit()
    except (Exception, torch.distributed.checkpoint.api.CheckpointException) as error:  # noqa: BLE001
        text = f"{type(error).__name__}: {error}"
        return {"case": name, "ok": message in text, "error": text[:600]}
    return {"case": name, "ok": False, "error": "no error raised"}


def model(**overrides):
    return make_model(num_layers=LAYERS, **overrides)


# ----- errors -------------------------------------------------------------------------------------------------
def typo_in_tied_names():
    m = model()
    m.pipeline_tied_parameters = lambda: {"model.embed.wte.weight": "model.head.weigth"}
    return m


def untied_by_parallelize():
    m = model()
    original = m.parallelize_stage

    def parallelize_stage(stage, tp_mesh, sequence_parallel):
        original(stage, tp_mesh, sequence_parallel)
        head = m.model.head
        head.weight = torch.nn.Parameter(head.weight.detach().clone())  # a second Parameter: tied no more

    m.parallelize_stage = parallelize_stage
    return m


def zero_optimizer():
    m = model()

    def configure_optimizers():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)

    m.configure_optimizers = configure_optimizers
    return m


class Poison(pl.Callback):
    """Makes the loss NaN on the given data-parallel ranks at the given steps (before any gradient exists, so every
    gradient of those replicas turns NaN: the CB sends, the SC buckets and the exact all-reduce all see it)."""

    def __init__(self, steps, dp_ranks=(0,)) -> None:
        self.steps, self.dp_ranks = set(steps), set(dp_ranks)

    def setup(self, trainer, module, stage) -> None:
        original = module.pipeline_loss

        def pipeline_loss(output, microbatch):
            loss = original(output, microbatch)
            poisoned = trainer.global_step in self.steps and trainer.strategy.dp_rank in self.dp_ranks
            return loss * float("nan") if poisoned else loss

        module.pipeline_loss = pipeline_loss  # before the strategy's setup builds the runtime around it


class Snapshot(pl.Callback):
    """Parameters and optimizer state just before step K and just after it."""

    def __init__(self, step: int) -> None:
        self.step, self.before, self.after = step, None, None

    @staticmethod
    def state(trainer, module):
        opt = trainer.optimizers[0]
        params = [p.detach().clone() for p in module.parameters()]
        moments = [{k: v.detach().clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                   for g in opt.param_groups for p in g["params"]]
        return params, moments

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self.before = self.state(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step + 1:
            self.after = self.state(trainer, module)

    def unchanged(self) -> bool:
        def same(a, b):
            if torch.is_tensor(a):
                a, b = (x.full_tensor() if isinstance(x, DTensor) else x for x in (a, b))
                return torch.equal(a, b)
            return a == b

        (p0, m0), (p1, m1) = self.before, self.after
        params = all(same(a, b) for a, b in zip(p0, p1, strict=True))
        moments = all(a.keys() == b.keys() and all(same(a[k], b[k]) for k in a) for a, b in zip(m0, m1, strict=True))
        return params and moments


def all_true(flag: bool) -> bool:
    t = torch.tensor(float(flag))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def finite_state(strategy: Compressed3DStrategy) -> bool:
    tensors = []
    if strategy.selective_compression is not None:
        s = strategy.selective_compression.state
        tensors += [*s.error_dict.values(), *s.q_memory_dict.values()]
    if strategy.compressed_backprop is not None:
        tensors += [*strategy.compressed_backprop.q_memory.values(), *strategy.compressed_backprop.errors.values()]
    return all(torch.isfinite(t).all().item() for t in tensors)


def nonfinite_run(kind: str, w: int, poison_step: int = 2, steps: int = 5) -> dict:
    options = {
        "exact": dict(data_parallel_size=w, compression=False),
        # fusion on every layer (the tiny model is below the "auto" threshold): the stage has two buckets, fused
        # weights and the rest, and the test checks that both were skipped
        "sc": dict(data_parallel_size=w, compressed_stages=[0], sc_rank=2, sc_warmup=1, gradient_accumulation_fusion=True),
        "cb": dict(pipeline_parallel_size=w, num_microbatches=w, cb_rank=2, cb_min_compression_ratio=0.0,
                   cb_epilogue_only=False, cb_lazy_error_propagation=True),
    }[kind]
    clean, poisoned, snap = LossRecorder(), LossRecorder(), Snapshot(poison_step)
    trainer(Compressed3DStrategy(**options), steps, [clean]).fit(model(), datamodule=TestData(8))
    strategy = Compressed3DStrategy(**options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy, steps, [poisoned, Poison([poison_step]), snap]).fit(model(), datamodule=TestData(8))
    skipped = [str(c.message) for c in caught if "the step is skipped on every rank" in str(c.message)]
    sc = strategy.selective_compression
    cb = strategy.compressed_backprop
    return {
        "kind": kind,
        "clean": clean.losses,
        "poisoned": poisoned.losses,
        "unchanged": all_true(snap.unchanged()),
        "finite_state": all_true(finite_state(strategy)),
        # CB's state lives on the sending (last) stage, SC's on every replica: some rank holds state to check.
        "has_state": not all_true(not (bool(sc is not None and sc.state.error_dict)
                                      or bool(cb is not None and cb.q_memory and cb.errors))),
        "sc_iter": sc.state.iter if sc is not None else None,
        "sc_skipped_buckets": sc.nonfinite_buckets if sc is not None else None,
        "warnings": skipped,
    }


# ----- the lazy verdict (fused AdamW) against the synchronous one --------------------------------------------------
class VerdictReads(pl.Callback):
    """How many times the strategy's step code read a tensor on the host (``Tensor.item`` / ``bool`` called from
    nonfinite.py) by the end of each step (its verdict is taken after Lightning's on_before_optimizer_step
    hooks, inside the optimizer's step: the lazy path reads only earlier steps' verdicts there), and in all."""

    def __init__(self) -> None:
        self.before_update: list[int] = []
        self.count = 0
        self._saved = None

    def on_fit_start(self, trainer, module) -> None:
        saved = self._saved = (torch.Tensor.item, torch.Tensor.__bool__)

        def counted(original):
            def read(tensor, *args):
                if sys._getframe(1).f_code.co_filename.endswith("nonfinite.py"):
                    self.count += 1
                return original(tensor, *args)
            return read

        torch.Tensor.item, torch.Tensor.__bool__ = (counted(f) for f in saved)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.before_update.append(self.count)

    def on_fit_end(self, trainer, module) -> None:  # after the strategy's on_train_end (its flush)
        torch.Tensor.item, torch.Tensor.__bool__ = self._saved


def fused_model():
    return model(optimizer_foreach=None, optimizer_fused=True)  # MODEL sets foreach (the sync path elsewhere)


LAZY_LAYOUTS = {  # the optimizer steps the parameters; ShardedOptimizer's pieces; tensor parallelism's local pieces
    "dp": dict(data_parallel_size=2, compression=False),
    "sharded": dict(data_parallel_size=2, compression=False, shard_optimizer_state=True),
    "tp": dict(tensor_parallel_size=2, compression=False),
}


def lazy_vs_sync(layout: str, poison_step: int = 2, steps: int = 5) -> dict:
    runs = {}
    for path in ("lazy", "sync"):
        strategy = Compressed3DStrategy(**LAZY_LAYOUTS[layout])
        strategy.engine.lazy_verdict = path == "lazy"
        losses, reads, snap, m = LossRecorder(), VerdictReads(), Snapshot(poison_step), fused_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t = trainer(strategy, steps, [losses, reads, snap, Poison([poison_step])])
            t.fit(m, datamodule=TestData(8))
        runs[path] = dict(losses=losses.losses, reads=reads.before_update, total=reads.count,
                          unchanged=snap.unchanged(), state=Snapshot.state(t, m),
                          warnings=[str(c.message) for c in caught if "the step is skipped on every rank" in str(c.message)])

    def same(a, b):
        a, b = (x.to_local() if isinstance(x, DTensor) else x for x in (a, b))
        return torch.equal(a, b) if torch.is_tensor(a) else a == b

    (p0, m0), (p1, m1) = runs["lazy"].pop("state"), runs["sync"].pop("state")
    equal = all(same(a, b) for a, b in zip(p0, p1, strict=True)) and all(
        a.keys() == b.keys() and all(same(a[k], b[k]) for k in a) for a, b in zip(m0, m1, strict=True))
    return {"layout": layout, "equal": all_true(equal), "lazy_unchanged": all_true(runs["lazy"].pop("unchanged")),
            "sync_unchanged": all_true(runs["sync"].pop("unchanged")), **runs}


def lazy_raise(w: int, poison_step: int = 1, steps: int = 4) -> dict:
    """on_nonfinite="raise" with the lazy verdict: raised from the next step's closure (global_step one past the bad
    step), before its update, so the parameters and optimizer state are those from before the bad step."""
    m, snap = fused_model(), Snapshot(poison_step)
    t = trainer(Compressed3DStrategy(data_parallel_size=w, compression=False, on_nonfinite="raise"), steps,
                [snap, Poison([poison_step])])
    case = expect("lazy raise", f"optimizer step {poison_step} hold NaN or inf (on_nonfinite='raise')",
                  lambda: t.fit(m, datamodule=TestData(8)))
    snap.after = Snapshot.state(t, m)
    return {"case": case, "global_step": t.global_step, "unchanged": all_true(snap.unchanged())}


def lazy_last_step(w: int, workdir: Path) -> dict:
    """A bad last step still warns ("skip") or raises ("raise") at fit's end, and a pending verdict is acted on
    before a checkpoint is written ("raise": none written after the bad step)."""
    steps = 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(Compressed3DStrategy(data_parallel_size=w, compression=False), steps, [Poison([steps - 1])]).fit(
            fused_model(), datamodule=TestData(8))
    skip = [str(c.message) for c in caught if "the step is skipped on every rank" in str(c.message)]
    raise_case = expect("lazy raise on the last step", f"optimizer step {steps - 1} hold NaN or inf (on_nonfinite='raise')",
                        lambda: trainer(Compressed3DStrategy(data_parallel_size=w, compression=False, on_nonfinite="raise"),
                                        steps, [Poison([steps - 1])]).fit(fused_model(), datamodule=TestData(8)))
    ckpt_dir = workdir / "lazy_raise_ckpt"
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)  # after steps 1 and 3
    ckpt_case = expect("lazy raise before a checkpoint", "optimizer step 1 hold NaN or inf (on_nonfinite='raise')",
                       lambda: trainer(Compressed3DStrategy(data_parallel_size=w, compression=False, on_nonfinite="raise"),
                                       4, [Poison([1]), saver], enable_checkpointing=True).fit(
                           fused_model(), datamodule=TestData(8)))
    streak = expect("lazy streak", "optimizer step 3 hold NaN or inf, 3 such steps in a row (max_consecutive_nonfinite=2)",
                    lambda: trainer(Compressed3DStrategy(data_parallel_size=w, compression=False, max_consecutive_nonfinite=2),
                                    6, [Poison(range(1, 6), dp_ranks=(1,))]).fit(fused_model(), datamodule=TestData(8)))
    return {"skip_warnings": skip, "raise": raise_case, "checkpoint": ckpt_case,
            "checkpoints_written": sorted(p.name for p in ckpt_dir.glob("*")) if ckpt_dir.exists() else [],
            "streak": streak}


# ----- SC's decision across a resume -----------------------------------------------------------------------------
def link_resume(w: int, workdir: Path, saved_gbps: float, resumed_gbps: float) -> dict:
    def strategy(gbps: float) -> Compressed3DStrategy:
        s = Compressed3DStrategy(data_parallel_size=w, sc_rank=2, sc_warmup=1, sc_max_link_gbps=50.0)
        s.compression_state.link_probe = lambda group, device: gbps
        return s

    full, first, second = LossRecorder(), LossRecorder(), LossRecorder()
    trainer(strategy(saved_gbps), 4, [full]).fit(model(), datamodule=resumable_data(8))
    ckpt_dir = workdir / f"link_{saved_gbps:g}"
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)
    trainer(strategy(saved_gbps), 2, [first, saver], enable_checkpointing=True).fit(model(), datamodule=resumable_data(8))
    path = str(next(ckpt_dir.glob("*.ckpt")))
    resumed = strategy(resumed_gbps)
    trainer(resumed, 4, [second]).fit(model(), datamodule=resumable_data(8), ckpt_path=path)
    return {"straight": full.losses, "resumed": first.losses + second.losses, "link": resumed.data_parallel_link_gbps,
            "sc": resumed.selective_compression is not None,
            "sc_iter": resumed.selective_compression.state.iter if resumed.selective_compression else None}


# ----- CB's decision by the pipeline link (strategies/cb_link.py) ---------------------------------------------------
def cb_link_resume(w: int, workdir: Path, saved_gbps: float, resumed_gbps: float) -> dict:
    """pp = w with compressed_backprop="auto" (cb_rank 2, every send): saved after 2 steps on one link, resumed on the
    other; the resumed run keeps the recorded decision and trains as the straight run."""
    def strategy(gbps: float) -> Compressed3DStrategy:
        s = Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w, cb_rank=2, cb_epilogue_only=False,
                                 cb_min_compression_ratio=0.0)
        s.compression_state.pipeline_link_probe = lambda group, device: gbps
        return s

    full, first, second = LossRecorder(), LossRecorder(), LossRecorder()
    straight = strategy(saved_gbps)
    trainer(straight, 4, [full]).fit(model(), datamodule=resumable_data(8))
    straight_cb = straight.compressed_backprop is not None  # read now: the next fit releases this run's runtime
    ckpt_dir = workdir / f"cb_link_{saved_gbps:g}"
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)
    trainer(strategy(saved_gbps), 2, [first, saver], enable_checkpointing=True).fit(model(), datamodule=resumable_data(8))
    path = str(next(ckpt_dir.glob("*.ckpt")))
    resumed = strategy(resumed_gbps)
    trainer(resumed, 4, [second]).fit(model(), datamodule=resumable_data(8), ckpt_path=path)
    return {"straight": full.losses, "resumed": first.losses + second.losses, "straight_cb": straight_cb,
            "link": resumed.compression_state.pipeline_link_gbps, "cb": resumed.compressed_backprop is not None}


def cb_link_forced(w: int) -> dict:
    """compressed_backprop=True / False decide whatever the link (the probe is never asked)."""
    out = {}
    for forced, gbps in ((True, 1e6), (False, 1.0)):
        s = Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w, compressed_backprop=forced)
        asked = []
        s.compression_state.pipeline_link_probe = lambda group, device, gbps=gbps: asked.append(gbps) or gbps
        trainer(s, 1).fit(model(), datamodule=TestData(8))
        out[str(forced)] = {"cb": s.compressed_backprop is not None, "probed": len(asked),
                            "link": s.compression_state.pipeline_link_gbps}
    return out


# ----- strict_loading ------------------------------------------------------------------------------------------
def strict_loading(w: int, workdir: Path) -> dict:
    path = workdir / "plain.ckpt"
    t = trainer(Compressed3DStrategy(data_parallel_size=w, compression=False), 1)
    t.fit(model(), datamodule=TestData(8))
    t.save_checkpoint(path)

    def extended(strict: bool):
        m = model()
        m.extra = torch.nn.Parameter(torch.full((3,), 7.0))  # not in the checkpoint
        m.strict_loading = strict
        return m

    strict_case = expect("strict loading", "The checkpoint has no entry model.extra",
                         lambda: trainer(Compressed3DStrategy(data_parallel_size=w, compression=False), 2).fit(
                             extended(True), datamodule=TestData(8), ckpt_path=str(path)))
    loose = extended(False)
    trainer(Compressed3DStrategy(data_parallel_size=w, compression=False), 2).fit(
        loose, datamodule=TestData(8), ckpt_path=str(path))
    return {"strict": strict_case, "loose_loaded": True, "loose_step": loose.trainer.global_step}


def main() -> None:
    args = parse_args()
    w = args.world
    workdir = args.report.parent

    def fit(strategy, module, steps=2, callbacks=()):
        trainer(strategy, steps, list(callbacks)).fit(module, datamodule=TestData(8))

    def predict():
        data = DataLoader([{"input_ids": torch.zeros(16, dtype=torch.long), "labels": torch.zeros(16, dtype=torch.long)}] * 4,
                          batch_size=2)
        trainer(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w), 1).predict(model(), data)

    cases = [
        expect("tied name typo at pp", "last-stage name 'model.head.weigth'",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w), typo_in_tied_names())),
        expect("untied by tensor parallelism", "after parallelize_stage they are different Parameters",
               lambda: fit(Compressed3DStrategy(tensor_parallel_size=w), untied_by_parallelize())),
        expect("predict at pp", f"trainer.predict is not available with pipeline_parallel_size={w}", predict),
        expect("zero optimizer", "does not take ZeroRedundancyOptimizer (torch.distributed.optim",
               lambda: fit(Compressed3DStrategy(pipeline_parallel_size=w, num_microbatches=w, compression=False),
                           zero_optimizer())),
        expect("nonfinite raise", "optimizer step 1 hold NaN or inf (on_nonfinite='raise')",
               lambda: fit(Compressed3DStrategy(data_parallel_size=w, on_nonfinite="raise"), model(), 3, [Poison([1])])),
        expect("nonfinite streak", "optimizer step 3 hold NaN or inf, 3 such steps in a row (max_consecutive_nonfinite=2)",
               lambda: fit(Compressed3DStrategy(data_parallel_size=w, max_consecutive_nonfinite=2), model(), 6,
                           [Poison(range(1, 6), dp_ranks=(1,))])),
    ]
    with warnings.catch_warnings(record=True) as caught:  # 48 x 48 matrices compress only up to rank 11
        warnings.simplefilter("always")
        fit(Compressed3DStrategy(data_parallel_size=w, compressed_stages=[0], sc_rank=1000, sc_warmup=0), model(), 1)
    report = {
        "sc_rank_warnings": [str(c.message) for c in caught if "sc_rank=1000 is too large" in str(c.message)],
        "cases": cases,
        "nonfinite": [nonfinite_run(kind, w) for kind in ("exact", "sc", "cb")],
        "lazy_vs_sync": [lazy_vs_sync(layout) for layout in LAZY_LAYOUTS],
        "lazy_raise": lazy_raise(w),
        "lazy_last_step": lazy_last_step(w, workdir),
        "link_slow_then_fast": link_resume(w, workdir, 1.0, 1e6),
        "link_fast_then_slow": link_resume(w, workdir, 1e6, 1.0),
        "strict_loading": strict_loading(w, workdir),
        "cb_link_slow_then_fast": cb_link_resume(w, workdir, 1.0, 1e6),
        "cb_link_fast_then_slow": cb_link_resume(w, workdir, 1e6, 1.0),
        "cb_link_forced": cb_link_forced(w),
    }
    recorder = LossRecorder()  # the group still works after all of the above
    fit(Compressed3DStrategy(tensor_parallel_size=w), model(), 2, [recorder])
    report["healthy_losses"] = recorder.losses
    report["healthy_finite"] = all(math.isfinite(x) for x in recorder.losses)
    write_report(args.report, report)


if __name__ == "__main__":
    main()
