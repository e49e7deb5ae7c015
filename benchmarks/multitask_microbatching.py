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
forward and loss. Collation and planning are not timed for any variant (the dynamic planner runs ahead of training
in DataLoader workers: ``benchmarks/dynamic_gpu.py`` measures that no step waits for it).

``--engine lightning``: ``Trainer.fit`` with ``Compressed3DStrategy(pipeline_parallel_size=--pp)`` on ``--devices``
processes per variant (start it with torchrun for several GPUs; rank 0 prints), the data module with
``--num-workers`` DataLoader workers; the dynamic variant reports its ``plan_waits``. Step times come from a
synchronised per-step clock after ``--warmup`` steps.

    python benchmarks/multitask_microbatching.py --engine direct --model gpt --preset 1.3b \
        --variants padding@4 packing@1 packing@2 packing@2:sdpa token_budget@16384 dynamic --out $OUT/multitask_gpt.json
    torchrun --nproc_per_node 4 benchmarks/multitask_microbatching.py --engine lightning --devices 4 --pp 2 ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_3d.recipes import GPT, T5  # noqa: E402
from lightning_3d.recipes.data.multitask import MultiTaskDataModule  # noqa: E402
from lightning_3d.recipes.data.multitask_batching import (  # noqa: E402
    StepCollator, sample_input_length, sample_lengths, sample_target_length)
from lightning_3d.recipes.gpt.model import PACKED_ATTENTION, resolve_packed_attention  # noqa: E402


def parse_variant(text: str) -> tuple[str, int | None]:
    """``padding@N`` -> ("padding", N); ``dynamic`` -> ("dynamic", None) (plans with ``--profile``);
    ``dynamic@analytic`` -> ("dynamic", None) planned with the analytic cost model whatever ``--profile`` says;
    ``packing@N:sdpa`` / ``packing@N:flex`` -> ("packing", N) with that packed attention (:func:`packed_attention_of`)."""
    packed_attention_of(text)
    name, _, size = text.partition(":")[0].partition("@")
    if name not in ("padding", "packing", "token_budget", "dynamic"):
        raise SystemExit(f"unknown variant {text!r}: use padding@N, packing@N, token_budget@N, dynamic or"
                         " dynamic@analytic")
    if name == "dynamic":
        if size not in ("", "analytic"):
            raise SystemExit(f"unknown variant {text!r}: dynamic takes no size; use dynamic or dynamic@analytic")
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
    """What a variant's attention runs, for the table: GPT packing's resolved packed attention, else the mask kind."""
    if model_type == "t5":
        return "sdpa+doc mask" if name == "packing" else "sdpa+pad mask"  # T5 masks encoder padding, packing: pairs
    if name != "packing":
        return "sdpa causal"
    return "flex block mask" if resolve_packed_attention(attention, torch.device(device), dropout, head_dim) == "flex" \
        else "sdpa dense mask"


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
         ("predicted s", "predicted_step_s_mean", "{:.3f}"), ("mb/step", "microbatches_per_step", "{}"),
         ("shapes", "shapes_per_step", "{}"), ("new shapes", "new_shapes_per_step", "{}"),
         ("padding", "padding_fraction", "{:.1%}"), ("dev allocs", "device_allocs_per_step", "{}"),
         ("peak GB", "peak_memory_gb", "{}"), ("timed compiles", "compiles_timed", "{}")]


def table(rows: list[dict]) -> str:
    """The direct engine's rows as a compact Markdown table (stdout; the JSON lines carry the same numbers)."""
    lines = ["| " + " | ".join(h for h, _, _ in TABLE) + " |", "|" + "---|" * len(TABLE)]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['variant']} | {r.get('sdpa', '')} | {r.get('attention', '')} | error: {r['error'][:120]} |")
            continue
        cells = [fmt.format(r[key]) if r.get(key) is not None else "" for _, key, fmt in TABLE]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sdpa_context(name: str):
    """``--sdpa``: ``torch`` runs the recipe's attention under torch's own backend order; ``flash_first`` runs the
    whole variant (forward, loss, backward and any recomputation) under the order flash, efficient, cuDNN, math. An
    experiment, not the recipe's setting: cuDNN's attention builds an execution graph per new shape, which changing
    micro-batch shapes would pay again and again if torch's order chose it (docs/dynamic.md)."""

    if name == "torch":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.MATH], set_priority=True)


class ProfiledData(MultiTaskDataModule):
    """The data module with a given cost model for dynamic micro-batching (the module itself plans with the
    analytic one)."""

    cost_model = None

    def _dynamic_planner(self, collator, dp, rank):
        batcher = super()._dynamic_planner(collator, dp, rank)
        if self.cost_model is not None:
            batcher.options["cost_model"] = self.cost_model
        return batcher


def data_module(args, microbatching: str = "padding", size: int | None = None, **extra) -> MultiTaskDataModule:
    budget = size if microbatching == "token_budget" else args.token_budget
    return ProfiledData(
        model_type=args.model, num_samples=args.num_samples, tokenizer="bpe", tokenizer_vocab_size=args.vocab_size,
        seq_length=args.seq_length, target_length=args.target_length, global_batch_size=args.global_batch,
        microbatching=microbatching, micro_batch_size=size or args.micro_batch_size, token_budget=budget,
        val_fraction=0.0, seed=args.seed, cache_dir=args.cache_dir, **extra)


def build_model(args, data: MultiTaskDataModule, packed_attention: str = "auto"):
    if args.model == "gpt":
        return GPT(args.preset, vocab_size=data.vocab_size, seq_length=args.seq_length, packed_attention=packed_attention)
    return T5(args.preset, vocab_size=data.vocab_size, pad_token_id=data.pad_token_id, eos_token_id=data.eos_token_id)


def cost_model_for(args, module, shape):
    """``--profile``: none (analytic), a file, or ``measure`` (the recipe's layers on this GPU, a grid that covers
    the multi-task lengths; written to ``$OUT/profile_<model>_<preset>.json``)."""
    from lightning_3d.costs import ProfiledCostModel
    from lightning_3d.dynamic import default_cost_model

    if args.profile == "none":
        return default_cost_model(shape)
    if args.profile != "measure":
        return ProfiledCostModel(args.profile)
    from lightning_3d.planner.profile import profile_model

    path = "lightning_3d.recipes.GPT" if args.model == "gpt" else "lightning_3d.recipes.T5"
    init = {"preset_name": args.preset, "vocab_size": module.config.vocab_size}
    data = {"seq_length": args.seq_length, "target_length": args.target_length}
    if args.model == "gpt":
        init["seq_length"] = args.seq_length
    config = {"model": {"class_path": path, "init_args": init}, "data": {"init_args": data},
              "trainer": {"precision": "bf16-mixed" if torch.cuda.is_available() else "32-true"}}
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


# ----- direct engine: one model, every variant on the same batches ----------------------------------------------
def direct(args) -> list[dict]:
    from lightning_3d.costs import model_shape
    from lightning_3d.dynamic import DynamicMicroBatcher, default_cost_model
    from lightning_3d.recipes.t5.model import run_stage

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    data = data_module(args)
    data.setup("fit")
    module = build_model(args, data)
    module.configure_model()
    model = module.model.to(device).train()
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
    cost_model = cost_model_for(args, module, shape) if "dynamic" in args.variants else None
    analytic = default_cost_model(shape)
    results = []
    seen: set = set()
    cuda_stats = (lambda: torch.cuda.memory_stats()) if cuda else (lambda: {})
    for sdpa, text in [(o, v) for o in args.sdpa for v in args.variants]:
        name, size = parse_variant(text)
        attention = packed_attention_of(text)
        row = {"variant": text, "sdpa": sdpa, "error": None,
               "attention": attention_label(args.model, name, attention, device, module.config.dropout,
                                            module.config.head_dim)}
        backend_order = contextlib.ExitStack()
        try:
            backend_order.enter_context(sdpa_context(sdpa))
            if args.model == "gpt":
                model.packed_attention = attention
            collator: StepCollator = data_module(args, name if name != "dynamic" else "padding", size).collator(1, 0)
            plan_s = 0.0
            if name == "dynamic":
                t5 = args.model == "t5"
                collator.dynamic = DynamicMicroBatcher(
                    collator.collate, shape=shape, dp=1, pp=1, dp_rank=0, memory_budget=budget,
                    cost_model=analytic if text == "dynamic@analytic" else cost_model,
                    max_seq_len=args.seq_length, max_target_len=args.target_length if t5 else None,
                    input_length=sample_input_length, target_length=sample_target_length if t5 else None)
                collator.microbatching = "dynamic"
            steps, predicted = [], []
            for b in batches:
                start = time.process_time()
                planned = collator(b)
                plan_s += time.process_time() - start
                steps.append(list(planned))
                if name == "dynamic":
                    predicted.append(planned.plan.makespan)
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
            if predicted:  # the cost model's simulated step time, against the measured one
                row["predicted_step_s_mean"] = round(float(np.mean(predicted[timed])), 4)
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
    from lightning_3d.dynamic import DynamicMicroBatcher, default_cost_model

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
    rows = []
    for text in args.variants:
        name, size = parse_variant(text)
        collator = data_module(args, name if name != "dynamic" else "padding", size).collator(1, 0)
        if name == "dynamic":
            t5 = args.model == "t5"
            collator.dynamic = DynamicMicroBatcher(
                collator.collate, shape=shape, dp=1, pp=1, dp_rank=0, memory_budget=budget,
                cost_model=default_cost_model(shape) if text == "dynamic@analytic" or cost_model is None else cost_model,
                max_seq_len=args.seq_length, max_target_len=args.target_length if t5 else None,
                input_length=sample_input_length, target_length=sample_target_length if t5 else None)
            collator.microbatching = "dynamic"
        for k, b in enumerate(batches):
            step = collator(b)
            row = {"variant": text, "step": k, "shapes": [list(mb["input_ids"].shape) for mb in step]}
            if name == "dynamic":
                row["predicted_step_s"] = round(step.plan.makespan, 4)
                row["cost_source"] = step.plan.cost_source
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# ----- lightning engine: Trainer.fit per variant, any number of processes and pipeline stages ---------------------
def lightning(args) -> list[dict]:
    import lightning.pytorch as pl

    from lightning_3d import Compressed3DStrategy

    class StepClock(pl.Callback):
        """Wall time of every training step (synchronised on GPU)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)

    world = int(os.environ.get("WORLD_SIZE", args.devices))
    probe = data_module(args)  # the vocabulary (the data must be prepared: --prepare-only first)
    card = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 64 * 2**30
    # The activation budget: the card's fraction less fp32 weights, gradients and AdamW state of a pipeline stage.
    params = build_model(args, probe).config.num_parameters()
    budget_gb = (args.memory_fraction * card - 16 * params / args.pp) / 2**30
    results = []
    for text in args.variants:
        name, size = parse_variant(text)
        row = {"variant": text, "pp": args.pp, "dp": world // args.pp, "error": None}
        try:
            model = build_model(args, probe, packed_attention_of(text))
            extra = {"memory_budget_gb": budget_gb} if name == "dynamic" else {}
            data = data_module(args, name, size, num_workers=args.num_workers, **extra)
            if name == "dynamic" and args.profile not in ("none", "measure"):
                from lightning_3d.costs import ProfiledCostModel

                data.cost_model = ProfiledCostModel(args.profile)
            clock = StepClock()
            strategy = Compressed3DStrategy(pipeline_parallel_size=args.pp, compression=False)
            trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, precision=args.precision,
                                 max_steps=args.steps, strategy=strategy, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                                 limit_val_batches=0)
            trainer.fit(model, datamodule=data)
            # Every variant's step k trains the same global batch: its useful tokens, from the sampler's order.
            sampler = trainer.train_dataloader.sampler
            indices = list(iter(sampler))[: args.steps * args.global_batch]
            useful = [sum(sum(sample_lengths(data.train_dataset[i])) for i in indices[k * args.global_batch:
                                                                                      (k + 1) * args.global_batch])
                      for k in range(len(clock.times))]
            timed = slice(args.warmup, None)
            seconds = sum(clock.times[timed])
            row.update({"useful_tokens_per_s": round(sum(useful[timed]) / seconds) if seconds else None,
                        "step_s_mean": round(seconds / max(1, len(clock.times[timed])), 4),
                        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                        if torch.cuda.is_available() else None})
            if data.plan_waits is not None and name == "dynamic":
                row["plan_waits"] = data.plan_waits.summary()
        except Exception as err:  # noqa: BLE001 - one failing variant (e.g. out of memory) must not lose the others
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        finally:
            # The process group stays: the next variant's Trainer reuses it (a new one after destroying it cannot
            # rendezvous again under torchrun).
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        results.append(row)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"model": args.model, **row}), flush=True)
    return results


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
    parser.add_argument("--num-workers", type=int, default=2, help="lightning engine: DataLoader workers")
    parser.add_argument("--sdpa", nargs="+", choices=["torch", "flash_first"], default=["torch"],
                        help="direct engine: attention's SDPA backend order, torch's own and/or flash first (an"
                             " experiment: see sdpa_context); every variant runs under each")
    parser.add_argument("--plans-only", action="store_true",
                        help="print every variant's micro-batch shapes per step (and dynamic's predicted step time);"
                             " no model runs (CPU)")
    parser.add_argument("--card-gb", type=float, default=80.0, help="--plans-only: the card the budget assumes")
    parser.add_argument("--repeat", action="store_true",
                        help="direct engine: time the same steps a second time (every shape already seen)")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--accelerator", default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "multitask_microbatching.json")
    args = parser.parse_args()
    for v in args.variants:
        parse_variant(v)
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
    for order in args.sdpa if args.engine == "direct" else ["torch"]:
        # Ratios within one SDPA order; with several orders each key names its order.
        rows = [r for r in results if r.get("sdpa", "torch") == order and not r["error"]]
        base = next((r["useful_tokens_per_s"] for r in rows if r["variant"].startswith("padding")), None)
        packed = [r["useful_tokens_per_s"] for r in rows if r["variant"].startswith("packing")]
        # The dense-mask packing alone: the baseline of the runs before FlexAttention packing existed.
        dense = [r["useful_tokens_per_s"] for r in rows
                 if r["variant"].startswith("packing") and r.get("attention") == "sdpa dense mask"]
        for r in (r for r in rows if r["variant"].startswith("dynamic")):
            key = r["variant"].replace("@", "_") + ("" if len(args.sdpa) == 1 else f"_{order}")
            dyn = r["useful_tokens_per_s"]
            summary[f"{key}_vs_padding"] = round(dyn / base, 2) if dyn and base else None
            summary[f"{key}_vs_best_packing"] = round(dyn / max(packed), 2) if dyn and packed else None
            if dense and len(dense) < len(packed):
                summary[f"{key}_vs_best_dense_packing"] = round(dyn / max(dense), 2) if dyn else None
    if int(os.environ.get("RANK", "0")) == 0:
        if args.engine == "direct":
            print(table(results), flush=True)
        print(json.dumps({"summary": summary}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                        "results": results}, indent=1))


if __name__ == "__main__":
    main()
