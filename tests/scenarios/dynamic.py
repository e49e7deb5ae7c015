"""Dynamic micro-batching against single-process training: every replica loads the same global batch of
variable-length samples, plans it with ``DynamicMicroBatcher`` and trains on its own micro-batches (different counts,
shapes and token counts per replica, each step with its own schedule); the reference trains one process on the
whole global batch, padded, with the token mean over its labels.

World 2: (1,2,1) with 1F1B. World 4: (2,2,1) 1F1B, (2,1,2) 1F1B, (1,2,2) interleaved 1F1B. T5 (inputs and targets
of their own lengths, padded per micro-batch with an encoder attention mask): the same layouts, against the
single-process reference of tests/scenarios/t5_layouts.py (the same pairs, padded to the longest). On 2 ranks, an
empty sample raises the planner's error on every rank, and a rank given a different schedule than its pipeline peer
makes every rank raise the strategy's plan-mismatch error before any pipeline send. World 4 also trains the multi-task
data module's planned micro-batchings against single-process training (tests/scenarios/multitask.py's
``planned_fits``: (2,2,1), (1,2,2), (2,1,2) for GPT and T5, (4,1,1) GPT, (1,1,4) T5). One process group per world.
"""

from __future__ import annotations

import math
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_3d import Compressed3DStrategy
from lightning_3d.costs.model import ModelShape
from lightning_3d.dynamic import DynamicMicroBatcher, labels_length
from lightning_3d.pipeline.microbatch import MicroBatches
from lightning_3d.pipeline.p2p import PipelineChannels
from lightning_3d.pipeline.schedules import Action
from lightning_3d.recipes import T5
from lightning_3d.recipes.data.loader import worker_options
from tests.scenarios import t5_layouts
from tests.scenarios.common import MODEL, SEQ, VOCAB, LossRecorder, all_max, compare, make_model, parse_args, trainer, write_report
from tests.scenarios.dynamic_costs import ToyCostModel

STEPS, GLOBAL = 3, 16
SHAPE = ModelShape("gpt", num_layers=MODEL["num_layers"], hidden_size=MODEL["hidden_size"], num_heads=MODEL["num_heads"],
                   ffn_hidden_size=4 * MODEL["hidden_size"], vocab_size=VOCAB)
# Small enough that a replica's samples need several micro-batches of different shapes (see dynamic_costs.py).
BUDGET = 6.0e5


class Ragged(Dataset):
    """Samples of 1 to SEQ tokens (long-tailed: mostly short), some labels ignored."""

    def __init__(self, n: int = STEPS * GLOBAL, seed: int = 5) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.exp(1.6 + 0.8 * torch.randn(n, generator=g)).long().clamp(max=SEQ - 1) + 1
        self.samples = []
        for length in lengths.tolist():
            x = torch.randint(0, VOCAB, (length + 1,), generator=g)
            labels = x[1:].clone()
            labels[torch.rand(length, generator=g) < 0.2] = -100
            self.samples.append({"input_ids": x[:-1], "labels": labels})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


def pad_collate(samples: list[dict], seq_len: int, target_len: int | None = None) -> dict:
    """Right-pad to ``seq_len``: causal attention never looks right, and padded labels are ignored."""
    ids = torch.zeros(len(samples), seq_len, dtype=torch.long)
    labels = torch.full((len(samples), seq_len), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
        labels[row, : len(s["labels"])] = s["labels"]
    return {"input_ids": ids, "labels": labels}


T5_SHAPE = ModelShape("t5", num_layers=4, num_decoder_layers=4, hidden_size=32, num_heads=4, ffn_hidden_size=64,
                      vocab_size=VOCAB)
T5_BUDGET = 8e5


class T5Pairs(Dataset):
    """t5_layouts.Pairs without their padding: each input as long as its attention mask, each target up to its last
    real label (targets are a prefix of labels followed by ignored ones)."""

    def __init__(self) -> None:
        pairs = t5_layouts.Pairs()
        self.samples = []
        for i in range(len(pairs)):
            p = pairs[i]
            n, t = int(p["attention_mask"].sum()), int((p["labels"] != -100).sum())
            self.samples.append({"input_ids": p["input_ids"][:n], "decoder_input_ids": p["decoder_input_ids"][:t],
                                 "labels": p["labels"][:t]})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


def t5_collate(samples: list[dict], seq_len: int, target_len: int | None) -> dict:
    """Inputs right-padded with a zero attention mask, targets right-padded with ignored labels."""
    out = {"input_ids": torch.zeros(len(samples), seq_len, dtype=torch.long),
           "attention_mask": torch.zeros(len(samples), seq_len, dtype=torch.long),
           "decoder_input_ids": torch.zeros(len(samples), target_len, dtype=torch.long),
           "labels": torch.full((len(samples), target_len), -100, dtype=torch.long)}
    for row, s in enumerate(samples):
        n, t = len(s["input_ids"]), len(s["labels"])
        out["input_ids"][row, :n], out["attention_mask"][row, :n] = s["input_ids"], 1
        out["decoder_input_ids"][row, :t], out["labels"][row, :t] = s["decoder_input_ids"], s["labels"]
    return out


class Relabelled:
    """A rank that planned differently (as a rank with another NumPy build might): its schedule swaps micro-batches
    0 and 1, a valid schedule on its own, which its pipeline peer does not run."""

    def __init__(self, batcher: DynamicMicroBatcher) -> None:
        self.batcher = batcher

    def __call__(self, samples: list) -> MicroBatches:
        out = self.batcher(samples)
        assert len(out) > 1, "the tampered step needs two micro-batches to swap"
        swap = {0: 1, 1: 0}
        out.orders = tuple(tuple(Action(a.kind, a.stage, swap.get(a.microbatch, a.microbatch)) for a in order)
                           for order in out.orders)
        return out


class DynamicData(pl.LightningDataModule):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg

    def batcher(self, dp_rank: int) -> DynamicMicroBatcher:
        c = self.cfg
        common = dict(dp=c["dp"], pp=c["pp"], dp_rank=dp_rank, cost_model=ToyCostModel(), schedule=c["schedule"],
                      virtual_stages=c.get("v", 1), tp=c["tp"])
        if c.get("t5"):
            return DynamicMicroBatcher(t5_collate, shape=T5_SHAPE, memory_budget=c.get("budget", T5_BUDGET), round_to=4,
                                       max_seq_len=t5_layouts.ENC, max_target_len=t5_layouts.DEC,
                                       target_length=labels_length, **common)
        return DynamicMicroBatcher(pad_collate, shape=SHAPE, memory_budget=BUDGET, max_seq_len=SEQ, **common)

    def dataset(self) -> Dataset:
        return T5Pairs() if self.cfg.get("t5") else Ragged()

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.strategy.distributed_sampler_kwargs["rank"]
        data = self.dataset()
        if self.cfg.get("empty_sample"):  # bad input: sample 3 of the first global batch has no tokens
            data.samples[3] = {"input_ids": data.samples[3]["input_ids"][:0], "labels": data.samples[3]["labels"][:0]}
        collate = self.batcher(rank)
        if self.cfg.get("tamper") and torch.distributed.get_rank() == 1:
            collate = Relabelled(collate)
        # Planning in a worker process, two batches ahead, as in training; started as the library's loaders start
        # theirs (a fork of this threaded process can hang in the child: see recipes/data/loader.worker_options).
        return DataLoader(data, batch_size=GLOBAL, shuffle=False, collate_fn=collate, num_workers=1, prefetch_factor=2,
                          **worker_options(1))


def reference(steps: int) -> tuple:
    """Single-process training on the padded global batches (same weights, optimizer and schedule as common.py)."""
    module = make_model()
    module.configure_model()
    model = module.model
    hp = module.hparams
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wpe" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "wpe" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay}, {"params": other, "weight_decay": 0.0}],
                            lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.adam_eps)
    floor = hp.min_learning_rate / hp.learning_rate

    def schedule(step: int) -> float:
        if step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.decay_steps - hp.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    data, losses = Ragged(), []
    for step in range(steps):
        batch = pad_collate([data[i] for i in range(step * GLOBAL, (step + 1) * GLOBAL)], SEQ)
        opt.zero_grad()
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def layouts(world: int) -> list[dict]:
    if world == 2:
        return [dict(dp=1, pp=2, tp=1, schedule="1f1b"), dict(dp=1, pp=2, tp=1, schedule="1f1b", t5=True)]
    return [dict(dp=2, pp=2, tp=1, schedule="1f1b"), dict(dp=2, pp=1, tp=2, schedule="1f1b"),
            dict(dp=1, pp=2, tp=2, schedule="interleaved_1f1b", v=2), dict(dp=2, pp=2, tp=1, schedule="1f1b", t5=True),
            dict(dp=2, pp=1, tp=2, schedule="1f1b", t5=True, budget=4e5),  # a smaller budget: several micro-batches at pp = 1
            dict(dp=1, pp=2, tp=2, schedule="1f1b", t5=True)]


def step_facts(cfg: dict) -> dict:
    """What the plans of the run's steps look like on every replica: micro-batch counts, shapes and tokens."""
    module = DynamicData(cfg)
    data, batcher = module.dataset(), module.batcher(0)
    counts, tokens, shapes = [], [], set()
    for step in range(STEPS):
        plan = batcher.plan([data[i] for i in range(step * GLOBAL, (step + 1) * GLOBAL)])
        counts.append([len(r.microbatches) for r in plan.replicas])
        tokens.append([sum(len(data[step * GLOBAL + i]["input_ids"]) for mb in r.microbatches for i in mb.samples)
                       for r in plan.replicas])
        shapes |= {(len(mb.samples), mb.seq_len, mb.target_len) for r in plan.replicas for mb in r.microbatches}
    return {"counts": counts, "tokens": tokens, "shapes": len(shapes)}


def run(cfg: dict, ref: tuple | None) -> dict:
    strategy = Compressed3DStrategy(
        data_parallel_size=cfg["dp"], pipeline_parallel_size=cfg["pp"], tensor_parallel_size=cfg["tp"],
        num_microbatches=cfg["pp"], schedule=cfg["schedule"], virtual_stages=cfg.get("v"), compression=False,
    )
    recorder = LossRecorder()
    model = T5("tiny", **t5_layouts.MODEL) if cfg.get("t5") else make_model()
    start = time.perf_counter()
    trainer(strategy, STEPS, [recorder]).fit(model, datamodule=DynamicData(cfg))
    if cfg.get("t5"):
        result = t5_layouts.compare(model, recorder.losses, t5_layouts.reference(GLOBAL))
    else:
        result = compare(model, recorder.losses, ref)
    ran = strategy.pipeline_runtime.last_orders
    return {**cfg, **step_facts(cfg), "loss_err": all_max(result["loss_err"]), "param_err": all_max(result["param_err"]),
            "last_orders_microbatches": 1 + max(a.microbatch for o in ran for a in o),
            "seconds": round(time.perf_counter() - start, 2)}


def bad_input() -> dict:
    """An empty sample: every rank plans the same batch, so every rank raises the planner's message from its data
    loader, before the step's first collective (none waits for another until a timeout)."""
    strategy = Compressed3DStrategy(pipeline_parallel_size=2, num_microbatches=2, compression=False)
    try:
        trainer(strategy, 1).fit(make_model(), datamodule=DynamicData(dict(dp=1, pp=2, tp=1, schedule="1f1b",
                                                                           empty_sample=True)))
    except ValueError as e:
        return {"raised": "Sample 3 of the batch has input length 0" in str(e)}
    return {"raised": False}


def mismatch() -> dict:
    """Rank 1's schedule differs from rank 0's (same pipeline): the strategy's plan check makes both raise its
    message at the first step, before any pipeline send (counted on the transport's batches and shape headers)."""
    sends = [0]
    originals = PipelineChannels.exchange, PipelineChannels.send_header

    def counted(send):
        def wrapper(self, *args, **kwargs):
            sends[0] += 1
            return send(self, *args, **kwargs)
        return wrapper

    PipelineChannels.exchange, PipelineChannels.send_header = counted(originals[0]), counted(originals[1])
    strategy = Compressed3DStrategy(pipeline_parallel_size=2, num_microbatches=2, compression=False)
    try:
        trainer(strategy, 1).fit(make_model(), datamodule=DynamicData(dict(dp=1, pp=2, tp=1, schedule="1f1b",
                                                                           tamper=True)))
    except RuntimeError as e:
        return {"raised": "hold different plans for this step" in str(e) and "run the same software" in str(e),
                "sends": sends[0]}
    finally:
        PipelineChannels.exchange, PipelineChannels.send_header = originals
    return {"raised": False, "sends": sends[0]}


def main() -> None:
    args = parse_args()
    ref = reference(STEPS)
    results = []
    for cfg in layouts(args.world):
        results.append(run(cfg, ref))
        write_report(args.report, {"results": results})
    if args.world == 4:  # in this process group rather than a new one (the suite's processes are few on purpose)
        from tests.scenarios import multitask

        cache = args.report.with_suffix(".cache")
        planned = multitask.planned_fits(4, cache, multitask.reference(cache))
        write_report(args.report, {"results": results, "multitask": planned})
    if args.world == 2:
        flag = torch.tensor(float(bad_input()["raised"]))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        mismatched = mismatch()
        caught = torch.tensor([float(mismatched["raised"]), -float(mismatched["sends"])])
        torch.distributed.all_reduce(caught, op=torch.distributed.ReduceOp.MIN)
        write_report(args.report, {"results": results, "empty_sample_raised_on_every_rank": bool(flag.item()),
                                   "plan_mismatch_raised_on_every_rank": bool(caught[0].item()),
                                   "sends_before_mismatch_error": int(-caught[1].item())})


if __name__ == "__main__":
    main()
