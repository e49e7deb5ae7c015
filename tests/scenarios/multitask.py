"""Packed multi-task batches train like unpacked ones through the pipeline and tensor parallelism (2 ranks).

One process group runs short fits on the FLAN test file (bytes tokenizer, 2 steps each): GPT at pp=2 and at tp=2
with packing (the attention mask passes the pipeline and the tensor-parallel plan), compared with plain single-process
training (no Lightning, no strategy) on the same global batches, unpacked and padded; with ``--extra t5`` also T5 at
pp=2 with packing against T5 at pp=2 with padding. Step losses and final parameters (gathered in full on every rank)
are compared.

Planned micro-batching against the same single-process references (GPT, and T5 trained alone, padded): GPT at
(1,2,1) with ``microbatching="auto"`` and at (2,1,1) with ``"packed_dynamic"``, T5 at (1,2,1) with
``"packed_dynamic"`` and at (2,1,1) with ``"auto"`` over candidates that mix packed and padded ones; each replica
plans the whole global batch and keeps its share. The two pipelined ones (1,2,1) run the adaptive schedule
(``adaptive_schedule="only"``, lightning_3d/dynamic/adaptive.py) wherever a planner's candidate runs, so its
per-step orders train exactly like one process too; each run reports the schedule of every step. The 4-process
layouts, (2,2,1) with compressed backpropagation (at full rank) and the sharded optimizer state on, and (1,2,2), (2,1,2),
(4,1,1), (1,1,4), run in tests/scenarios/dynamic.py (its world-4 process group) through :func:`planned_fits`; at 2
processes also (1,1,2).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes import GPT, T5
from lightning_3d.recipes.data.multitask import MultiTaskDataModule
from tests.scenarios.common import CLIP, LossRecorder, parse_args, trainer, write_report

FLAN = Path(__file__).resolve().parent.parent / "data" / "multitask" / "flan_tiny.jsonl"
STEPS = 2
SEQ = 384
OPTIM = dict(warmup_steps=1, learning_rate=2e-3, min_learning_rate=2e-4, decay_steps=4, adam_eps=1e-6,
             optimizer_foreach=True)


# Activation memory per device for the planned runs: small enough that the analytic cost model cuts each replica's
# share into several micro-batches (GPT: one to four rows of up to 384 tokens each).
BUDGET_GB = 0.006
# T5's auto run chooses among packed and padded candidates (its default ones tie on these tiny shapes).
T5_AUTO = ["packing@2", "packed_dynamic", "token_budget@832", "dynamic"]


def data(model_type: str, microbatching: str, cache: Path, **kw) -> MultiTaskDataModule:
    # Rows of 384 bytes hold up to three of the file's samples (inputs <= ~550 bytes are cut, targets to 32).
    return MultiTaskDataModule(model_type=model_type, data_files=str(FLAN), tokenizer="bytes", seq_length=SEQ,
                               target_length=32, global_batch_size=8, microbatching=microbatching, micro_batch_size=2,
                               val_fraction=0.0, cache_dir=str(cache), shuffle=True, **kw)


def model(model_type: str, dm: MultiTaskDataModule):
    if model_type == "gpt":
        return GPT("tiny", vocab_size=dm.vocab_size, seq_length=SEQ, num_layers=2, hidden_size=32, num_heads=4, **OPTIM)
    return T5("tiny", vocab_size=dm.vocab_size, pad_token_id=dm.pad_token_id, eos_token_id=dm.eos_token_id,
              num_layers=1, num_decoder_layers=1, hidden_size=32, num_heads=4, head_dim=8, ffn_hidden_size=64,
              relative_attention_num_buckets=8, relative_attention_max_distance=16, **OPTIM)


def reference(cache: Path, model_type: str = "gpt") -> tuple[list[float], dict]:
    """Plain single-process GPT (or T5) training on the same global batches, padded (one replica), with the recipe's
    own optimizer, schedule and the scenarios' gradient clipping."""
    dm = data(model_type, "padding", cache)
    module = model(model_type, dm)
    module.configure_model()
    optim = module.configure_optimizers()
    opt, sched = optim["optimizer"], optim["lr_scheduler"]["scheduler"]
    losses = []
    for _, mbs in zip(range(STEPS), dm.train_dataloader()):
        opt.zero_grad()
        terms = sum(module.pipeline_loss_terms(mb) for mb in mbs)
        loss = sum(module.pipeline_loss(forward(module, mb), mb) for mb in mbs) / terms
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def forward(module, mb: dict) -> torch.Tensor:
    if isinstance(module, GPT):
        return module(mb["input_ids"])
    return module(mb["input_ids"], mb["decoder_input_ids"], mb["attention_mask"], mb["labels"])


def full_parameters(module) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model in full, on every rank (tiny models: an all_gather_object suffices)."""
    mine = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in module.named_parameters()}
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    return {n: t for part in gathered for n, t in part.items()}


# CB at full rank (rank >= the tiny models' hidden size 32) on every send, SC held in its warm-up: compression's code
# path with a reconstruction exact up to rounding, so the fit must still equal one process (tests/tolerance.py).
EXACT_CB = dict(enabled=True, compressed_backprop=True, cb_rank=64, cb_epilogue_only=False, cb_min_compression_ratio=0.0,
                sc_warmup=100)


def fit(model_type: str, microbatching: str, pp: int, tp: int, cache: Path, compression: dict | None = None,
        shard_optimizer_state: bool = False, **kw) -> tuple[list[float], dict]:
    dm = data(model_type, microbatching, cache, **kw)
    # num_microbatches only passes the configuration check: MicroBatches batches bring their own count.
    strategy = Compressed3DStrategy(parallelism={"pipeline_parallel_size": pp, "tensor_parallel_size": tp},
                                    pipeline={"num_microbatches": 2}, compression=compression or {"enabled": False},
                                    runtime={"shard_optimizer_state": shard_optimizer_state})
    recorder, module, facts = LossRecorder(), model(model_type, dm), StrategyFacts()
    trainer(strategy, STEPS, [recorder, facts]).fit(module, datamodule=dm)
    waits = dm.plan_waits
    return (recorder.losses, full_parameters(module), waits.choices if waits is not None else [], facts.facts,
            waits.schedules if waits is not None else [])


class StrategyFacts(pl.Callback):
    """What the strategy did, read before its teardown: compressed sends (the most of any rank) and whether the
    optimizer stepped sharded."""

    def on_train_end(self, trainer, module) -> None:
        strategy = trainer.strategy
        cb = strategy.compressed_backprop
        sends = torch.tensor(float(sum(cb.compressed_sends.values())) if cb is not None else 0.0)
        dist.all_reduce(sends, op=dist.ReduceOp.MAX)
        self.facts = {"cb_sends": int(sends.item()), "sharded": strategy.engine.sharded is not None}


def compare(run: tuple, ref: tuple) -> dict:
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(run[0], ref[0], strict=True))
    # Vocabulary-padded rows (more of them at tp=2) are zero in both runs: compare the rows both have. A tied head
    # is its own parameter only where pipeline stages split it from the embedding: compare the names both runs have.
    shared = [n for n in ref[1] if n in run[1]]
    assert len(shared) >= len(ref[1]) - 1, (sorted(ref[1]), sorted(run[1]))
    param_err = max(((run[1][n][: len(ref[1][n])] - ref[1][n][: len(run[1][n])]).norm()
                     / ref[1][n].norm().clamp_min(1e-12)).item() for n in shared)
    out = {"loss_err": loss_err, "param_err": param_err, "losses": run[0], "ref_losses": ref[0]}
    if len(run) > 2 and any(run[2]):
        out["choices"] = run[2]  # the candidate each step ran (auto and packed_dynamic)
    if len(run) > 3:
        out["strategy"] = run[3]  # compressed sends, sharded optimizer
    if len(run) > 4 and any(run[4]):
        out["schedules"] = run[4]  # per step, every replica's pipeline schedule (planned steps)
    return out


def planned_fits(world: int, cache: Path, gpt_ref: tuple) -> dict:
    """Planned micro-batching against single-process training at every 2-process layout, (1,2,1), (2,1,1) and
    (1,1,2), and at the 4-process ones but pp = 4 (the tiny references have two blocks): (2,2,1), (1,2,2), (2,1,2)
    for GPT and T5, (4,1,1) for GPT, (1,1,4) for T5 (module docstring). Names: model, dp pp tp, micro-batching."""
    t5_ref = reference(cache, "t5")
    budget = dict(memory_budget_gb=BUDGET_GB)
    t5_auto = dict(auto_candidates=T5_AUTO, **budget)
    adaptive = dict(adaptive_schedule="only")  # at pp = 2 (module docstring)
    if world == 2:
        return {"gpt_121_auto": compare(fit("gpt", "auto", 2, 1, cache, **adaptive, **budget), gpt_ref),
                "gpt_211_packed_dynamic": compare(fit("gpt", "packed_dynamic", 1, 1, cache, **budget), gpt_ref),
                "gpt_112_packed_dynamic": compare(fit("gpt", "packed_dynamic", 1, 2, cache, **budget), gpt_ref),
                "t5_121_packed_dynamic": compare(fit("t5", "packed_dynamic", 2, 1, cache, **adaptive, **budget),
                                                 t5_ref),
                "t5_211_auto": compare(fit("t5", "auto", 1, 1, cache, **t5_auto), t5_ref),
                "t5_112_auto": compare(fit("t5", "auto", 1, 2, cache, **t5_auto), t5_ref)}
    # With compression (CB) and the sharded optimizer state on at the same time (2 replicas, 2 stages).
    both = dict(compression=EXACT_CB, shard_optimizer_state=True)
    return {"gpt_221_packed_dynamic": compare(fit("gpt", "packed_dynamic", 2, 1, cache, **both, **budget), gpt_ref),
            "t5_221_auto": compare(fit("t5", "auto", 2, 1, cache, **both, **t5_auto), t5_ref),
            "gpt_122_packed_dynamic": compare(fit("gpt", "packed_dynamic", 2, 2, cache, **adaptive, **budget), gpt_ref),
            "t5_122_auto": compare(fit("t5", "auto", 2, 2, cache, **adaptive, **t5_auto), t5_ref),
            "gpt_212_auto": compare(fit("gpt", "auto", 1, 2, cache, **budget), gpt_ref),
            "t5_212_packed_dynamic": compare(fit("t5", "packed_dynamic", 1, 2, cache, **budget), t5_ref),
            "gpt_411_packed_dynamic": compare(fit("gpt", "packed_dynamic", 1, 1, cache, **budget), gpt_ref),
            "t5_114_packed_dynamic": compare(fit("t5", "packed_dynamic", 1, 4, cache, **budget), t5_ref)}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    cache = args.report.with_suffix(".cache")
    # The packed rows of the steps the fits run (one replica): fewer rows than samples means documents share rows.
    steps = [mbs for _, mbs in zip(range(STEPS), data("gpt", "packing", cache).train_dataloader())]
    results: dict = {"packing": {"rows": sum(len(mb["input_ids"]) for mbs in steps for mb in mbs), "samples": STEPS * 8}}
    gpt_ref = reference(cache)
    results["gpt_pp2_packing"] = compare(fit("gpt", "packing", 2, 1, cache), gpt_ref)
    results["gpt_tp2_packing"] = compare(fit("gpt", "packing", 1, 2, cache), gpt_ref)
    results.update(planned_fits(2, cache, gpt_ref))
    if args.extra == "t5":  # T5's packed masks under the pipeline (its unit test covers logits and gradients)
        t5_ref = fit("t5", "padding", 2, 1, cache)
        results["t5_pp2_packing"] = compare(fit("t5", "packing", 2, 1, cache), t5_ref)
    write_report(args.report, results)


if __name__ == "__main__":
    main()
