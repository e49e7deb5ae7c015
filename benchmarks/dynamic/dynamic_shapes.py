"""What a new micro-batch shape costs the attention kernels (dynamic micro-batches ran far slower per token
than packed rows of one fixed shape).

For the attention geometry of a GPT preset (heads, head dim; bf16 on CUDA), a sequence of micro-batch shapes
(batch, length) with about ``--tokens`` tokens each, every one new to the process, runs causal
``scaled_dot_product_attention`` forward and backward under each SDPA backend order:

- ``torch``: torch's own priority order (what the GPT recipe runs);
- ``flash_first``: the order flash, efficient, cuDNN, math (``FLASH_FIRST``);
- ``cudnn``, ``flash``, ``efficient``, ``math``: that backend alone.

Each shape runs twice: the first call pays whatever the backend sets up per shape (cuDNN builds an execution graph;
flash attention and the efficient kernel set up nothing), the second is the steady state. Printed per order, one JSON
line: median first-call and repeat milliseconds, their ratio, the total over all shapes, and the attention kernels
the first shape launched (profiler kernel names, so the line says which backend torch's order chose). An order whose
backend cannot run the inputs (say cuDNN off this build) reports its error instead.

``--parts model``: the whole GPT preset (bf16 autocast, fp32 weights, as ``multitask_microbatching.py --engine
direct`` trains it), forward, loss and backward of one micro-batch per shape of ``--model-shapes`` (default: a dynamic
plan's and a token-budget plan's micro-batches of the multi-task mix, GPT-1.3B, analytic cost model), first call and
repeat, under the ``torch`` and ``flash_first`` orders; per order one JSON line with every shape's milliseconds, and for the
slowest first call a profile of a fresh shape of the same kind: the top host operators by self time and the top device
kernels (what the time went to, whatever it is).

``--parts packed``: packing's attention (two rows of documents) under the dense document mask, under FlexAttention's
block mask (the GPT recipe's ``packed_attention="flex"``, CUDA), and causal attention over the same rows, so the
packing baselines' attention costs are known (see :func:`packed_part`).

    python benchmarks/dynamic/dynamic_shapes.py --preset 1.3b --tokens 4096 --shapes 24
    python benchmarks/dynamic/dynamic_shapes.py --device cpu --preset tiny --tokens 256 --shapes 4 --orders torch math
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from lightning_3d.recipes.gpt import model as gpt_model  # noqa: E402
from lightning_3d.recipes.gpt.config import preset  # noqa: E402

FLASH_FIRST = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
SINGLE = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def shapes(tokens: int, count: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """``count`` distinct (batch, length) shapes of about ``tokens`` tokens, lengths multiples of 8 spread over
    [16, max_len] in a seeded order (as a dynamic plan's micro-batches come)."""
    gen = torch.Generator().manual_seed(seed)
    lens = sorted({max(16, min(max_len, 8 * round(float(x) / 8))) for x in torch.logspace(
        4, torch.log2(torch.tensor(float(max_len))).item(), 4 * count, base=2)})
    pick = [lens[int(i)] for i in torch.randperm(len(lens), generator=gen)[:count]]
    out, seen = [], set()
    for s in pick:
        b = max(1, tokens // s)
        if (b, s) not in seen:
            seen.add((b, s))
            out.append((b, s))
    return out


def attention_call(q, k, v, order: str) -> None:
    """One causal forward and backward under ``order``."""
    def run():
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(torch.ones_like(y))

    if order == "torch":
        run()
    else:
        with sdpa_kernel(FLASH_FIRST if order == "flash_first" else [SINGLE[order]], set_priority=order == "flash_first"):
            run()


def kernels_of(fn, device: str) -> list[str]:
    """Names of the attention-looking device kernels ``fn`` launches (which backend ran)."""
    if device != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    keys = ("attn", "attention", "fmha", "flash", "cudnn", "sdpa", "softmax", "bmm", "gemm")
    names = sorted({e.key for e in prof.key_averages() if any(k in e.key.lower() for k in keys)})
    return [n[:80] for n in names[:6]]


def measure(order: str, shape_list, heads: int, head_dim: int, device: str, dtype) -> dict:
    first, repeat = [], []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kernels = None
    for b, s in shape_list:
        q, k, v = (torch.randn(b, s, heads, head_dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
                   for _ in range(3))  # the model's (batch, heads, seq, dim) view of (batch, seq, heads, dim)
        for times in (first, repeat):
            sync()
            start = time.perf_counter()
            attention_call(q, k, v, order)
            sync()
            times.append(1000 * (time.perf_counter() - start))
        if kernels is None:
            kernels = kernels_of(lambda: attention_call(q, k, v, order), device)
    f, r = statistics.median(first), statistics.median(repeat)
    return {"order": order, "first_ms_median": round(f, 3), "repeat_ms_median": round(r, 3),
            "first_over_repeat": round(f / r, 1) if r else None, "first_ms_total": round(sum(first), 1),
            "repeat_ms_total": round(sum(repeat), 1), "kernels": kernels, "error": None}


# The micro-batches of the multi-task mix's first global batch (256 samples, GPT-1.3B, H200 budget): the dynamic
# plan with the analytic cost model, then token_budget@16384 (multitask_microbatching.py --plans-only).
MODEL_SHAPES = ("56x40,39x56,31x72,26x96,20x112,19x136,16x168,11x208,9x264,8x296,6x376,5x464,4x720,2x1000,3x1392,"
                "1x2048,8x2048,24x673,67x243,157x99")


def build_model(args):
    """The preset's GPT, built on the device (fp32 weights), with positions for the shifted lengths; its attention under
    torch's backend choice (``sdpa_backends="torch"``), so that the orders named here are the orders that run."""
    from lightning_3d.recipes.gpt.model import GPTModel

    config = preset(args.preset, vocab_size=32000, seq_length=args.max_len + 64 * 8, sdpa_backends="torch")
    with torch.device(args.device):
        return GPTModel(config)


def model_part(args, model, order: str, shape_list: list[tuple[int, int]], offset: int) -> dict:
    """Forward, loss and backward of the GPT preset per shape, first call and repeat (see the module docstring).
    ``offset`` shifts every length by a multiple of 8 no other order used, so each order meets cold shapes."""
    device = args.device
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    def run(b: int, s: int) -> float:
        ids = torch.randint(0, 32000, (b, s), device=device)
        sync()
        start = time.perf_counter()
        # The order (if any) holds for the forward and the backward alike.
        with contextlib.ExitStack() as stack:
            if order == "flash_first":
                stack.enter_context(sdpa_kernel(FLASH_FIRST, set_priority=True))
            with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
                logits = model(ids)
            F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
        sync()
        return 1000 * (time.perf_counter() - start)

    try:
        for b, s in ((2, 64), (3, 64), (2, 64)):  # the process's one-time set-up (handles, allocator) unmeasured
            run(b, s)
        rows, worst = [], None
        for b, s in shape_list:
            s = s + offset
            first, repeat = run(b, s), run(b, s)
            rows.append([b, s, round(first, 1), round(repeat, 1)])
            if worst is None or first - repeat > worst[2]:
                worst = (b, s, first - repeat)
        out = {"part": "model", "order": order, "shapes_b_s_first_repeat_ms": rows,
               "first_ms_median": round(statistics.median(r[2] for r in rows), 1),
               "repeat_ms_median": round(statistics.median(r[3] for r in rows), 1),
               "first_ms_total": round(sum(r[2] for r in rows), 1), "repeat_ms_total": round(sum(r[3] for r in rows), 1)}
        if worst is not None:
            # A fresh shape like the slowest one (8 tokens longer): profile its first call.
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                run(worst[0], worst[1] + 8)
            events = prof.key_averages()
            host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
            out["profiled_shape"] = [worst[0], worst[1] + 8]
            out["top_host_ms"] = [[e.key[:60], round(e.self_cpu_time_total / 1000, 2), e.count] for e in host]
            if cuda:
                dev = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:8]
                out["top_device_ms"] = [[e.key[:60], round(getattr(e, "self_device_time_total", 0) / 1000, 2), e.count]
                                        for e in dev]
        return out
    finally:
        model.zero_grad(set_to_none=True)


def packed_part(args, heads: int, head_dim: int, dtype) -> dict:
    """What packing's attention costs: rows of ``--max-len`` tokens holding documents of the multi-task mix's
    typical lengths, attended with the model's dense document mask (a (rows, 1, s, s) boolean mask, torch's backend
    order), with its FlexAttention block mask (``flex``: the recipe's compiled flex call; CUDA only, CPU has no flex
    backward) and plain causal flash attention over the same rows (which also computes the blocks across documents
    below the diagonal). Steady state (each measured after one call; flex's first call compiles it). ``flex`` also
    reports the largest differences of its output and gradients from the dense mask's and the time to build its
    block mask."""
    device, s = args.device, args.max_len
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for _ in range(2):
        lengths, total = [], 0
        while total < s:
            n = min(s - total, int(torch.randint(24, 400, (1,), generator=gen)))
            lengths.append(n)
            total += n
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    documents = torch.stack(rows).to(device)
    mask = gpt_model.document_mask(documents)
    q, k, v = (torch.randn(2, s, heads, head_dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))

    def masked():
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y.backward(torch.ones_like(y))

    def causal():
        attention_call(q, k, v, "flash_first")

    variants = [("masked", masked), ("causal_flash_first", causal)]
    out = {"part": "packed", "rows": 2, "length": s, "documents": [int(r.max()) + 1 for r in rows]}
    if device == "cuda" and args.packed_flex:
        block = gpt_model.document_block_mask(documents)

        def flex():
            y = gpt_model.flex_document_attention(q, k, v, block)
            y.backward(torch.ones_like(y))

        upstream = torch.randn(q.shape, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(1))
        grads = {}
        for name, attend in (("dense", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
                             ("flex", lambda: gpt_model.flex_document_attention(q, k, v, block))):
            y = attend()
            grads[name] = (y.detach().float(), *(g.float() for g in torch.autograd.grad(y, (q, k, v), upstream)))
        # Both in bf16 on the GPU: differences of the order of bf16's rounding (2^-8 relative) are expected.
        out["flex_vs_dense_rel_diff"] = {  # output, dq, dk, dv: largest difference relative to the dense one's scale
            key: round(float((f - d).abs().max() / d.abs().max()), 5)
            for key, f, d in zip(("out", "dq", "dk", "dv"), grads["flex"], grads["dense"], strict=True)}
        sync()
        start = time.perf_counter()
        for _ in range(10):
            gpt_model.document_block_mask(documents)
        sync()
        out["flex_block_mask_build_ms"] = round(100 * (time.perf_counter() - start), 3)
        variants.insert(1, ("flex", flex))
    else:
        out["flex"] = "off (--no-packed-flex)" if device == "cuda" else "CUDA only (no FlexAttention backward on CPU)"
    for name, fn in variants:
        fn()
        times = []
        for _ in range(5):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(1000 * (time.perf_counter() - start))
        out[f"{name}_ms"] = round(statistics.median(times), 3)
        out[f"{name}_kernels"] = kernels_of(fn, device)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="1.3b")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch shape")
    parser.add_argument("--shapes", type=int, default=24, help="distinct shapes per order")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--orders", nargs="+", default=["torch", "flash_first", "cudnn", "flash", "efficient"],
                        choices=["torch", "flash_first", *SINGLE])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", nargs="+", choices=["attention", "model", "packed"],
                        default=["attention", "model", "packed"])
    parser.add_argument("--no-packed-flex", dest="packed_flex", action="store_false",
                        help="--parts packed without FlexAttention (its compile takes tens of seconds)")
    parser.add_argument("--model-shapes", default=MODEL_SHAPES, help="BxS,...: micro-batch shapes for --parts model")
    args = parser.parse_args()
    config = preset(args.preset)
    heads, head_dim = config.num_heads, config.hidden_size // config.num_heads
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    info = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version() if args.device == "cuda" else None, "heads": heads,
            "head_dim": head_dim, "tokens": args.tokens}
    print(json.dumps({"setup": info}), flush=True)
    if "model" in args.parts:
        shape_list = [tuple(int(x) for x in item.split("x")) for item in args.model_shapes.split(",")]
        model = build_model(args)
        for i, order in enumerate(["flash_first", "torch"]):
            print(json.dumps(model_part(args, model, order, shape_list, 8 * (i + 1))), flush=True)
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if "packed" in args.parts:
        print(json.dumps(packed_part(args, heads, head_dim, dtype)), flush=True)
    if "attention" not in args.parts:
        return
    for i, order in enumerate(args.orders):
        # Each order gets shapes no earlier order ran (a different seed): per-shape caches start cold for it.
        shape_list = shapes(args.tokens, args.shapes, args.max_len, args.seed + 1000 * (i + 1))
        try:
            row = measure(order, shape_list, heads, head_dim, args.device, dtype)
        except RuntimeError as err:  # a backend that cannot run these inputs: report it, measure the others
            row = {"order": order, "error": str(err).splitlines()[0][:200]}
        row["shapes"] = len(shape_list)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
