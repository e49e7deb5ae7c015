"""Useful tokens/s of the GPT or T5 recipe on the offline multi-task mix under each micro-batching.

"Useful" tokens are the samples' own tokens (inputs and targets, no padding); every variant trains on the same global
batches (same seed), so the ratio of their useful tokens/s is the speed-up. Variants: ``padding@N`` (N samples per
micro-batch), ``packing@N`` (N packed rows of ``--seq-length`` tokens per micro-batch, document-masked),
``token_budget@N`` (at most N padded tokens per micro-batch) and ``dynamic`` (DynaPipe planner with the memory
budget at ``--memory-fraction`` of the card; ``--profile`` a measured profile, else the analytic cost model).
GPT's packed rows attend as ``GPT(packed_attention=...)`` says: ``packing@N`` takes the recipe's default ("auto":
FlexAttention's block mask on CUDA, which skips the blocks across documents, the dense SDPA mask elsewhere),
``packing@N:sdpa`` the dense mask (every block of the row computed) and ``packing@N:flex`` FlexAttention; the table's
"attention" column says what each variant ran (padding, token budget and dynamic rows are right-padded and run SDPA's
plain causal kernel: causality already hides the padding behind each sample, so no mask is built).

``--engine direct`` (one GPU, pp = 1): one model, built once; every variant's micro-batches are collated by the data
module's own collators before the timed steps, then trained (fp32 weights, bf16 autocast, AdamW) with the recipe's
forward and loss, its linear layers' weight gradients accumulated as the strategy accumulates them
(``--gradient-accumulation-fusion``, default the strategy's "auto": the GEMM adds into the fp32 gradient; the cost
model's profile times the layers that way, so an unfused model runs the casts and adds the prediction leaves out).
Collation and planning are not timed for any variant (the dynamic planner runs ahead of training in DataLoader
workers: ``benchmarks/dynamic/dynamic_gpu.py`` measures that no step waits for it).

``--engine lightning``: ``Trainer.fit`` with ``Compressed3DStrategy`` (``--pp`` pipeline stages under ``--schedule``,
``--virtual-stages`` per rank for interleaved schedules; compression off unless ``--compression``, the optimizer state
sharded with ``--shard-optimizer-state``) on ``--devices`` processes per variant
(start it with torchrun for several GPUs; rank 0 prints), the data module with ``--num-workers`` DataLoader workers;
the planned variants report their ``plan_waits``. Step times come from a
synchronised per-step clock after ``--warmup`` steps (``--steps-for padding=2/1``: fewer for a slow variant).
``--deadline-at`` bounds the launch: a variant starts only with ``--min-variant-s`` left and stops before a step
that would end past the deadline (or its ``--variant-budget-s``), on every rank alike; the result file is rewritten
before and after every variant. Each row also carries the cost model's simulated pipeline time of the micro-batches
the variant ran (``predicted_step_s_mean``), the pipeline's shape-header receives and the host time blocked in them,
new shapes, device allocations and compiles per timed step; ``--table FILE ...`` prints the rows of result files.

    python benchmarks/dynamic/multitask_microbatching.py --engine direct --model gpt --preset 1.3b \
        --variants padding@4 packing@1 packing@2 packing@2:sdpa token_budget@16384 dynamic --out $OUT/multitask_gpt.json
    torchrun --nproc_per_node 4 benchmarks/dynamic/multitask_microbatching.py --engine lightning --devices 4 --pp 2 ...
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import gc
import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.dynamic.multitask_planned import against_best, packed_cost_attention, planned_batcher, profile_config, speedups  # noqa: E402
from lightning_3d.pipeline.schedules import SCHEDULES  # noqa: E402
from lightning_3d.recipes import GPT, T5  # noqa: E402
from lightning_3d.recipes.attention import SDPA_BACKENDS  # noqa: E402
from lightning_3d.recipes.data.multitask import MultiTaskDataModule  # noqa: E402
from lightning_3d.recipes.data.multitask_batching import PLANNED, StepCollator, sample_lengths  # noqa: E402
from lightning_3d.recipes.gpt.model import PACKED_ATTENTION, resolve_packed_attention  # noqa: E402


def parse_variant(text: str) -> tuple[str, int | None]:
    """``padding@N`` -> ("padding", N); ``dynamic`` -> ("dynamic", None) (plans with ``--profile``);
    ``dynamic@analytic`` -> ("dynamic", None) planned with the analytic cost model whatever ``--profile`` says;
    ``packed_dynamic`` and ``auto`` (``--auto-candidates``) likewise;
    ``packing@N:sdpa`` / ``packing@N:flex`` -> ("packing", N) with that packed attention (:func:`packed_attention_of`)."""
    packed_attention_of(text)
    name, _, size = text.partition(":")[0].partition("@")
    if name not in ("padding", "packing", "token_budget", *PLANNED):
        raise SystemExit(f"unknown variant {text!r}: use padding@N, packing@N, token_budget@N, dynamic, packed_dynamic,"
                         " auto (or one of the last three @analytic)")
    if name in PLANNED:
        if size not in ("", "analytic"):
            raise SystemExit(f"unknown variant {text!r}: {name} takes no size; use {name} or {name}@analytic")
        return name, None
    if not size.isdigit() or int(size) < 1:
        raise SystemExit(f"variant {text!r} needs a positive size after @, e.g. {name}@4")
    return name, int(size)


def packed_attention_of(text: str) -> str:
    """The GPT packed attention a variant names after ``:`` ("auto" without one); only packing variants take one."""
    base, _, attention = text.partition(":")
    if not attention:
        return "auto"
    if not base.startswith("packing@") or attention not in PACKED_ATTENTION:
        raise SystemExit(f"unknown variant {text!r}: only packing takes an attention, one of {PACKED_ATTENTION}"
                         " (e.g. packing@2:sdpa for the dense SDPA mask, packing@2:flex for FlexAttention)")
    return attention


def attention_label(model_type: str, name: str, attention: str, device: str, dropout: float, head_dim: int) -> str:
    """What a variant's attention runs, for the table: GPT packing's resolved packed attention, else the mask kind.
    For T5 ``attention`` is the recipe's ``attention`` ("explicit" or "sdpa"), the same for every variant."""
    if model_type == "t5":
        # T5 masks encoder padding, packing also pairs of documents
        packed_label, plain = f"{attention}+doc mask", f"{attention}+pad mask"
    else:
        packed_label = "flex block mask" if resolve_packed_attention(attention, torch.device(device), dropout,
                                                                     head_dim) == "flex" else "sdpa dense mask"
        plain = "sdpa causal"
    if name in ("packing", "packed_dynamic"):
        return packed_label
    return f"{plain} or {packed_label}" if name == "auto" else plain  # auto: its choice's


def shape_counts(steps: list[list[dict]], seen: set) -> tuple[float, float]:
    """(distinct micro-batch shapes per step, shapes per step never run before in this process), counted on the
    ``input_ids`` (and T5 ``labels``) shapes: per-shape set-up (cuDNN attention graphs, allocator segments) is paid
    once per process and shape."""
    distinct, new = [], []
    for mbs in steps:
        keys = {tuple(mb["input_ids"].shape) + tuple(mb["labels"].shape) for mb in mbs}
        distinct.append(len(keys))
        new.append(len(keys - seen))
        seen |= keys
    return round(float(np.mean(distinct)), 1), round(float(np.mean(new)), 1)


TABLE = [("variant", "variant", "{}"), ("sdpa", "sdpa", "{}"), ("attention", "attention", "{}"),
         ("tok/s", "useful_tokens_per_s", "{:,}"),
         ("repeat tok/s", "useful_tokens_per_s_repeat", "{:,}"), ("step s", "step_s_mean", "{:.3f}"),
         ("predicted s", "predicted_step_s_mean", "{:.3f}"), ("meas/pred", "measured_over_predicted", "{:.2f}"),
         ("mb/step", "microbatches_per_step", "{}"),
         ("shapes", "shapes_per_step", "{}"), ("new shapes", "new_shapes_per_step", "{}"),
         ("padding", "padding_fraction", "{:.1%}"), ("dev allocs", "device_allocs_per_step", "{}"),
         ("peak GB", "peak_memory_gb", "{}"), ("timed compiles", "compiles_timed", "{}"),
         ("choices (timed steps)", "choices", "{}")]


def table(rows: list[dict]) -> str:
    """The direct engine's rows as a compact Markdown table (stdout; the JSON lines carry the same numbers)."""
    lines = ["| " + " | ".join(h for h, _, _ in TABLE) + " |", "|" + "---|" * len(TABLE)]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['variant']} | {r.get('sdpa', '')} | {r.get('attention', '')} | error: {r['error'][:120]} |")
            continue
        cells = [fmt.format(r[key]) if r.get(key) is not None else "" for _, key, fmt in TABLE]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + speedups(rows))


SDPA_CHOICES = (*SDPA_BACKENDS, "flash_first")
# The direct engine's --sdpa default: its model is built outside a Trainer (where the recipes' "auto" means "torch"),
# and most of its variants change shapes, so it names the value those need (recipes/attention.py).
DIRECT_SDPA = "no_cudnn"


def sdpa_context(model: torch.nn.Module, name: str):
    """``--sdpa``: ``no_cudnn`` / ``torch`` set the recipe's ``sdpa_backends`` to that value on every attention of
    ``model`` (recipes/attention.py; ``no_cudnn`` is what the recipes' ``"auto"`` picks for changing shapes);
    ``flash_first`` runs the recipe under ``torch`` inside the order flash, efficient, cuDNN, math for the whole
    variant (forward, loss, backward and any recomputation), the earlier experiment. Leaving the context restores each
    attention's value."""
    if name not in SDPA_CHOICES:
        raise ValueError(f"--sdpa {name!r}: choose from {list(SDPA_CHOICES)}")
    stack = contextlib.ExitStack()
    attentions = [m for m in model.modules() if hasattr(m, "sdpa_backends")]
    before = [m.sdpa_backends for m in attentions]
    for m in attentions:
        m.sdpa_backends = "torch" if name == "flash_first" else name

    def restore() -> None:
        for m, value in zip(attentions, before):
            m.sdpa_backends = value

    stack.callback(restore)
    if name == "flash_first":
        stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                         SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], set_priority=True))
    return stack


def data_module(args, microbatching: str = "padding", size: int | None = None, **extra) -> MultiTaskDataModule:
    budget = size if microbatching == "token_budget" else args.token_budget
    return MultiTaskDataModule(
        model_type=args.model, num_samples=args.num_samples, tokenizer="bpe", tokenizer_vocab_size=args.vocab_size,
        seq_length=args.seq_length, target_length=args.target_length, global_batch_size=args.global_batch,
        microbatching=microbatching, micro_batch_size=size or args.micro_batch_size, token_budget=budget,
        val_fraction=0.0, seed=args.seed, cache_dir=args.cache_dir, **extra)


def build_model(args, data: MultiTaskDataModule, packed_attention: str = "auto"):
    # --compile (lightning engine): the recipes compile their blocks in configure_model, which the Trainer calls.
    compile_ = bool(getattr(args, "compile", False))
    if args.model == "gpt":
        return GPT(args.preset, vocab_size=data.vocab_size, seq_length=args.seq_length, packed_attention=packed_attention,
                   compile=compile_)
    return T5(args.preset, vocab_size=data.vocab_size, pad_token_id=data.pad_token_id, eos_token_id=data.eos_token_id,
              compile=compile_)


def cost_model_for(args, module, shape):
    """``--profile``: none (analytic), a file, or ``measure`` (the recipe's layers on this GPU, a grid that covers
    the multi-task lengths; written to ``$OUT/profile_<model>_<preset>.json``)."""
    from lightning_3d.costs import ProfiledCostModel
    from lightning_3d.dynamic import default_cost_model

    if args.profile == "none":
        return default_cost_model(shape)
    if args.profile != "measure":
        return ProfiledCostModel(args.profile)
    from lightning_3d.planner import profile_model

    config = profile_config(args.model, args.preset, module.config.vocab_size, args.seq_length, args.target_length,
                            "bf16-mixed" if torch.cuda.is_available() else "32-true")
    lens = [int(x) for x in args.profile_lens.split(",")]
    doc = profile_model(config, microbatch_sizes=[int(x) for x in args.profile_sizes.split(",")],
                        seq_lens=[s for s in lens if s <= args.seq_length],
                        target_lens=[t for t in lens if t <= args.target_length] if args.model == "t5" else None,
                        recompute=(False,), warmup=1, repeats=2, collectives=False, log=lambda *_: None,
                        device=None if torch.cuda.is_available() else "cpu")
    out = Path(args.out).parent / f"profile_{args.model}_{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, allow_nan=False))
    return ProfiledCostModel(out)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (FlexAttention's kernels are compiled on first use and
    for a new shape): a compile inside the timed steps shows in the table."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


KERNEL_KINDS = (("attention", ("flash", "fmha", "attn", "flex", "triton_tem")), ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma")),
                ("optimizer", ("multi_tensor", "adam")), ("copy", ("memcpy", "memset", "copy")))


def kernel_table(run_step) -> dict:
    """One more step under torch.profiler: the device time of its kernels by kind (attention, GEMM, optimizer,
    copies, the rest) and the ten largest by name, against the step's wall time: tells a step that waits for the
    host (kernels well below the wall) from kernels slower than the cost model's profile."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    by_kind: dict[str, float] = {}
    names: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time / 1e3  # torch reports microseconds
        low = event.name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(key in low for key in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
        entry = names.setdefault(event.name[:90], [0.0, 0])
        entry[0] += ms
        entry[1] += 1
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:10]
    # the same total as torch's table counts it (self device time of every op), a cross-check of the event walk
    table_ms = sum(a.self_device_time_total for a in prof.key_averages()) / 1e3
    return {"wall_ms": round(1e3 * wall, 1), "kernels_ms": round(sum(by_kind.values()), 1),
            "kernels_ms_table": round(table_ms, 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [[name, round(ms, 2), n] for name, (ms, n) in top]}


# ----- direct engine: one model, every variant on the same batches ----------------------------------------------
def direct(args) -> list[dict]:
    from lightning_3d.costs import model_shape
    from lightning_3d.distributed.wgrad_fusion import fuse_standalone
    from lightning_3d.dynamic import default_cost_model
    from lightning_3d.recipes.t5.model import run_stage

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    data = data_module(args)
    data.setup("fit")
    module = build_model(args, data)
    module.configure_model()
    model = module.model.to(device).train()
    fusion = {"auto": "auto", "true": True, "false": False}[args.gradient_accumulation_fusion]
    fused = fuse_standalone(model, fusion, "--gradient-accumulation-fusion")  # on its device first (slots are keyed by address)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)

    def loss_of(mb: dict) -> torch.Tensor:
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items() if isinstance(v, torch.Tensor)}
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            if args.model == "gpt":
                out = model(mb["input_ids"], mb.get("position_ids"), mb.get("document_ids"))
            else:
                out = run_stage(model, (), mb)
            return module.pipeline_loss(out, mb), module.pipeline_loss_terms(mb)

    def step(mbs: list[dict]) -> None:
        terms = sum(int((mb["labels"] != -100).sum()) for mb in mbs)
        for mb in mbs:
            loss, _ = loss_of(mb)
            (loss / terms).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(data.train_dataset))
    n = args.steps
    batches = [[data.train_dataset[int(i)] for i in order[k * args.global_batch : (k + 1) * args.global_batch]]
               for k in range(n)]
    useful = [sum(sum(sample_lengths(s)) for s in b) for b in batches]
    warm = data_module(args, "padding", 1).collator(1, 0)
    step(warm.microbatches(batches[0][:1]))  # gradients and optimizer state: the memory baseline
    if cuda:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        budget = args.memory_fraction * torch.cuda.get_device_properties(0).total_memory - baseline
    else:
        baseline, budget = 0, 64e9
    shape = model_shape(module.config, bytes_per_element=2 if cuda else 4)
    # Every variant but padding gets the cost model's prediction beside its measurement (auto compares the same).
    cost_model = cost_model_for(args, module, shape)
    # Only for @analytic variants: built otherwise, its warning (costs not measured) would stand in the output of a
    # run whose plans all used the profile.
    analytic = default_cost_model(shape) if any(v.endswith("@analytic") for v in args.variants) else None
    packed = packed_cost_attention(args, module, device)
    results = []
    seen: set = set()
    cuda_stats = (lambda: torch.cuda.memory_stats()) if cuda else (lambda: {})
    for sdpa, text in [(o, v) for o in args.sdpa for v in args.variants]:
        name, size = parse_variant(text)
        attention = packed_attention_of(text)
        row = {"variant": text, "sdpa": sdpa, "error": None, "fused_linears": len(fused),
               "attention": attention_label(args.model, name, module.hparams.attention if args.model == "t5" else attention,
                                            device, module.config.dropout, module.config.head_dim)}
        backend_order = contextlib.ExitStack()
        try:
            backend_order.enter_context(sdpa_context(model, sdpa))
            if args.model == "gpt":
                model.packed_attention = attention
            collator: StepCollator = data_module(args, name if name not in PLANNED else "padding", size).collator(1, 0)
            plan_s = 0.0
            chooser = None
            priced = packed if args.model == "t5" else {"sdpa": "dense", "flex": "flex"}.get(attention, packed)
            if name in PLANNED:
                chooser = planned_batcher(args, text, collator, shape, budget,
                                          analytic if text.endswith("@analytic") else cost_model, priced)
            elif name in ("packing", "token_budget"):  # its own prediction, the way auto costs it as a candidate
                chooser = planned_batcher(args, text, collator, shape, budget, cost_model, priced)
            steps, predicted, chosen, candidates = [], [], [], []
            for b in batches:
                start = time.process_time()
                planned = collator(b)
                plan_s += time.process_time() - start
                steps.append(list(planned))
                if name in PLANNED:
                    predicted.append(planned.plan.makespan)
                    if planned.choice is not None:
                        chosen.append(planned.choice.chosen)
                        candidates.append(planned.choice.predicted)
                elif chooser is not None:
                    predicted.append(chooser.choose(b).predicted[text.partition(":")[0]])
            computed = [sum(mb["input_ids"].numel() + (mb["labels"].numel() if args.model == "t5" else 0) for mb in s)
                        for s in steps]
            distinct, new = shape_counts(steps, seen)

            def timed_pass() -> list[float]:
                times = []
                for k, mbs in enumerate(steps):
                    if k == args.warmup:
                        graphs[0] = compiled_graphs()
                    if cuda:
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    step(mbs)
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                return times

            graphs = [compiled_graphs()]

            if cuda:
                torch.cuda.reset_peak_memory_stats()
            stats = cuda_stats()
            times = timed_pass()
            compiles_timed = compiled_graphs() - graphs[0]  # e.g. FlexAttention recompiled for a new shape
            after = cuda_stats()
            timed = slice(args.warmup, None)
            seconds = sum(times[timed])
            row.update({
                "useful_tokens_per_s": round(sum(useful[timed]) / seconds) if seconds else None,
                "step_s_mean": round(seconds / max(1, len(times[timed])), 4),
                "microbatches_per_step": round(float(np.mean([len(s) for s in steps])), 1),
                "shapes_per_step": distinct, "new_shapes_per_step": new,
                "padding_fraction": round(1 - sum(useful) / sum(computed), 3),
                "collate_ms_per_step": round(1000 * plan_s / len(steps), 1), "compiles_timed": compiles_timed,
                "peak_memory_gb": round((torch.cuda.max_memory_allocated() - baseline) / 2**30, 2) if cuda else None})
            if cuda:  # allocator churn: segments allocated from the device, and retries after freeing the cache
                row["device_allocs_per_step"] = round(
                    (after.get("num_device_alloc", 0) - stats.get("num_device_alloc", 0)) / len(steps), 1)
                row["alloc_retries"] = after.get("num_alloc_retries", 0) - stats.get("num_alloc_retries", 0)
            if predicted and np.isfinite(predicted).all():  # the cost model's simulated step time beside the measured
                row["predicted_step_s_mean"] = round(float(np.mean(predicted[timed])), 4)
                row["measured_over_predicted"] = round(row["step_s_mean"] / row["predicted_step_s_mean"], 3)
            elif predicted:  # a profile costs shapes outside its grid as infinite: no prediction for this variant
                row["predicted_by"] = "none: micro-batch shapes outside the profile's grid"
            if chosen and name == "auto":  # which candidate ran in the timed steps, and what each was predicted to take
                row["choices"] = {c: chosen[timed].count(c) for c in dict.fromkeys(chosen[timed])}
                means = {c: float(np.mean([p[c] for p in candidates[timed]])) for c in candidates[0]}
                # None: refused in some timed step (over the memory budget, or outside the profile's grid)
                row["candidates_predicted_s"] = {c: round(m, 4) if np.isfinite(m) else None for c, m in means.items()}
            if args.kernel_table and cuda:
                row["kernels"] = kernel_table(lambda: step(steps[min(args.warmup, len(steps) - 1)]))
            if args.repeat:
                # The same steps again: every shape has run once, so what the first pass paid per new shape is gone.
                again = sum(timed_pass()[timed])
                row["useful_tokens_per_s_repeat"] = round(sum(useful[timed]) / again) if again else None
        except torch.OutOfMemoryError as err:
            row["error"] = f"out of memory: {str(err)[:160]}"
        except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        finally:
            backend_order.close()
            opt.zero_grad(set_to_none=False)
            if cuda:
                torch.cuda.empty_cache()
        results.append(row)
        print(json.dumps({"model": args.model, **row}), flush=True)
    return results


# ----- plans only: what each variant hands the model, without a GPU ------------------------------------------------
def plans(args) -> list[dict]:
    """Every variant's micro-batch shapes for the benchmark's global batches (the direct engine's, same seed), and for
    dynamic the cost model's predicted time per micro-batch; no model runs. The memory budget is ``--memory-fraction``
    of a ``--card-gb`` card less 16 bytes per parameter (fp32 weights and gradients, AdamW's two moments), as the
    direct engine's budget is on the GPU."""
    from lightning_3d.costs import model_shape
    from lightning_3d.dynamic import default_cost_model

    data = data_module(args)
    data.setup("fit")
    module = build_model(args, data)
    shape = model_shape(module.config, bytes_per_element=2)
    budget = args.memory_fraction * args.card_gb * 2**30 - 16 * module.config.num_parameters()
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(data.train_dataset))
    batches = [[data.train_dataset[int(i)] for i in order[k * args.global_batch : (k + 1) * args.global_batch]]
               for k in range(args.steps)]
    cost_model = cost_model_for(args, module, shape) if args.profile not in ("none", "measure") else None
    if args.compile and cost_model is not None:  # priced as the lightning engine prices a compiled run
        from lightning_3d.recipes.data.multitask_planning import priced_as_trained

        cost_model = priced_as_trained(cost_model, args.profile, True)
    rows = []
    for text in args.variants:
        name, size = parse_variant(text)
        collator = data_module(args, name if name not in PLANNED else "padding", size).collator(1, 0)
        if name in PLANNED:
            analytic = text.endswith("@analytic") or cost_model is None
            planned_batcher(args, text, collator, shape, budget, default_cost_model(shape) if analytic else cost_model,
                            "dense" if args.model == "t5" else "flex")
        for k, b in enumerate(batches):
            step = collator(b)
            row = {"variant": text, "step": k, "shapes": [list(mb["input_ids"].shape) for mb in step]}
            if name in PLANNED:
                row["predicted_step_s"] = round(step.plan.makespan, 4)
                row["cost_source"] = step.plan.cost_source
                if step.choice is not None:
                    row["chosen"] = step.choice.chosen
                    row["candidates_predicted_s"] = {c: round(v, 4) if np.isfinite(v) else None
                                                     for c, v in step.choice.predicted.items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ----- lightning engine: Trainer.fit per variant, any number of processes and pipeline stages ---------------------
CUT = "cut by the time limit"
SKIPPED = "skipped: budget"
_received_sigterm = False


def _note_sigterm(signum, frame) -> None:
    """The launch's time limit (``timeout`` sends SIGTERM to torchrun and its workers): a variant that fails after
    it failed because it was killed (its store or compile workers died: BrokenPipe, connection reset), not because
    of its code; the row says so. No I/O here: Lightning's own SIGTERM handler runs in the same chain."""
    global _received_sigterm
    _received_sigterm = True


def rank0_decides(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank: each rank's clock started at a slightly different time, and a stop or skip
    decided on one rank alone would leave the others waiting in a collective."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([int(flag)], device=device)
    dist.broadcast(value, src=0)
    return bool(value.item())


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over all ranks (the pipeline's later stages see what rank 0, stage 0, does not: they
    receive the activations' shape headers)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


class HeaderClock:
    """Counts the pipeline's blocking shape-header receives and the host time blocked in them. A receiving stage
    learns an activation's shape from a header the first time it sees a micro-batch signature; with shapes that
    change every step (dynamic micro-batching) every micro-batch pays one, and the receiver's host thread waits
    there for the sender's host to reach that micro-batch — a cost per micro-batch that no cost model here
    counts. Installed on ``PipelineChannels`` by the benchmark only (the library is unchanged)."""

    count = 0
    seconds = 0.0

    @classmethod
    def install(cls) -> None:
        from lightning_3d.pipeline.p2p import PipelineChannels

        if getattr(PipelineChannels.recv_header, "_timed", False):
            return
        plain = PipelineChannels.recv_header

        def recv_header(self, pp_rank):
            start = time.perf_counter()
            try:
                return plain(self, pp_rank)
            finally:
                cls.count += 1
                cls.seconds += time.perf_counter() - start

        recv_header._timed = True
        PipelineChannels.recv_header = recv_header


def predicted_pipeline_s(cost_model, shape, pp: int, steps: list[tuple[list[tuple], tuple | None]],
                         schedule: str = "1f1b", virtual_stages: int = 1) -> list[float]:
    """The cost model's simulated pipeline time of each step's micro-batches as they ran on this replica: ``steps``
    holds per step the micro-batches' (size, length, target length or None) and the step's explicit ``orders`` (None:
    the strategy's ``schedule`` over ``virtual_stages`` stages per rank, in the given order). What dynamic's planner
    predicts for its own plans (the same stages, costs and simulation as ``dynamic.plan``), computed the same way for
    every variant, so that measured / predicted compares the variants' unmodelled costs (per micro-batch host work,
    new shapes, the optimizer). GPT's packed rows are costed with attention over the whole row (the dense mask's
    cost; FlexAttention skips the blocks across documents)."""
    from lightning_3d.dynamic.stage_costs import evaluate, stage_layers
    from lightning_3d.pipeline.schedules import build_schedule
    from lightning_3d.pipeline.timing import simulate

    stages = stage_layers(shape, pp * virtual_stages)
    out = []
    for mbs, orders in steps:
        size, length = np.array([m[0] for m in mbs]), np.array([m[1] for m in mbs])
        target = np.array([m[2] for m in mbs]) if mbs[0][2] is not None else None
        costs = evaluate(cost_model, stages, size, length, target, recompute=False, tp=1)
        orders = orders or tuple(build_schedule(schedule, pp, virtual_stages, len(mbs), r) for r in range(pp))
        timeline = simulate(orders, pp * virtual_stages,
                            lambda a: (costs.forward if a.kind == "F" else costs.backward)[a.stage, a.microbatch],
                            check=False)
        out.append(float(timeline.makespan))
    return out


def per_variant(items: list[str], option: str) -> dict[str, str]:
    """``NAME=VALUE`` items (NAME a variant's name such as ``padding`` or its full text such as ``packing@2``;
    a bare VALUE is the default, key ``""``)."""
    out = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        if sep and name.split("@")[0].split(":")[0] not in ("padding", "packing", "token_budget", *PLANNED):
            raise SystemExit(f"{option} {item!r}: the name before = must be a variant (padding, packing, token_budget,"
                             " dynamic, packed_dynamic, auto, or a full variant such as packing@2), e.g. padding=2/1")
        out[name] = value
    return out


def lookup(table: dict[str, str], text: str):
    """The value for variant ``text``: its full text, else its name, else the default (None if none)."""
    return table.get(text, table.get(text.split("@")[0].split(":")[0], table.get("")))


def steps_of(args, text: str) -> tuple[int, int]:
    """(steps, warm-up steps) of a variant: ``--steps-for NAME=TIMED/WARMUP`` (timed steps after warm-up ones),
    else ``--steps``/``--warmup``."""
    value = lookup(per_variant(args.steps_for, "--steps-for"), text)
    if value is None:
        return args.steps, args.warmup
    timed, sep, warm = value.partition("/")
    if not sep or not timed.isdigit() or not warm.isdigit() or int(timed) < 1:
        raise SystemExit(f"--steps-for {text}={value!r}: give TIMED/WARMUP with TIMED >= 1, e.g. padding=2/1")
    return int(timed) + int(warm), int(warm)


def budget_of(args, text: str) -> float | None:
    """A variant's wall-time budget in seconds (set-up included): ``--variant-budget-s [NAME=]SECONDS``."""
    value = lookup(per_variant(args.variant_budget_s, "--variant-budget-s"), text)
    try:
        return None if value is None else float(value)
    except ValueError:
        raise SystemExit(f"--variant-budget-s {text}={value!r}: give seconds, e.g. padding=30") from None


def write_rows(args, results: list[dict], running: dict | None, final: bool, summary: dict | None = None) -> None:
    """The rows so far (rank 0), rewritten after every variant and before each starts: the one starting is written
    as cut by the time limit, so a launch killed mid-variant leaves that row, and every finished one, on disk."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    rows = results + ([{**running, "status": CUT, "error": f"{CUT} (killed while running)"}] if running else [])
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "partial": not final, "summary": summary or {},
           "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(args.out)  # atomic: a kill during the write leaves the previous rows


def strategy_for(args):
    """The lightning engine's strategy: ``--pp`` stages under ``--schedule``; compression off unless ``--compression``
    (CB on the pipeline's sends whatever the link, which its "auto" would skip on NVLink; SC by its default link rule)
    and the optimizer state replicated unless ``--shard-optimizer-state`` (ZeRO-1 over the data-parallel replicas)."""
    from lightning_3d import Compressed3DStrategy, CompressionConfig, ParallelismConfig, PipelineConfig, RuntimeConfig

    return Compressed3DStrategy(
        parallelism=ParallelismConfig(pipeline_parallel_size=args.pp),
        pipeline=PipelineConfig(schedule=args.schedule, virtual_stages=args.virtual_stages),
        compression=CompressionConfig(compressed_backprop=True) if args.compression else CompressionConfig(enabled=False),
        runtime=RuntimeConfig(shard_optimizer_state=bool(args.shard_optimizer_state)))


def lightning(args) -> list[dict]:
    import signal

    import lightning.pytorch as pl

    class StepClock(pl.Callback):
        """Wall time of every training step (synchronised on GPU); stops the variant, on every rank alike, when
        one more step would end past its deadline (rank 0's clock decides)."""

        def __init__(self, start: float, deadline: float, steps: int, warmup: int) -> None:
            self.times: list[float] = []
            self._start = 0.0
            self.variant_start, self.deadline, self.steps, self.warmup = start, deadline, steps, warmup
            self.compiles_before_timed: int | None = None
            self.setup_s: float | None = None
            self.stopped = False
            self.microbatches: list[int] = []  # this replica's micro-batches per step (rank 0 reports its own)
            self.shapes: list[int] = []  # distinct micro-batch shapes per step, and those never run before
            self.runs: list[tuple[list[tuple], tuple | None]] = []  # per step: (size, length, target) and orders
            self.new_shapes: list[int] = []
            self._seen: set = set()
            self.headers: list[tuple[int, float]] = []  # per step: shape headers received, seconds blocked
            self.allocs: list[tuple[int, int]] = []  # per step: device allocations (cudaMalloc), alloc retries
            self._marks = (0, 0.0, 0, 0)

        def _allocator(self) -> tuple[int, int]:
            if not torch.cuda.is_available():
                return 0, 0
            stats = torch.cuda.memory_stats()
            return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._start = time.perf_counter()
            if self.setup_s is None:  # model build, strategy set-up, loader workers: before the first step
                self.setup_s = round(time.time() - self.variant_start, 1)
            if isinstance(batch, list):
                self.microbatches.append(len(batch))
                keys = {tuple(mb["input_ids"].shape) + tuple(mb["labels"].shape) for mb in batch
                        if isinstance(mb, dict) and "input_ids" in mb and "labels" in mb}
                self.shapes.append(len(keys))
                self.runs.append(([(mb["input_ids"].shape[0], mb["input_ids"].shape[1],
                                    mb["labels"].shape[1] if "decoder_input_ids" in mb else None) for mb in batch],
                                  getattr(batch, "orders", None)))
                self.new_shapes.append(len(keys - self._seen))
                self._seen |= keys
            self._marks = (HeaderClock.count, HeaderClock.seconds, *self._allocator())
            if len(self.times) == self.warmup:  # graphs compiled from here on were compiled inside the timed steps
                self.compiles_before_timed = compiled_graphs()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)
            count, seconds, allocs, retries = self._marks
            self.headers.append((HeaderClock.count - count, HeaderClock.seconds - seconds))
            now_allocs, now_retries = self._allocator()
            self.allocs.append((now_allocs - allocs, now_retries - retries))
            if len(self.times) >= self.steps:  # max_steps ends it anyway, on every rank
                return
            # One more step like the slowest since the first (which carries compiles and first-shape set-up), with a
            # margin for its variation, must end in time.
            late = time.time() + 1.2 * max(self.times[1:] or self.times) > self.deadline
            if rank0_decides(late):
                self.stopped = True
                trainer.should_stop = True

    HeaderClock.install()
    signal.signal(signal.SIGTERM, _note_sigterm)  # Lightning's handler chains this one (it keeps earlier ones)
    # A wall-clock deadline (seconds since the epoch): one clock for every rank of the host and for the launcher.
    # The variants must end --teardown-s before it: a Trainer's teardown (loader workers, the pipeline's buffers)
    # and the launch's exit after its last step take that long.
    deadline = args.deadline_at - args.teardown_s if args.deadline_at else float("inf")
    world = int(os.environ.get("WORLD_SIZE", args.devices))
    probe = data_module(args)  # the vocabulary (the data must be prepared: --prepare-only first)
    card = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 64 * 2**30
    # The activation budget: the card's fraction less fp32 weights, gradients and AdamW state of a pipeline stage.
    params = build_model(args, probe).config.num_parameters()
    budget_gb = (args.memory_fraction * card - 16 * params / args.pp) / 2**30
    # The cost model dynamic plans with (a --profile file, else the analytic one), for every variant's prediction.
    from lightning_3d.costs import ProfiledCostModel, model_shape
    from lightning_3d.dynamic import default_cost_model

    shape = model_shape(build_model(args, probe).config, bytes_per_element=4 if "32" in args.precision else 2)
    # The analytic model only where it prices something: built with a profile, its warning (costs not measured)
    # would stand in the output of a run whose predictions all came from the profile.
    analytic = functools.cache(lambda: default_cost_model(shape))
    profiled = args.profile not in ("none", "measure")
    cost_model = ProfiledCostModel(args.profile) if profiled else analytic()
    if args.compile and profiled:
        # Priced as the data module's planner prices a compiled model: the profile's compiled grids where it has them.
        from lightning_3d.recipes.data.multitask_planning import priced_as_trained

        cost_model = priced_as_trained(cost_model, args.profile, True)
    results = []
    for text in args.variants:
        name, size = parse_variant(text)
        steps, warmup = steps_of(args, text)
        row = {"variant": text, "pp": args.pp, "dp": world // args.pp, "schedule": args.schedule, "status": "ok",
               "error": None, "steps": steps, "warmup": warmup}
        begin = time.time()
        if _received_sigterm:
            results.append({**row, "status": CUT, "error": f"{CUT} (not started)"})
            continue
        # Start only with time for set-up and a few steps left; rank 0 decides (the first variant runs before any
        # process group exists, with the whole budget ahead of it).
        left = deadline - begin
        if rank0_decides(left < args.min_variant_s):
            results.append({**row, "status": SKIPPED,
                            "error": f"{SKIPPED} ({max(0.0, left):.0f} s left before --deadline-at less --teardown-s, a variant needs"
                                     f" --min-variant-s {args.min_variant_s:g})"})
            write_rows(args, results, None, final=False)
            if int(os.environ.get("RANK", "0")) == 0:
                print(json.dumps({"model": args.model, **results[-1]}), flush=True)
            continue
        own = budget_of(args, text)
        clock = StepClock(begin, min(deadline, begin + own) if own else deadline, steps, warmup)
        write_rows(args, results, row, final=False)
        trainer = None
        try:
            model = build_model(args, probe, packed_attention_of(text))
            extra = {"memory_budget_gb": budget_gb} if name in PLANNED else {}
            if name not in PLANNED and SCHEDULES[args.schedule].microbatch_multiple_of_pp:
                # Interleaved schedules run a multiple of pp micro-batches; the planner plans for it, the fixed
                # batchings split their largest micro-batches (packing: then its fullest row) until they have one.
                extra["microbatch_multiple"] = args.pp
            if name == "auto" and args.auto_candidates:
                extra["auto_candidates"] = args.auto_candidates
            if name in PLANNED and not text.endswith("@analytic") and args.profile not in ("none", "measure"):
                extra["cost_profile"] = args.profile  # the data module reads and checks it (its public option)
            data = data_module(args, name, size, num_workers=args.num_workers, **extra)
            strategy = strategy_for(args)
            virtual_stages = strategy.virtual_stages
            trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, precision=args.precision,
                                 max_steps=steps, strategy=strategy, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                                 limit_val_batches=0)
            trainer.fit(model, datamodule=data)
            row["sdpa_backends"] = model.model.config.sdpa_backends  # what the recipe's "auto" resolved to for this data
            if _received_sigterm:
                raise RuntimeError("SIGTERM during the variant")
            # Every variant's step k trains the same global batch: its useful tokens, from the sampler's order.
            sampler = trainer.train_dataloader.sampler
            indices = list(iter(sampler))[: steps * args.global_batch]
            useful = [sum(sum(sample_lengths(data.train_dataset[i])) for i in indices[k * args.global_batch:
                                                                                      (k + 1) * args.global_batch])
                      for k in range(len(clock.times))]
            timed = slice(warmup, None)
            seconds = sum(clock.times[timed])
            row.update({"timed_steps": len(clock.times[timed]), "setup_s": clock.setup_s,
                        "first_step_s": round(clock.times[0], 3) if clock.times else None,
                        "stopped_by_budget": clock.stopped})
            if not clock.times[timed]:
                row.update({"status": SKIPPED, "error": f"{SKIPPED} (stopped after {len(clock.times)} of {warmup}"
                            f" warm-up steps, the slowest {max(clock.times, default=0):.1f} s: no timed step fits;"
                            " raise --variant-budget-s / --deadline-at or lower the warm-up with --steps-for)"})
            else:
                row.update({"useful_tokens_per_s": round(sum(useful[timed]) / seconds) if seconds else None,
                            "step_s_mean": round(seconds / len(clock.times[timed]), 4),
                            # the spread of the timed steps (their plans differ: the step times do too)
                            "step_s_min": round(min(clock.times[timed]), 4),
                            "step_s_max": round(max(clock.times[timed]), 4),
                            "microbatches_per_step": round(float(np.mean(clock.microbatches)), 1)
                            if clock.microbatches else None,
                            "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                            if torch.cuda.is_available() else None})
            if clock.times[timed]:
                n = len(clock.times[timed])
                heads = clock.headers[timed]
                allocs = clock.allocs[timed]
                # The later stages receive the headers; every rank's allocator counts: the worst rank, per step.
                recvs, blocked, device_allocs, retries = max_over_ranks(
                    [sum(h for h, _ in heads) / n, sum(s for _, s in heads) / n, sum(a for a, _ in allocs) / n,
                     float(sum(r for _, r in allocs))])
                row.update({"shapes_per_step": round(float(np.mean(clock.shapes[timed])), 1) if clock.shapes else None,
                            "new_shapes_per_step": round(float(np.mean(clock.new_shapes[timed])), 1)
                            if clock.new_shapes else None,
                            "header_recvs_per_step": round(recvs, 1),
                            "header_wait_ms_per_step": round(1000 * blocked, 1),
                            # torch.compile graphs built in the timed steps (FlexAttention per new shape; the
                            # recipes' blocks are eager here): a recompile under changing shapes shows as > 0.
                            "compiles_timed": compiled_graphs() - clock.compiles_before_timed
                            if clock.compiles_before_timed is not None else None})
                if torch.cuda.is_available():
                    row.update({"device_allocs_per_step": round(device_allocs, 1), "alloc_retries": int(retries)})
                if len(clock.runs) == len(clock.times):
                    # The slowest replica's simulated time per timed step (every rank simulates its own replica).
                    layout = (args.schedule, virtual_stages)
                    predicted = predicted_pipeline_s(cost_model, shape, args.pp, clock.runs[timed], *layout)
                    row["predicted_by"] = "profile" if profiled else "analytic"
                    if max_over_ranks([0.0 if all(np.isfinite(predicted)) else 1.0])[0]:
                        # A profile costs shapes outside its grid as infinite (the planner never picks them): the
                        # analytic model's time for this variant, on every rank if on one (the max is over ranks).
                        predicted = predicted_pipeline_s(analytic(), shape, args.pp, clock.runs[timed], *layout)
                        row["predicted_by"] = "analytic (shapes outside the profile's grid)"
                    predicted = max_over_ranks(predicted)
                    row["predicted_step_s_mean"] = round(float(np.mean(predicted)), 4)
                    row["measured_over_predicted"] = round(row["step_s_mean"] / row["predicted_step_s_mean"], 2)
            if data.plan_waits is not None and name in PLANNED:
                row["plan_waits"] = data.plan_waits.summary()  # auto: its "choices" say which candidate ran how often
        except Exception as err:  # noqa: BLE001 - one failing variant (e.g. out of memory) must not lose the others
            if _received_sigterm or (trainer is not None and getattr(trainer, "received_sigterm", False)):
                # Killed by the launch's limit: its store or workers died under it, which is no error of the code.
                row.update({"status": CUT, "error": f"{CUT} ({type(err).__name__} after SIGTERM)"})
            else:
                # A worker's error arrives wrapped with the worker's traceback: its last line says what failed.
                lines = [line for line in str(err).strip().splitlines() if line.strip()]
                row.update({"status": "error", "error": f"{type(err).__name__}: {(lines[-1] if lines else '')[:300]}"})
        finally:
            # The variant's objects go before the next variant builds its own: the trainer, model, data module and
            # step clock (a callback of the trainer) are still bound here and hold one another in reference cycles
            # (module -> trainer -> strategy -> module) that only the cyclic collector frees; both are needed, or the
            # variant's weights, gradients and optimizer state stay on the card under the next variant's
            # micro-batches (tests/test_dynamic_benchmark.py). The process group stays: the next variant's Trainer
            # reuses it (a new one after destroying it cannot rendezvous again under torchrun).
            trainer = model = data = strategy = clock = sampler = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        row["variant_s"] = round(time.time() - begin, 1)
        results.append(row)
        write_rows(args, results, None, final=False)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"model": args.model, **row}), flush=True)
    return results


LIGHTNING_TABLE = [("model", "model", "{}"), ("pp", "pp", "{}"), ("dp", "dp", "{}"), ("schedule", "schedule", "{}"),
                   ("variant", "variant", "{}"),
                   ("tok/s", "useful_tokens_per_s", "{:,}"), ("step s", "step_s_mean", "{:.3f}"),
                   ("pred s", "predicted_step_s_mean", "{:.3f}"), ("timed", "timed_steps", "{}"),
                   ("mb/step", "microbatches_per_step", "{}"), ("new shapes", "new_shapes_per_step", "{}"),
                   ("hdr/step", "header_recvs_per_step", "{}"), ("hdr ms", "header_wait_ms_per_step", "{}"),
                   ("allocs", "device_allocs_per_step", "{}"), ("compiles", "compiles_timed", "{}"),
                   ("peak GB", "peak_memory_gb", "{}"),
                   ("set-up s", "setup_s", "{}"), ("variant s", "variant_s", "{}")]


def lightning_table(paths: list[Path]) -> str:
    """The lightning engine's result files as one Markdown table, a row per variant (a missing or unreadable file
    is a row saying so), then each planned variant against the best setting of each fixed batching, per file."""
    lines = ["| " + " | ".join(h for h, _, _ in LIGHTNING_TABLE) + " | status |", "|" + "---|" * (len(LIGHTNING_TABLE) + 1)]
    ratios = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            lines.append(f"| {Path(path).name}: no rows ({type(err).__name__}) |")
            continue
        model = doc.get("args", {}).get("model", "?")
        rows = list(doc.get("results", []))
        try:  # the variants asked for that a killed launch never started
            asked = ast.literal_eval(doc.get("args", {}).get("variants", "[]"))
        except (ValueError, SyntaxError):
            asked = []
        done = {r.get("variant") for r in rows}
        pp = doc.get("args", {}).get("pp", "?")
        schedule = doc.get("args", {}).get("schedule", "1f1b")
        rows += [{"variant": v, "pp": pp, "dp": rows[0].get("dp", "?") if rows else "?",
                  "error": f"{CUT} (not started)"} for v in asked if v not in done]
        for r in rows:
            r = {"model": model, **r}
            ok = not r.get("error")
            r.setdefault("schedule", schedule)  # rows of earlier files (1F1B) and of variants never started
            cells = [fmt.format(r[key]) if ok and r.get(key) is not None or key in ("model", "pp", "dp", "schedule",
                                                                                   "variant")
                     else "" for _, key, fmt in LIGHTNING_TABLE]
            status = "ok" if ok else " ".join(str(r["error"]).split()).replace("|", "/")[:120]
            if ok and r.get("stopped_by_budget"):
                status = f"ok, stopped by budget after {r.get('timed_steps')} timed"
            lines.append("| " + " | ".join(cells) + f" | {status} |")
        speed = {r["variant"]: r.get("useful_tokens_per_s") for r in rows if not r.get("error")}
        ratios += [f"{model} pp={pp} {schedule}: {line}" for line in against_best(speed)]
    return "\n".join(lines + ratios)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["direct", "lightning"], default="direct")
    parser.add_argument("--model", choices=["gpt", "t5"], default="gpt")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--variants", nargs="+",
                        default=["padding@4", "packing@1", "packing@2", "token_budget@16384", "dynamic"])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--target-length", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="padding/packing without @N")
    parser.add_argument("--token-budget", type=int, default=16384, help="token_budget without @N")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="dynamic: budget as a fraction of the card")
    parser.add_argument("--profile", default="none", help="dynamic's cost model: none (analytic), measure, or a file")
    parser.add_argument("--auto-candidates", nargs="+", default=None, metavar="CANDIDATE",
                        help="auto: the candidates it chooses among (default: lightning_3d.dynamic.choice's"
                             " default_candidates), e.g. dynamic packed_dynamic packing@2 packing@4 token_budget@16384")
    parser.add_argument("--profile-sizes", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--profile-lens", default="16,32,64,128,256,512,1024,2048")
    parser.add_argument("--num-samples", type=int, default=20000)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--prepare-only", action="store_true", help="only build the data cache (before torchrun)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--devices", type=int, default=1, help="lightning engine: processes (torchrun's count)")
    parser.add_argument("--pp", type=int, default=1, help="lightning engine: pipeline stages")
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES),
                        help="lightning engine: the pipeline schedule (planned variants plan for it)")
    parser.add_argument("--virtual-stages", type=int, default=None,
                        help="lightning engine: stages per rank for interleaved schedules (the strategy's default: 2)")
    parser.add_argument("--compression", action="store_true", help="lightning engine: Optimus-CC compression on, CB"
                        " forced on the pipeline's sends (its 'auto' skips fast links), SC by its default link rule;"
                        " off by default")
    parser.add_argument("--shard-optimizer-state", action="store_true", help="lightning engine: ZeRO-1, the optimizer"
                        " state sharded over the data-parallel replicas")
    parser.add_argument("--compile", action="store_true", help="lightning engine: the recipe compiles its blocks"
                        " (compile=True); planned variants and predictions use the profile's compiled grids where it"
                        " has them (`lightning-3d profile --compile`); with --plans-only, the plans a compiled run"
                        " makes (full packed rows, compiled prices)")
    parser.add_argument("--num-workers", type=int, default=2, help="lightning engine: DataLoader workers")
    parser.add_argument("--sdpa", nargs="+", choices=SDPA_CHOICES, default=[DIRECT_SDPA],
                        help="direct engine: the recipe's sdpa_backends (no_cudnn, the default, or torch) and/or"
                             " flash_first (an experiment: see sdpa_context); every variant runs under each (the"
                             " lightning engine runs the recipes' 'auto': no_cudnn for padding, token_budget and"
                             " dynamic, torch for packing; its rows' sdpa_backends)")
    parser.add_argument("--plans-only", action="store_true",
                        help="print every variant's micro-batch shapes per step (and dynamic's predicted step time);"
                             " no model runs (CPU)")
    parser.add_argument("--card-gb", type=float, default=80.0, help="--plans-only: the card the budget assumes")
    parser.add_argument("--repeat", action="store_true",
                        help="direct engine: time the same steps a second time (every shape already seen)")
    parser.add_argument("--deadline-at", type=float, default=None,
                        help="lightning engine: wall-clock time (seconds since the epoch) by which every variant has"
                             " ended; a variant with less than --min-variant-s left is skipped (row 'skipped: budget'),"
                             " a running one stops before a step that would end past it (its finished steps count)")
    parser.add_argument("--teardown-s", type=float, default=12.0,
                        help="lightning engine: seconds before --deadline-at kept free for the last variant's teardown"
                             " and the processes' exit")
    parser.add_argument("--min-variant-s", type=float, default=20.0,
                        help="lightning engine: start a variant only with this much time left before --deadline-at")
    parser.add_argument("--variant-budget-s", nargs="*", default=[], metavar="[NAME=]SECONDS",
                        help="lightning engine: a variant's wall-time budget, set-up included (NAME: padding,"
                             " packing, token_budget, dynamic or a full variant text; a bare number for all)")
    parser.add_argument("--steps-for", nargs="*", default=[], metavar="NAME=TIMED/WARMUP",
                        help="lightning engine: timed and warm-up steps of a variant, e.g. padding=2/1 (else"
                             " --steps/--warmup)")
    parser.add_argument("--table", nargs="+", type=Path, metavar="JSON",
                        help="print the lightning rows of these result files as one table (no run)")
    parser.add_argument("--gradient-accumulation-fusion", choices=("auto", "true", "false"), default="auto",
                        help="direct engine: the strategy's gradient_accumulation_fusion for the model's linears")
    parser.add_argument("--kernel-table", action="store_true",
                        help="direct engine on a GPU: profile one more step per variant, its kernels' device time by"
                             " kind and name beside the step's wall time (row 'kernels')")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--accelerator", default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "multitask_microbatching.json")
    args = parser.parse_args()
    if args.table:
        print(lightning_table(args.table), flush=True)
        return
    if args.compile and args.engine != "lightning" and not args.plans_only:
        raise SystemExit("--compile runs with --engine lightning only (the direct engine builds its model outside a"
                         " Trainer, which is where the recipes compile their blocks)")
    if args.engine == "lightning" and args.profile == "measure":
        raise SystemExit("--profile measure runs with --engine direct only: measure the profile there (or with"
                         " `lightning-3d profile`) and pass its file to --engine lightning as --profile FILE")
    for v in args.variants:  # bad options fail on every rank before any process group exists
        parse_variant(v)
        steps_of(args, v)
        budget_of(args, v)
    if args.prepare_only:  # build the tokenizer and samples cache once, before several processes read it
        data_module(args).setup("fit")
        print(json.dumps({"prepared": args.model, "cache_dir": args.cache_dir}), flush=True)
        return
    if args.engine == "lightning" and "MASTER_PORT" not in os.environ:
        with socket.socket() as s:  # a one-process group for the strategy
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    start = time.perf_counter()
    if args.plans_only:
        plans(args)
        return
    results = direct(args) if args.engine == "direct" else lightning(args)
    summary = {"model": args.model, "preset": args.preset, "engine": args.engine, "pp": args.pp,
               "seconds": round(time.perf_counter() - start, 1)}
    for order in args.sdpa if args.engine == "direct" else [DIRECT_SDPA]:
        # Ratios within one SDPA order; with several orders each key names its order.
        rows = [r for r in results if r.get("sdpa", DIRECT_SDPA) == order and not r["error"]]
        base = next((r["useful_tokens_per_s"] for r in rows if r["variant"].startswith("padding")), None)
        packed = [r["useful_tokens_per_s"] for r in rows if r["variant"].startswith("packing")]
        # The dense-mask packing alone: the baseline of the runs before FlexAttention packing existed.
        dense = [r["useful_tokens_per_s"] for r in rows
                 if r["variant"].startswith("packing") and r.get("attention") == "sdpa dense mask"]
        for r in (r for r in rows if r["variant"].partition("@")[0] in PLANNED):
            key = r["variant"].replace("@", "_") + ("" if len(args.sdpa) == 1 else f"_{order}")
            dyn = r["useful_tokens_per_s"]
            summary[f"{key}_vs_padding"] = round(dyn / base, 2) if dyn and base else None
            summary[f"{key}_vs_best_packing"] = round(dyn / max(packed), 2) if dyn and packed else None
            budgeted = [r["useful_tokens_per_s"] for r in rows if r["variant"].startswith("token_budget")]
            summary[f"{key}_vs_best_token_budget"] = round(dyn / max(budgeted), 2) if dyn and budgeted else None
            if dense and len(dense) < len(packed):
                summary[f"{key}_vs_best_dense_packing"] = round(dyn / max(dense), 2) if dyn else None
    if int(os.environ.get("RANK", "0")) == 0:
        if args.engine == "direct":
            print(table(results), flush=True)
        print(json.dumps({"summary": summary}), flush=True)
        write_rows(args, results, None, final=True, summary=summary)


if __name__ == "__main__":
    main()
