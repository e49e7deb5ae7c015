"""FlexAttention packing on the device it is meant for: GPT's ``packed_attention="flex"`` against ``"sdpa"`` (the
dense mask) on the same packed micro-batches, through every path the CPU suite only runs with torch's reference math
kernels (docs/multitask.md): eager blocks (flex compiled on its own), activation checkpointing, compiled blocks,
a compiled stage, and bf16 autocast. Prints one JSON line per check and a summary line.

Per variant, one forward and backward over the same micro-batches (the last one has fewer rows, as the last packed
micro-batch of a step often has, so the batch size changes), against the ``sdpa`` model with the same weights:
``logits`` and ``grads`` are the largest differences relative to the reference's scale; ``bound`` is the fp32
summation-order bound of tests/tolerance.py (2 · reductions · longest · 2^-24; gradients times the tokens scored, as
tests/test_multitask.py), and ``ok`` says whether the fp32 variants are within it. Under bf16 autocast the
differences are reported, not judged (both sides round to bf16, 2^-8 relative, in different places).
``recompiles``: graphs torch.compile built in a second pass over other documents of the same shapes (expected 0: the
document ids are an input of flex's graph and of the CUDA block-mask builder's, not a guard). Also the ``"auto"``
resolution for heads narrower than
inductor's CUDA kernel takes, and the refusal of ``"flex"`` there.

    python benchmarks/dynamic/flex_packing_check.py                     # CUDA: tiny-ish GPT, rows of 1,024 tokens
    python benchmarks/dynamic/flex_packing_check.py --variants flex+compiled_stage --no-bf16   # a part of it
    python benchmarks/dynamic/flex_packing_check.py --device cpu        # smoke: aot_eager, CPU's refusal of flex's backward lifted
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

import lightning_3d.recipes.gpt.model as gpt_model  # noqa: E402
from lightning_3d.recipes.data.multitask_batching import StepCollator  # noqa: E402
from lightning_3d.recipes.gpt.config import preset  # noqa: E402
from lightning_3d.recipes.gpt.parallelize import GPTStage  # noqa: E402
from lightning_3d.recipes.training import IGNORE_INDEX, compile_blocks, summed_token_cross_entropy  # noqa: E402

U = 2.0**-24  # fp32 unit roundoff (tests/tolerance.py)


VARIANTS = [("sdpa", "sdpa"), ("flex", "flex"), ("flex+ac", "flex", True), ("flex+compiled_blocks", "flex", False, "block"),
            ("flex+ac+compiled_blocks", "flex", True, "block"), ("flex+compiled_stage", "flex", False, "stage")]
VARIANT_NAMES = [v[0] for v in VARIANTS]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--seq-length", type=int, default=None, help="packed row length (default 1024 on cuda, 256 on cpu)")
    p.add_argument("--hidden-size", type=int, default=None, help="default 256 on cuda (4 heads of 64), 64 on cpu")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=None, help="samples packed (default 96 on cuda, 64 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=None, choices=VARIANT_NAMES,
                   help="run only these (fp32, and bf16 where it applies); the sdpa reference always runs")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 only (CUDA runs bf16 autocast too)")
    return p.parse_args(argv)


def samples(n: int, longest: int, vocab: int, seed: int) -> list[dict]:
    """Multi-task-like samples (prompt + target + EOS) of 8 to ``longest`` tokens."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        total = int(g.integers(8, longest + 1))
        prompt = int(g.integers(1, total - 1))
        out.append({"tokens": np.concatenate([g.integers(1, vocab, total - 1), [0]]), "prompt": prompt})
    return out


def microbatches(args, vocab: int, seed: int) -> list[dict]:
    """Two packed micro-batches of 3 rows and one of 2 (the same shapes for every seed, so a second pass over other
    documents shows recompiles for documents only; 2, not 1, rows: dynamo specialises sizes of 1)."""
    collator = StepCollator("gpt", "packing", 1, 0, seq_length=args.seq_length, target_length=0, pad_id=0,
                            micro_batch_size=3, token_budget=None)
    mbs = collator.microbatches(samples(args.samples, args.seq_length // 3, vocab, seed))
    if len(mbs) < 4:
        raise SystemExit(f"--samples {args.samples} packs into {len(mbs)} micro-batches of rows of {args.seq_length}"
                         " tokens; 4 are needed (3 full ones): give more samples")
    mbs = [mbs[0], mbs[1], {k: v[:2] for k, v in mbs[2].items()}]
    return [{k: v.to(args.device) for k, v in mb.items()} for mb in mbs]


def build(args, packed_attention: str, activation_checkpointing: bool = False, hidden: int | None = None,
          heads: int = 4) -> gpt_model.GPTModel:
    config = preset("tiny", vocab_size=1000, seq_length=args.seq_length, num_layers=args.num_layers,
                    hidden_size=hidden or args.hidden_size, num_heads=heads)
    model = gpt_model.GPTModel(config, packed_attention=packed_attention,
                               activation_checkpointing=activation_checkpointing)
    model.init_weights(7)
    return model.to(args.device)


def run(forward, model: torch.nn.Module, mbs: list[dict], autocast: bool, device: str):
    """Summed-token loss, logits and gradients of one forward and backward over ``mbs``."""
    model.zero_grad(set_to_none=True)
    logits, loss = [], 0.0
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        for mb in mbs:
            out = forward(mb)[..., :1000]
            loss = loss + summed_token_cross_entropy(out.float(), mb["labels"])
            logits.append(out.detach().float())
    loss.backward()
    return loss.detach(), logits, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    args.seq_length = args.seq_length or (1024 if cuda else 256)
    args.hidden_size = args.hidden_size or (256 if cuda else 64)
    args.samples = args.samples or (96 if cuda else 64)
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu for the smoke run")
    if not cuda:  # CPU has no flex backward: torch's reference math kernels, as the CPU suite runs them
        from tests.flex_cpu import allow_flex_backward_on_cpu

        allow_flex_backward_on_cpu()
    torch.manual_seed(args.seed)
    mbs, others = microbatches(args, 1000, args.seed), microbatches(args, 1000, args.seed + 1)
    n_tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in mbs)
    longest = max(4 * args.hidden_size, args.seq_length)
    bound = 2 * (9 * args.num_layers + 2) * longest * U
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "microbatches": [list(mb["input_ids"].shape) for mb in mbs], "tokens_scored": n_tokens,
                      "documents_per_row": round(float(np.mean([int(r.max()) + 1 for mb in mbs
                                                                 for r in mb["document_ids"]])), 1),
                      "bound": bound}), flush=True)

    def model_forward(model):
        return lambda mb: model(mb["input_ids"], mb["position_ids"], mb["document_ids"])

    def stage_forward(stage):
        return lambda mb: stage(microbatch=mb)

    def variant(name: str, attention: str, ac: bool = False, compile_scope: str | None = None) -> tuple:
        model = build(args, attention, ac)
        forward = model_forward(model)
        if compile_scope == "block":
            compile_blocks(model.layers.values())
        elif compile_scope == "stage":
            stage = GPTStage(model, range(args.num_layers), first=True, last=True)
            compile_blocks([stage])
            forward = stage_forward(stage)
        return name, model, forward

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    references = {}
    failures = []
    variants = [v for v in VARIANTS if v[0] == "sdpa" or args.variants is None or v[0] in args.variants]
    for autocast in ([False, True] if cuda and args.bf16 else [False]):
        for spec in variants:
            if autocast and spec[0] not in ("sdpa", "flex", "flex+compiled_blocks"):
                continue
            label = spec[0] + ("+bf16" if autocast else "")
            row = {"variant": label}
            try:
                name, model, forward = variant(*spec)
                start = time.perf_counter()
                loss, logits, grads = run(forward, model, mbs, autocast, args.device)
                sync()
                row["first_pass_s"] = round(time.perf_counter() - start, 2)  # includes compiles
                before = graphs()
                start = time.perf_counter()
                run(forward, model, others, autocast, args.device)
                sync()
                row["second_pass_s"] = round(time.perf_counter() - start, 3)
                row["recompiles"] = graphs() - before
                if spec[0] == "sdpa":
                    references[autocast] = (loss, logits, grads)
                else:
                    ref_loss, ref_logits, ref_grads = references[autocast]
                    row["loss_diff"] = abs(float(loss - ref_loss)) / n_tokens
                    row["logits"] = max(scaled(a, b) for a, b in zip(logits, ref_logits, strict=True))
                    row["grads"] = max(scaled(grads[k], g) for k, g in ref_grads.items())
                    if not autocast:
                        row["ok"] = row["logits"] <= bound and row["grads"] <= n_tokens * bound
                if row.get("ok") is False or (spec[0] != "sdpa" and row["recompiles"]):
                    failures.append(label)
            except Exception as err:  # noqa: BLE001 - reported per variant, the others still run
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                failures.append(label)
            print(json.dumps(row), flush=True)

    # Heads narrower than inductor's CUDA flex kernel takes: "auto" keeps the dense mask, "flex" is refused.
    narrow = {"variant": "head_dim_8"}
    try:
        model = build(args, "auto", hidden=32, heads=4)
        model(mbs[0]["input_ids"], mbs[0]["position_ids"], mbs[0]["document_ids"]).sum().backward()
        narrow["auto"] = "ran"
        device = torch.device(args.device)
        narrow["auto_resolves_to"] = gpt_model.resolve_packed_attention("auto", device, 0.0, 8)
        try:
            gpt_model.resolve_packed_attention("flex", device, 0.0, 8)
            narrow["flex"] = "accepted" + ("" if cuda else " (cpu: its kernel takes narrow heads)")
        except ValueError as err:
            narrow["flex"] = f"refused: {str(err)[:80]}"
    except Exception as err:  # noqa: BLE001
        narrow["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        failures.append("head_dim_8")
    print(json.dumps(narrow), flush=True)
    print(json.dumps({"summary": "ok" if not failures else "FAILED", "failed": failures}), flush=True)


if __name__ == "__main__":
    main()
