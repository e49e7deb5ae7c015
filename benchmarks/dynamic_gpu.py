"""Issue 21's one-GPU measurements of dynamic micro-batching, in one process on one GPU (pp = dp = 1):

1. Cost-model accuracy over ``--batches`` random global batches of a long-tailed length mix: the plan's predicted
   time of every micro-batch (forward + backward) against its CUDA-event time, and the plan's predicted peak
   activation memory against ``max_memory_allocated`` above the weights/gradients/optimizer baseline. Reports the
   MAPE of micro-batch and step times, the worst memory error, and whether anything ran out of memory with the
   budget at ``--memory-fraction`` (0.9) of the card.
2. Useful (non-padding) tokens per second of training steps (forward, backward, AdamW) on the same batches with
   ``dynamic`` micro-batching, ``padding`` (``--padding-size`` samples per micro-batch, each padded to its longest)
   and ``token_budget`` (samples sorted by length, greedy micro-batches of at most ``--token-budget`` padded tokens).
   ``packing`` needs document-masked attention in the model (the multi-task data module's); it is not run here.

3. Steps waiting for a plan: ``--wait-steps`` (200) training steps whose batches a ``DynamicMicroBatcher`` plans in
   DataLoader workers (``--workers`` 2, prefetch 2); a step waits when fetching its batch takes over 1 ms.

Writes ``$OUT/dynamic_gpu.json`` (or ``--out``). GPT recipe, bf16 weights; ``--preset tiny --device cpu`` is a smoke
test. The cost model is ``--cost-model module:factory`` (called with the ModelShape) or the analytic default.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lightning_3d.costs.model import ModelShape
from lightning_3d.dynamic import plan_step
from lightning_3d.dynamic.plan import default_cost_model
from lightning_3d.dynamic.stage_costs import evaluate, stage_layers
from lightning_3d.recipes import GPT


def lengths_mix(rng: np.random.Generator, tokens: int, cap: int) -> np.ndarray:
    """A multi-task-like mix: short answers, medium passages and a long tail (log-normal components)."""
    out = []
    while sum(out) < tokens:
        median, sigma = [(24, 0.6), (180, 0.7), (900, 0.8)][rng.choice(3, p=[0.5, 0.4, 0.1])]
        out.append(int(min(cap, max(2, rng.lognormal(np.log(median), sigma)))))
    return np.array(out)


def microbatch(lengths: list[int], seq_len: int, vocab: int, device: str, g: torch.Generator) -> tuple:
    ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    labels = torch.full((len(lengths), seq_len), -100, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, vocab, (n,), generator=g)
        labels[row, : n - 1] = ids[row, 1:n]
    return ids.to(device), labels.to(device)


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


def waiting(model, opt, args, cfg, shape, cost_model, budget: float) -> dict:
    """Train ``--wait-steps`` steps fed by a DataLoader whose workers plan every batch; count the steps that waited."""
    from lightning_3d.dynamic import DynamicMicroBatcher

    rng = np.random.default_rng(1)
    lengths, per_batch = [], []
    for _ in range(args.wait_steps):
        batch = lengths_mix(rng, args.tokens, args.max_seq_len)
        lengths += batch.tolist()
        per_batch.append(len(batch))
    # Fixed-size global batches keep the DataLoader simple: the mix's batch size is its mean sample count.
    size = int(np.mean(per_batch))
    batcher = DynamicMicroBatcher(collate, shape=shape, dp=1, pp=1, dp_rank=0, memory_budget=budget,
                                  cost_model=cost_model, max_seq_len=args.max_seq_len)
    loader = torch.utils.data.DataLoader(LengthSamples(np.array(lengths), cfg.vocab_size), batch_size=size,
                                         collate_fn=batcher, num_workers=args.workers, prefetch_factor=2, drop_last=True)
    waits, it = [], iter(loader)
    for step in range(args.wait_steps):
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - start)
        run_step(model, opt, [(ids.to(args.device), labels.to(args.device)) for ids, labels in batch], timed=False)
    steady = waits[2:]  # the first batches wait for the workers to start
    return {"steps": len(waits), "steps_waiting_over_1ms": int(sum(w > 1e-3 for w in steady)),
            "max_wait_ms": 1000 * max(steady, default=0.0)}


def run_step(model, opt, mbs: list[tuple], timed: bool) -> list[float]:
    """Forward + backward of every micro-batch (loss = token mean over the step), then the optimizer step."""
    terms = sum(int((labels != -100).sum()) for _, labels in mbs)
    times = []
    for ids, labels in mbs:
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        (loss / terms).backward()
        if timed:
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return times


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=65536, help="tokens per global batch")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--padding-size", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--cost-model", default="", help="module:factory taking the ModelShape (default: analytic)")
    p.add_argument("--wait-steps", type=int, default=200)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "dynamic_gpu.json")
    args = p.parse_args()
    cuda = args.device == "cuda"
    torch.manual_seed(0)
    module = GPT(args.preset, seq_length=args.max_seq_len)
    module.configure_model()
    cfg = module.config
    model = module.model.to(args.device, torch.bfloat16 if cuda else torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    shape = ModelShape("gpt", cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.ffn_size, cfg.vocab_size,
                       bytes_per_element=2 if cuda else 4)
    if args.cost_model:
        mod, name = args.cost_model.split(":")
        cost_model = getattr(importlib.import_module(mod), name)(shape)
    else:
        cost_model = default_cost_model(shape)
    g = torch.Generator().manual_seed(0)
    warm = microbatch([16], 16, cfg.vocab_size, args.device, g)
    run_step(model, opt, [warm], timed=False)  # allocates gradients and optimizer state: the baseline
    if cuda:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        budget = args.memory_fraction * torch.cuda.get_device_properties(0).total_memory - baseline
    else:
        baseline, budget = 0, 64e9
    rng = np.random.default_rng(0)
    batches = [lengths_mix(rng, args.tokens, args.max_seq_len) for _ in range(args.batches)]
    stages = stage_layers(shape, 1)
    accuracy, oom = [], 0
    plans = []
    for lengths in batches:
        start = time.process_time()
        plan = plan_step(lengths, cost_model=cost_model, shape=shape, dp=1, pp=1, memory_budget=budget,
                         max_seq_len=args.max_seq_len)
        plan_ms = 1000 * (time.process_time() - start)
        mbs_plan = [([int(i) for i in mb.samples], mb.seq_len) for mb in plan.replicas[0].microbatches]
        plans.append(mbs_plan)
        mbs = [microbatch([int(lengths[i]) for i in s], seq, cfg.vocab_size, args.device, g) for s, seq in mbs_plan]
        sizes = np.array([len(s) for s, _ in mbs_plan])
        seqs = np.array([seq for _, seq in mbs_plan])
        c = evaluate(cost_model, stages, sizes, seqs, None, recompute=False, tp=1)
        predicted = (c.forward + c.backward).sum(axis=0)
        if not cuda:
            run_step(model, opt, mbs, timed=False)
            accuracy.append({"plan_ms": plan_ms, "microbatches": len(mbs)})
            continue
        try:
            run_step(model, opt, mbs, timed=False)  # warm every shape
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            measured = run_step(model, opt, mbs, timed=True)
            peak = torch.cuda.max_memory_allocated() - baseline
        except torch.OutOfMemoryError:
            oom += 1
            torch.cuda.empty_cache()
            continue
        accuracy.append({
            "plan_ms": plan_ms, "microbatches": len(mbs), "predicted_s": float(predicted.sum()), "measured_s": sum(measured),
            "mb_ape": [abs(p - m) / m for p, m in zip(predicted.tolist(), measured)],
            "predicted_peak": plan.peak_memory, "measured_peak": peak,
        })
    report = {"preset": args.preset, "cost_model": cost_model.source, "budget_bytes": budget, "oom": oom,
              "batches": len(batches), "accuracy": accuracy}
    if cuda and accuracy:
        report["step_time_mape"] = float(np.mean([abs(a["predicted_s"] - a["measured_s"]) / a["measured_s"] for a in accuracy]))
        report["microbatch_time_mape"] = float(np.mean([x for a in accuracy for x in a["mb_ape"]]))
        report["peak_memory_worst_rel_err"] = float(max(abs(a["predicted_peak"] - a["measured_peak"]) / a["measured_peak"]
                                                        for a in accuracy))
    methods = {"dynamic": plans, "padding": [padding_plan(b, args.padding_size) for b in batches],
               "token_budget": [token_budget_plan(b, args.token_budget) for b in batches]}
    report["throughput"] = {}
    for name, method_plans in methods.items():
        useful, seconds, failed = 0, 0.0, None
        for k, (lengths, mbs_plan) in enumerate(zip(batches, method_plans)):
            mbs = [microbatch([int(lengths[i]) for i in s], seq, cfg.vocab_size, args.device, g) for s, seq in mbs_plan]
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                run_step(model, opt, mbs, timed=False)
                if cuda:
                    torch.cuda.synchronize()
            except torch.OutOfMemoryError as e:
                failed = f"out of memory: {str(e)[:200]}"
                torch.cuda.empty_cache()
                break
            if k > 0:  # the first batch warms the method's shapes
                seconds += time.perf_counter() - start
                useful += int(lengths.sum())
        report["throughput"][name] = {"useful_tokens_per_s": useful / seconds if seconds else None, "error": failed}
    if args.wait_steps > 0:
        report["plan_waiting"] = waiting(model, opt, args, cfg, shape, cost_model, budget)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "accuracy"}, indent=1))


if __name__ == "__main__":
    main()
