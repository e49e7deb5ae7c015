"""The one-GPU measurements of dynamic micro-batching, in one process on one GPU (pp = dp = 1), GPT recipe
trained as the recipes train it (fp32 weights, bf16 autocast, AdamW):

1. ``profile``: the cost model. ``--profile measure`` runs ``lightning-3d profile``'s measurement
   (``lightning_3d.planner.profile_model``, the planner's own file format) over a grid of micro-batch sizes
   and lengths that covers what the planner asks for, and writes it to ``$OUT/profile_<preset>.json``;
   ``--profile PATH`` reads one; ``--profile none`` plans with the analytic model.
2. ``accuracy``: over ``--batches`` random global batches of a long-tailed length mix (``--tokens`` each), the plan's
   predicted forward + backward time of every micro-batch against its measured time (CUDA events), and the plan's
   predicted peak activation memory against ``max_memory_allocated`` above the weights, gradients and optimizer
   state, with the memory budget at ``--memory-fraction`` (0.9) of the card. Reports time MAPE (micro-batch and
   step), the worst memory error and the number of out-of-memory steps.
3. ``throughput``: useful (non-padding) tokens/s of training steps on ``--throughput-batches`` of those batches with
   ``dynamic``, ``padding`` (``--padding-size`` samples per micro-batch) and ``token_budget`` (``--token-budget``
   padded tokens). Packing needs the data module's document masks: ``benchmarks/dynamic/multitask_microbatching.py``.
4. ``waits``: ``--wait-steps`` training steps of ``--wait-tokens`` each, planned by a ``DynamicMicroBatcher`` in
   ``--workers`` DataLoader workers (prefetch 2) and handed over two steps ahead by ``background``; ``PlanWaits``
   counts the steps that were asked for before their plan was done (goal 0), the plans' lead and the fetch time.

Prints one compact JSON line per part and writes everything to ``$OUT/dynamic_gpu.json`` (or ``--out``).
``--preset tiny --device cpu`` is the CPU smoke test (times of the CPU, no memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from lightning_3d.costs import ProfiledCostModel, model_shape  # noqa: E402
from lightning_3d.dynamic import DynamicMicroBatcher, PlanWaits, background, plan_step  # noqa: E402
from lightning_3d.dynamic.plan import default_cost_model  # noqa: E402
from lightning_3d.dynamic.stage_costs import evaluate, stage_layers  # noqa: E402
from lightning_3d.recipes import GPT  # noqa: E402
from lightning_3d.recipes.data.loader import worker_options  # noqa: E402


def lengths_mix(rng: np.random.Generator, tokens: int, cap: int) -> np.ndarray:
    """A multi-task-like mix: short answers, medium passages and a long tail (log-normal components)."""
    out = []
    while sum(out) < tokens:
        median, sigma = [(24, 0.6), (180, 0.7), (900, 0.8)][rng.choice(3, p=[0.5, 0.4, 0.1])]
        out.append(int(min(cap, max(2, rng.lognormal(np.log(median), sigma)))))
    return np.array(out)


def microbatch(lengths: list[int], seq_len: int, vocab: int, g: torch.Generator) -> tuple:
    ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    labels = torch.full((len(lengths), seq_len), -100, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, vocab, (n,), generator=g)
        labels[row, : n - 1] = ids[row, 1:n]
    return ids, labels


class LengthSamples(torch.utils.data.Dataset):
    """Samples of given lengths with random tokens (what the DataLoader workers batch and plan)."""

    def __init__(self, lengths: np.ndarray, vocab: int) -> None:
        self.lengths, self.vocab = lengths, vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (int(self.lengths[i]),), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids}


def collate(samples: list[dict], seq_len: int, target_len: int | None = None) -> tuple:
    ids = torch.zeros(len(samples), seq_len, dtype=torch.long)
    labels = torch.full((len(samples), seq_len), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n] = s["input_ids"]
        labels[row, : n - 1] = s["input_ids"][1:]
    return ids, labels


class Trainer:
    """The model, its optimizer and one training step as the recipes run it (bf16 autocast on CUDA)."""

    def __init__(self, model: torch.nn.Module, device: str) -> None:
        self.model, self.device, self.cuda = model, device, device == "cuda"
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=self.cuda)

    def step(self, mbs: list[tuple], timed: bool = False) -> tuple[list[float], int]:
        """Forward + backward of every micro-batch (loss = token mean over the step), then the optimizer step.
        Returns the micro-batches' times (``timed``) and the allocated peak of forward/backward (CUDA)."""
        terms = sum(int((labels != -100).sum()) for _, labels in mbs)
        times = []
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        for ids, labels in mbs:
            ids, labels = ids.to(self.device), labels.to(self.device)
            if timed:
                if self.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                else:
                    t0 = time.perf_counter()
            with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.cuda):
                logits = self.model(ids)
                loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                       reduction="sum")
            (loss / terms).backward()
            if timed:
                if self.cuda:
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / 1000)
                else:
                    times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if self.cuda else 0
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # gradients stay allocated: part of the baseline, as in training
        return times, peak

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def padding_plan(lengths: np.ndarray, size: int, round_to: int = 8) -> list[tuple[list[int], int]]:
    out = []
    for i in range(0, len(lengths), size):
        chunk = list(range(i, min(i + size, len(lengths))))
        out.append((chunk, int(-(-lengths[chunk].max() // round_to) * round_to)))
    return out


def token_budget_plan(lengths: np.ndarray, budget: int, round_to: int = 8) -> list[tuple[list[int], int]]:
    out, current = [], []
    for i in np.argsort(-lengths, kind="stable"):
        longest = -(-max(lengths[current + [i]]) // round_to) * round_to
        if current and longest * (len(current) + 1) > budget:
            out.append((current, int(-(-lengths[current].max() // round_to) * round_to)))
            current = []
        current.append(int(i))
    out.append((current, int(-(-lengths[current].max() // round_to) * round_to)))
    return out


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def get_profile(args, shape, vocab: int):
    """The cost model (and the profile's measuring seconds)."""
    if args.profile == "none":
        return default_cost_model(shape), None
    if args.profile != "measure":
        return ProfiledCostModel(args.profile), None
    from lightning_3d.planner import profile_model

    config = {"model": {"class_path": "lightning_3d.recipes.GPT",
                        "init_args": {"preset_name": args.preset, "vocab_size": vocab, "seq_length": args.max_seq_len}},
              "trainer": {"precision": "bf16-mixed" if args.device == "cuda" else "32-true"}}
    start = time.perf_counter()
    doc = profile_model(config, device=args.device, microbatch_sizes=ints(args.profile_sizes),
                        seq_lens=[s for s in ints(args.profile_lens) if s <= args.max_seq_len], recompute=(False,),
                        warmup=1, repeats=args.profile_repeats, collectives=False, log=lambda *_: None)
    seconds = time.perf_counter() - start
    path = args.out.parent / f"profile_{args.preset}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, allow_nan=False))
    return ProfiledCostModel(path), seconds


def accuracy(trainer: Trainer, args, shape, cost_model, budget: float, batches: list, vocab: int) -> tuple[dict, list, list]:
    stages = stage_layers(shape, 1)
    g = torch.Generator().manual_seed(0)
    rows, plans, oom = [], [], 0
    for lengths in batches:
        start = time.process_time()
        plan = plan_step(lengths, cost_model=cost_model, shape=shape, dp=1, pp=1, memory_budget=budget,
                         max_seq_len=args.max_seq_len)
        plan_ms = 1000 * (time.process_time() - start)
        mbs_plan = [([int(i) for i in mb.samples], mb.seq_len) for mb in plan.replicas[0].microbatches]
        plans.append(mbs_plan)
        mbs = [microbatch([int(lengths[i]) for i in s], seq, vocab, g) for s, seq in mbs_plan]
        c = evaluate(cost_model, stages, np.array([len(s) for s, _ in mbs_plan]), np.array([q for _, q in mbs_plan]),
                     None, recompute=False, tp=1)
        predicted = (c.forward + c.backward).sum(axis=0)
        try:
            trainer.step(mbs)  # warms every shape
            trainer.sync()
            measured, peak = trainer.step(mbs, timed=True)
        except torch.OutOfMemoryError:
            oom += 1
            torch.cuda.empty_cache()
            continue
        rows.append({"plan_ms": plan_ms, "microbatches": len(mbs), "predicted_s": float(predicted.sum()),
                     "measured_s": sum(measured), "mb_ape": [abs(p - m) / m for p, m in zip(predicted.tolist(), measured)],
                     "predicted_peak": plan.peak_memory, "measured_peak": peak - trainer.baseline})
    out = {"batches": len(batches), "measured": len(rows), "oom": oom, "budget_gb": budget / 2**30,
           "microbatches_mean": float(np.mean([r["microbatches"] for r in rows])) if rows else None,
           "plan_ms_median": float(np.median([r["plan_ms"] for r in rows])) if rows else None}
    if rows:
        out["step_time_mape"] = float(np.mean([abs(r["predicted_s"] - r["measured_s"]) / r["measured_s"] for r in rows]))
        out["microbatch_time_mape"] = float(np.mean([x for r in rows for x in r["mb_ape"]]))
        out["microbatch_time_ape_max"] = float(max(x for r in rows for x in r["mb_ape"]))
        if trainer.cuda:
            errors = [(r["predicted_peak"] - r["measured_peak"]) / r["measured_peak"] for r in rows]
            out["peak_memory_rel_err_worst"] = float(max(errors, key=abs))
            out["peak_memory_rel_err_mean_abs"] = float(np.mean(np.abs(errors)))
            out["peak_memory_measured_gb_max"] = max(r["measured_peak"] for r in rows) / 2**30
    return out, rows, plans


def throughput(trainer: Trainer, args, batches: list, plans: list, vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    methods = {"dynamic": plans, "padding": [padding_plan(b, args.padding_size) for b in batches],
               "token_budget": [token_budget_plan(b, args.token_budget) for b in batches]}
    out = {}
    for name, method_plans in methods.items():
        useful, computed, seconds, failed = 0, 0, 0.0, None
        for k, (lengths, mbs_plan) in enumerate(zip(batches, method_plans)):
            mbs = [microbatch([int(lengths[i]) for i in s], seq, vocab, g) for s, seq in mbs_plan]
            trainer.sync()
            start = time.perf_counter()
            try:
                trainer.step(mbs)
                trainer.sync()
            except torch.OutOfMemoryError as e:
                failed = f"out of memory: {str(e)[:120]}"
                torch.cuda.empty_cache()
                break
            if k > 0:  # the first batch warms the method's shapes
                seconds += time.perf_counter() - start
                useful += int(lengths.sum())
                computed += sum(len(s) * q for s, q in mbs_plan)
        out[name] = {"useful_tokens_per_s": round(useful / seconds) if seconds else None,
                     "padding_fraction": round(1 - useful / computed, 3) if computed else None, "error": failed}
    base = (out["padding"] or {}).get("useful_tokens_per_s")
    for row in out.values():
        row["vs_padding"] = round(row["useful_tokens_per_s"] / base, 2) if base and row["useful_tokens_per_s"] else None
    return out


def waits(trainer: Trainer, args, shape, cost_model, budget: float, vocab: int) -> dict:
    """Train ``--wait-steps`` steps fed by DataLoader workers that plan every batch; ``PlanWaits`` records them."""
    rng = np.random.default_rng(1)
    lengths, per_batch = [], []
    for _ in range(args.wait_steps + 2):
        batch = lengths_mix(rng, args.wait_tokens, args.max_seq_len)
        lengths += batch.tolist()
        per_batch.append(len(batch))
    size = int(np.mean(per_batch))  # fixed-size global batches: the mix's mean sample count
    batcher = DynamicMicroBatcher(collate, shape=shape, dp=1, pp=1, dp_rank=0, memory_budget=budget,
                                  cost_model=cost_model, max_seq_len=args.max_seq_len)
    loader = torch.utils.data.DataLoader(LengthSamples(np.array(lengths), vocab), batch_size=size, collate_fn=batcher,
                                         num_workers=args.workers, prefetch_factor=2, drop_last=True,
                                         **worker_options(args.workers))
    record = PlanWaits()
    steps = record.wrap(background(loader, ahead=2))
    start = None
    with contextlib.closing(steps):
        for step, mbs in enumerate(steps):
            start = start or time.perf_counter()  # from the first step's arrival: worker start-up excluded
            trainer.step(list(mbs))
            trainer.sync()
            if step + 1 == args.wait_steps:
                break
    out = record.summary()
    seconds = time.perf_counter() - start if start else 0.0
    out["step_ms_mean"] = round(1000 * seconds / max(1, out["steps"]), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--parts", nargs="+", default=["accuracy", "throughput", "waits"],
                   choices=["accuracy", "throughput", "waits"])
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32000, help="as the multi-task benchmark's tokenizer (same profile)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per global batch (accuracy, throughput)")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--profile", default="measure", help="'measure', 'none' (analytic) or a profile file")
    p.add_argument("--profile-sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--profile-lens", default="16,32,64,128,256,512,1024,1536,2048")
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument("--throughput-batches", type=int, default=6)
    p.add_argument("--padding-size", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--wait-steps", type=int, default=200)
    p.add_argument("--wait-tokens", type=int, default=8192)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "dynamic_gpu.json")
    args = p.parse_args()
    cuda = args.device == "cuda"
    torch.manual_seed(0)
    started = time.perf_counter()
    module = GPT(args.preset, vocab_size=args.vocab_size, seq_length=args.max_seq_len)
    module.configure_model()
    cfg = module.config
    vocab = cfg.vocab_size
    model = module.model.to(args.device).train()  # fp32 weights; bf16 autocast in the step (bf16-mixed)
    trainer = Trainer(model, args.device)
    shape = model_shape(cfg, bytes_per_element=2 if cuda else 4)
    report: dict = {"preset": args.preset, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    cost_model, profile_s = get_profile(args, shape, vocab)
    report["cost_model"] = cost_model.source
    report["profile_s"] = round(profile_s, 1) if profile_s is not None else None
    print(json.dumps({"part": "profile", "cost_model": cost_model.source, "seconds": report["profile_s"]}), flush=True)
    trainer.step([microbatch([16], 16, vocab, torch.Generator().manual_seed(0))])  # allocates grads + AdamW state
    trainer.sync()
    if cuda:
        trainer.baseline = torch.cuda.memory_allocated()
        budget = args.memory_fraction * torch.cuda.get_device_properties(0).total_memory - trainer.baseline
    else:
        trainer.baseline, budget = 0, 64e9
    report["baseline_gb"] = trainer.baseline / 2**30
    rng = np.random.default_rng(0)
    batches = [lengths_mix(rng, args.tokens, args.max_seq_len) for _ in range(args.batches)]
    plans: list = []

    def save() -> None:  # after every part: a part cut short by a time limit keeps the earlier ones
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    if "accuracy" in args.parts or "throughput" in args.parts:
        report["accuracy"], report["accuracy_rows"], plans = accuracy(trainer, args, shape, cost_model, budget,
                                                                      batches, vocab)
        print(json.dumps({"part": "accuracy", **report["accuracy"]}), flush=True)
        save()
    if "throughput" in args.parts and args.throughput_batches > 1:
        n = args.throughput_batches
        report["throughput"] = throughput(trainer, args, batches[:n], plans[:n], vocab)
        print(json.dumps({"part": "throughput", **report["throughput"]}), flush=True)
        save()
    if "waits" in args.parts and args.wait_steps > 0:
        report["waits"] = waits(trainer, args, shape, cost_model, budget, vocab)
        print(json.dumps({"part": "waits", **report["waits"]}), flush=True)
    report["seconds"] = round(time.perf_counter() - started, 1)
    save()
    print(json.dumps({"part": "done", "seconds": report["seconds"], "out": str(args.out)}), flush=True)


if __name__ == "__main__":
    main()
