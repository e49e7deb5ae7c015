"""One-GPU long-sequence training: GPT throughput from 2k to 128k tokens per sequence, and the longest that fits.

Two systems train the same GPT (the recipe's ``GPTModel``, bf16 autocast, fp32 AdamW, one sequence per step):

- ``ours``: activation checkpointing of every block, attention restricted to SDPA's flash / memory-efficient kernels
  (memory linear in the sequence), and a chunked loss: the LM head and cross-entropy run a chunk of tokens at a time
  under checkpointing, so the full-vocabulary logits of the sequence never exist at once (``--loss fused`` uses
  ``lightning_3d.recipes.kernels.linear_cross_entropy`` instead, where that module is present);
- ``plain``: the same model as plain PyTorch runs it: no checkpointing, SDPA's default kernel choice, the logits of
  the whole sequence and one cross-entropy over them.

For each system and ``--lengths``, one measurement (in a fresh process, so that an out-of-memory leaves nothing
behind): ``--warmup`` steps, then ``--steps`` timed ones (CUDA-synchronised, median), peak memory, tokens/s and
TFLOP/s. ``--find-longest`` then searches above the longest listed length that fitted (doubling, then bisection to a
multiple of ``--multiple``). Results go to ``--out`` (default ``$OUT/long_sequence.json``), rewritten after every
measurement. Numbers belong in benchmarks/RESULTS.md; design in docs/context_parallel.md.

    python benchmarks/long_sequence.py --preset 1.3b --lengths 2048 8192 32768 65536 131072 --find-longest
    python benchmarks/long_sequence.py --device cpu --preset tiny --lengths 64 128 --steps 1 --warmup 0 --in-process

FLOPs: 6·N + 12·L·h·s per token (``GPTConfig.flops_per_token``, Megatron's convention, causal attention counted in
full, recomputation not counted) with N excluding the learned position table, a lookup that grows with the
sequence (s·h parameters) but does no matrix product.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_3d.recipes.gpt.config import preset  # noqa: E402
from lightning_3d.recipes.gpt.model import GPTModel  # noqa: E402

SYSTEMS = ("ours", "plain")
PEAK_TFLOPS = 989.0  # dense bf16 peak of one H100/H200 SXM (see /work/shared/BENCHMARKING.md)


def flops_per_token(config, seq: int) -> float:
    return config.flops_per_token(seq) - 6.0 * config.seq_length * config.hidden_size


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` a chunk of tokens at a time, each chunk's logits recomputed in
    the backward (checkpointed): one chunk's logits and their gradient exist at a time."""
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(hidden.split(chunk), labels.split(chunk)):
        total = total + checkpoint(_chunk_cross_entropy, h, weight, y, use_reentrant=False)
    return total


def _chunk_cross_entropy(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), y, reduction="sum")


def loss_of(model: GPTModel, system: str, ids: torch.Tensor, labels: torch.Tensor, args) -> torch.Tensor:
    if system == "plain":
        return F.cross_entropy(model(ids).flatten(0, 1).float(), labels.flatten(), reduction="sum")
    x = model.embed(ids)
    for layer in model.layers.values():
        x = checkpoint(layer, x, use_reentrant=False)
    hidden = model.norm(x).flatten(0, 1)
    weight = model.head.weight[: model.config.vocab_size]  # padded rows are never scored (the head's -inf mask)
    if args.loss == "fused":
        from lightning_3d.recipes.kernels import linear_cross_entropy  # the speed helper's kernel, where merged

        return linear_cross_entropy(hidden, weight, labels.flatten())
    return chunked_loss(hidden, weight, labels.flatten(), args.loss_chunk)


def measure(system: str, seq: int, args) -> dict:
    """Train ``--warmup`` + ``--steps`` steps of one sequence of ``seq`` tokens; time, memory and throughput."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config = preset(args.preset, seq_length=seq, vocab_size=args.vocab_size)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        model = GPTModel(config, activation_checkpointing=False)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (1, seq + 1), device=device, generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    dtype = getattr(torch, args.dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    # Ours: only kernels whose memory is linear in the sequence; plain: SDPA's own choice (math where they refuse).
    attention = (lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])) if system == "ours" \
        else contextlib.nullcontext
    times = []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast, attention():
            loss = loss_of(model, system, ids, labels, args) / seq
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tflops = flops_per_token(config, seq) * seq / step_s / 1e12
    return {"system": system, "seq": seq, "fits": True, "loss": loss.item(), "step_s": step_s,
            "tokens_per_s": seq / step_s, "tflops": tflops, "mfu": tflops / PEAK_TFLOPS if cuda else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def run_one(system: str, seq: int, args) -> dict:
    """``measure`` in a fresh process (or in this one with ``--in-process``); an out-of-memory is a result."""
    if args.in_process:
        try:
            return measure(system, seq, args)
        except torch.OutOfMemoryError as e:
            message = str(e).splitlines()[0]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"system": system, "seq": seq, "fits": False, "error": message}
    cmd = [sys.executable, __file__, "--worker", system, str(seq), *worker_args(args)]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stdout + proc.stderr)[-2000:]
    oom = "OutOfMemoryError" in tail or "out of memory" in tail
    return {"system": system, "seq": seq, "fits": False, "error": "out of memory" if oom else tail}


def worker_args(args) -> list[str]:
    return ["--preset", args.preset, "--device", args.device, "--dtype", args.dtype, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--loss", args.loss, "--loss-chunk", str(args.loss_chunk),
            "--vocab-size", str(args.vocab_size)]


def longest_fitting(fits: Callable[[int], bool], known: int, limit: int, multiple: int, failed: int | None = None) -> int:
    """The longest length (a multiple of ``multiple``, at most ``limit``) for which ``fits`` holds, given that
    ``known`` fits (and ``failed``, if given, does not): double until a length fails, then bisect between the last that
    fitted and the first that failed."""
    good, bad = known, failed
    while bad is None:
        nxt = min(2 * good, limit)
        if nxt <= good:
            return good
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > multiple:
        mid = (good + bad) // 2 // multiple * multiple
        if mid <= good:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1.3b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536, 131072])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--find-longest", action="store_true", help="search above the longest listed length that fits")
    parser.add_argument("--max-length", type=int, default=1 << 20)
    parser.add_argument("--multiple", type=int, default=4096, help="granularity of the longest-length search")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="autocast dtype (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--loss", choices=("chunked", "fused"), default="chunked")
    parser.add_argument("--loss-chunk", type=int, default=4096, help="tokens per chunk of the chunked loss")
    parser.add_argument("--in-process", action="store_true", help="measure in this process (tests, CPU)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("SYSTEM", "SEQ"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.worker:
        print(json.dumps(measure(args.worker[0], int(args.worker[1]), args)), flush=True)
        return
    out = args.out or Path(os.environ.get("OUT", ".")) / "long_sequence.json"
    cuda = args.device.startswith("cuda")
    report = {"preset": args.preset, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "device_memory_gb": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
              "dtype": args.dtype, "loss": args.loss, "torch": torch.__version__, "runs": [], "longest": {},
              "flops": "6*N + 12*L*h*s per token, N without the position table; recomputation not counted"}

    def record(result: dict) -> bool:
        report["runs"].append(result)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        shown = (f"{result['tokens_per_s']:.0f} tokens/s, {result['tflops']:.1f} TFLOP/s" if result["fits"]
                 else "does not fit")
        print(f"{result['system']:>5} seq {result['seq']:>7}: {shown}", flush=True)
        return result["fits"]

    for system in args.systems:
        fitted, failed = [], None
        for seq in sorted(args.lengths):
            if not record(run_one(system, seq, args)):
                failed = seq  # longer ones are not tried: memory grows with the sequence
                break
            fitted.append(seq)
        if args.find_longest and fitted:
            report["longest"][system] = longest_fitting(lambda s: record(run_one(system, s, args)), fitted[-1],
                                                        args.max_length, args.multiple, failed)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["longest"]))


if __name__ == "__main__":
    main()
