"""One-GPU long-sequence training: GPT throughput from 2k to 128k tokens per sequence, and the longest that fits.

Two systems train the same GPT (the recipe's ``GPTModel``, bf16 autocast, fp32 AdamW, one sequence per step):

- ``ours``: the recipe as ``GPT(activation_checkpointing=True, fused_head_loss=True)`` runs it: every block
  checkpointed, attention restricted to SDPA's flash / memory-efficient kernels (memory linear in the sequence), and
  the chunked loss ``recipes.kernels.linear_cross_entropy``, so the full-vocabulary logits of the sequence never exist
  at once (``--loss chunked``: the head and cross-entropy a ``--loss-chunk`` of tokens at a time under checkpointing);
- ``plain``: the same model as plain PyTorch runs it: no checkpointing, SDPA's default kernel choice, the logits of
  the whole sequence and one cross-entropy over them.

For each system and ``--lengths``, one measurement in a fresh process (an out-of-memory leaves nothing behind):
``--warmup`` steps, then ``--steps`` timed ones (CUDA-synchronised, median), peak memory, tokens/s, TFLOP/s, and the
strategy's fit-check estimate of the same configuration (``strategies/fit_check.py``) against the measured peak.
``--find-longest`` then searches above the longest listed length that fitted: first the length the measured peaks
extrapolate to (memory is linear in the sequence here), then the next multiple of ``--multiple`` above it, then
doubling / bisection if the guess was wrong; each probe runs ``--probe-steps`` steps. The plain system stops at its
first out-of-memory. ``--time-budget`` bounds the whole run: no measurement starts past it and each gets at most what
is left (so one time-limited job is enough); a compact table goes to stdout at the end, the raw results to ``--out``
(default ``$OUT/long_sequence.json``, rewritten after every measurement). Numbers belong in benchmarks/RESULTS.md;
design in docs/context_parallel.md.

    python benchmarks/parallel/long_sequence.py --find-longest                       # GPT-1.3B, one H100: about 8 minutes
    python benchmarks/parallel/long_sequence.py --device cpu --preset tiny --vocab-size 512 --lengths 64 128 --steps 1 \
        --warmup 0 --find-longest --max-length 256 --multiple 32

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
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from lightning_3d.recipes.gpt.config import preset  # noqa: E402
from lightning_3d.recipes.gpt.model import GPTModel  # noqa: E402
from lightning_3d.recipes.kernels import linear_cross_entropy  # noqa: E402
from lightning_3d.strategies.fit_check import RESERVE  # noqa: E402
from lightning_3d.utils.peak_flops import dense_peak_flops  # noqa: E402

SYSTEMS = ("ours", "plain")
# MFU is against the dense bf16 peak of one H100/H200 SXM, from the library's one table (benchmarks/CONVENTIONS.md).
PEAK_TFLOPS = dense_peak_flops("h200", "bf16") / 1e12


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
    if args.loss == "fused":  # the recipe's path: GPT(activation_checkpointing=True, fused_head_loss=True)
        hidden = model(ids).flatten(0, 1)  # the final norm's output (model.head.fused_with_loss)
        return linear_cross_entropy(hidden, model.head.weight, labels.flatten(), model.config.vocab_size)
    x = model.embed(ids)
    for layer in model.layers.values():
        x = checkpoint(layer, x, use_reentrant=False)
    hidden = model.norm(x).flatten(0, 1)
    weight = model.head.weight[: model.config.vocab_size]  # padded rows are never scored (the head's -inf mask)
    return chunked_loss(hidden, weight, labels.flatten(), args.loss_chunk)


def estimate_gib(system: str, seq: int, args) -> float | None:
    """The strategy's fit-check estimate (GiB) of this configuration on one GPU, from the GPT recipe's module."""
    from types import SimpleNamespace

    from lightning_3d.recipes import GPT
    from lightning_3d.strategies.fit_check import FitReport, read_workload
    from lightning_3d.strategies.options import resolve_options

    ours = system == "ours"
    module = GPT(args.preset, vocab_size=args.vocab_size, seq_length=seq, activation_checkpointing=ours,
                 fused_head_loss=ours and args.loss == "fused")
    options = resolve_options(pipeline_parallel_size=1, tensor_parallel_size=1, num_microbatches=None, schedule="1f1b",
                              virtual_stages=None, sequence_parallel=False, pipeline_layer_split=None,
                              stage_activation_checkpointing=None, bucket_size_mb=25.0, gradient_accumulation_fusion=True,
                              on_nonfinite="skip", max_consecutive_nonfinite=10, checkpoint_io=None)
    precision = "bf16-mixed" if args.dtype == "bfloat16" else "32-true"
    workload = read_workload(module, SimpleNamespace(hparams={"seq_length": seq, "batch_size": 1}), dp=1, pp=1, tp=1,
                             cp=1, precision=precision, options=options)
    if workload is None:
        return None
    return FitReport(workload, workload.estimate(), 0.0).peak / 2**30


def measure(system: str, seq: int, args) -> dict:
    """Train ``--warmup`` + ``--steps`` steps of one sequence of ``seq`` tokens; time, memory and throughput."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config = preset(args.preset, seq_length=seq, vocab_size=args.vocab_size)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.device(device):
        model = GPTModel(config, activation_checkpointing=system == "ours" and args.loss == "fused")
    model.head.fused_with_loss = system == "ours" and args.loss == "fused"
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (1, seq + 1), device=device, generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    dtype = getattr(torch, args.dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    # Both: SDPA's own choice (flash or cuDNN for bf16 causal attention on Hopper, memory linear in the sequence). A
    # backend restricted by ``sdpa_kernel`` around the forward would not hold in the checkpointed blocks' recompute
    # (it runs inside backward, outside the context) and torch.utils.checkpoint then refuses the differing kernels.
    attention = contextlib.nullcontext
    times: list[float] = []
    step = 0
    # --warmup untimed steps, then timed ones: at least one, at most --steps, stopping once --min-seconds are timed
    # (a 2k step takes milliseconds, a 128k one tens of seconds).
    while len(times) < max(1, args.steps) and (not times or sum(times) < args.min_seconds):
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
        step += 1
    step_s = statistics.median(times)
    tflops = flops_per_token(config, seq) * seq / step_s / 1e12
    return {"system": system, "seq": seq, "fits": True, "loss": loss.item(), "step_s": step_s, "steps": len(times),
            "tokens_per_s": seq / step_s, "tflops": tflops, "mfu": tflops / PEAK_TFLOPS if cuda else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "estimate_gb": estimate_gib(system, seq, args), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "device_memory_gb": torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None}


def run_one(system: str, seq: int, args, *, steps: int | None = None, warmup: int | None = None,
            timeout: float | None = None) -> dict:
    """``measure`` in a fresh process (or in this one with ``--in-process``); an out-of-memory is a result, and so is
    a timeout (``fits`` None: unknown)."""
    run_args = argparse.Namespace(**{**vars(args), "steps": steps if steps is not None else args.steps,
                                     "warmup": warmup if warmup is not None else args.warmup})
    if args.in_process:
        try:
            return measure(system, seq, run_args)
        except torch.OutOfMemoryError as e:
            message = str(e).splitlines()[0]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"system": system, "seq": seq, "fits": False, "error": message}
    cmd = [sys.executable, __file__, "--worker", system, str(seq), *worker_args(run_args)]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout or args.timeout)
    except subprocess.TimeoutExpired:
        return {"system": system, "seq": seq, "fits": None, "error": f"timed out after {timeout or args.timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (proc.stdout + proc.stderr)[-2000:]
    oom = "OutOfMemoryError" in tail or "out of memory" in tail
    return {"system": system, "seq": seq, "fits": False if oom else None, "error": "out of memory" if oom else tail}


def worker_args(args) -> list[str]:
    return ["--preset", args.preset, "--device", args.device, "--dtype", args.dtype, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--min-seconds", str(args.min_seconds), "--loss", args.loss, "--loss-chunk", str(args.loss_chunk),
            "--vocab-size", str(args.vocab_size)]


def longest_fitting(fits: Callable[[int], bool | None], known: int, limit: int, multiple: int,
                    failed: int | None = None, guess: int | None = None, walk: int = 3) -> int:
    """The longest length (a multiple of ``multiple``, at most ``limit``) for which ``fits`` holds, given that
    ``known`` fits (and ``failed``, if given, does not). With a ``guess`` between them: try it, then walk by
    ``multiple`` up while it fits or down while it does not (at most ``walk`` tries: two when the guess is right).
    Then, or without a guess: double until a length fails, bisect between the last that fitted and the first that
    failed. ``fits`` returning None (a timeout, the time budget) ends the search with the longest found so far."""
    good, bad = known, failed
    if guess is not None and good < guess < (bad if bad is not None else limit + 1):
        probe = guess
        for _ in range(walk):
            verdict = fits(probe)
            if verdict is None:
                return good
            if verdict:
                good, probe = probe, probe + multiple
                if probe > limit or (bad is not None and probe >= bad):
                    break
            else:
                bad, probe = probe, probe - multiple
                if probe <= good:
                    break
    while bad is None:
        nxt = min(2 * good, limit)
        if nxt <= good:
            return good
        verdict = fits(nxt)
        if verdict is None:
            return good
        if verdict:
            good = nxt
        else:
            bad = nxt
    while bad - good > multiple:
        mid = (good + bad) // 2 // multiple * multiple
        if mid <= good:
            break
        verdict = fits(mid)
        if verdict is None:
            return good
        if verdict:
            good = mid
        else:
            bad = mid
    return good


def extrapolate(runs: list[dict], capacity_gib: float | None, multiple: int) -> int | None:
    """The longest multiple of ``multiple`` whose peak memory, extrapolated linearly from the two longest measured
    lengths, stays within ``capacity_gib`` (None without two measured peaks or a capacity)."""
    measured = sorted((r["seq"], r["peak_memory_gb"]) for r in runs if r.get("fits") and r.get("peak_memory_gb"))
    if capacity_gib is None or len(measured) < 2:
        return None
    (s0, m0), (s1, m1) = measured[-2], measured[-1]
    slope = (m1 - m0) / (s1 - s0)
    if slope <= 0:
        return None
    usable = capacity_gib - RESERVE / 2**30  # the CUDA context and the allocator's fragmentation
    return int((s1 + (usable - m1) / slope) // multiple * multiple)


def time_cap(runs: list[dict], seconds: float, steps: int, multiple: int, start_s: float = 30.0) -> int | None:
    """The longest multiple of ``multiple`` whose ``steps`` steps (plus a process start) should end within
    ``seconds``: step time extrapolated as a + b·s² (the MLPs are linear in the sequence, attention quadratic) through
    the two longest measured lengths. None without two measured steps. Keeps the memory-based search from probing a
    length that fits in memory but cannot finish a step within the per-measurement timeout."""
    measured = sorted((r["seq"], r["step_s"]) for r in runs if r.get("fits") and r.get("step_s"))
    if len(measured) < 2:
        return None
    (s0, t0), (s1, t1) = measured[-2], measured[-1]
    b = max((t1 - t0) / (s1 * s1 - s0 * s0), 0.0)
    a = max(t1 - b * s1 * s1, 0.0)
    per_step = (seconds - start_s) / max(1, steps)
    if b == 0.0 or per_step <= a:
        return None
    return int(((per_step - a) / b) ** 0.5 // multiple * multiple)


def summary(report: dict) -> str:
    """The compact table printed at the end."""
    rows = [f"{'system':>6} {'seq':>7} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>5} {'step s':>7} {'peak GiB':>8}"
            f" {'est GiB':>7} {'est err':>7}  note"]
    for r in sorted(report["runs"], key=lambda r: (r["system"], r["seq"])):
        if r.get("fits"):
            est, peak = r.get("estimate_gb"), r.get("peak_memory_gb")
            err = f"{(est - peak) / peak:+.0%}" if est and peak else "-"
            rows.append(f"{r['system']:>6} {r['seq']:>7} {r['tokens_per_s']:>9.0f} {r['tflops']:>8.1f}"
                        f" {r['mfu'] if r.get('mfu') is not None else 0:>5.2f} {r['step_s']:>7.2f}"
                        f" {peak if peak is not None else 0:>8.1f} {est if est is not None else 0:>7.1f} {err:>7}"
                        f"  {r.get('steps', '')} step(s)")
        else:
            note = "out of memory" if r.get("fits") is False else str(r.get("error", ""))[-60:].replace("\n", " ")
            rows.append(f"{r['system']:>6} {r['seq']:>7} {'-':>9} {'-':>8} {'-':>5} {'-':>7} {'-':>8} {'-':>7} {'-':>7}  {note}")
    ours = {r["seq"]: r for r in report["runs"] if r["system"] == "ours" and r.get("fits")}
    if 8192 in ours and 65536 in ours:
        rows.append(f"ours TFLOP/s at 64k / at 8k: {ours[65536]['tflops'] / ours[8192]['tflops']:.2f} (goal >= 0.75)")
    longest = report["longest"]
    if longest:
        cut = {k for k in longest if any(name.startswith(k + " ") for name in report.get("skipped", []))}
        slow = set(report.get("cut_by_time", [])) - cut
        text = ", ".join(f"{k} >= {v} (search cut by the time budget)" if k in cut
                         else f"{k} >= {v} (search cut: a longer probe cannot finish within --timeout)" if k in slow
                         else f"{k} {v}" for k, v in longest.items())
        if longest.get("ours") and longest.get("plain"):
            text += f"; ours / plain {longest['ours'] / longest['plain']:.2f} (goal >= 2)"
        rows.append(f"longest that fits: {text}")
    if report.get("skipped"):
        rows.append(f"not run (time budget): {', '.join(report['skipped'])}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1.3b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536, 131072])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--find-longest", action="store_true", help="search above the longest listed length that fits")
    parser.add_argument("--max-length", type=int, default=1 << 20)
    parser.add_argument("--multiple", type=int, default=8192, help="granularity of the longest-length search")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="autocast dtype (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=5, help="timed steps at most (at least one)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-seconds", type=float, default=2.0, help="timed steps stop once they took this long")
    parser.add_argument("--probe-steps", type=int, default=1, help="steps of each try of the longest-length search")
    parser.add_argument("--loss", choices=("chunked", "fused"), default="fused")
    parser.add_argument("--loss-chunk", type=int, default=4096, help="tokens per chunk of --loss chunked")
    parser.add_argument("--in-process", action="store_true", help="measure in this process (tests, CPU)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one measurement may take at most")
    parser.add_argument("--time-budget", type=float, default=480, help="seconds for the whole run (no start after)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("SYSTEM", "SEQ"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.worker:
        print(json.dumps(measure(args.worker[0], int(args.worker[1]), args)), flush=True)
        return
    out = args.out or Path(os.environ.get("OUT", ".")) / "long_sequence.json"
    # This process never touches CUDA (its context would take memory from the workers): the workers report the card.
    report = {"preset": args.preset, "device": None, "device_memory_gb": None, "dtype": args.dtype, "loss": args.loss,
              "torch": torch.__version__,
              "runs": [], "longest": {}, "skipped": [],
              "flops": "6*N + 12*L*h*s per token, N without the position table; recomputation not counted"}
    deadline = time.monotonic() + args.time_budget

    def record(system: str, seq: int, **kw) -> bool | None:
        left = deadline - time.monotonic()
        if left < 10:
            report["skipped"].append(f"{system} {seq}")
            print(f"{system:>5} seq {seq:>7}: skipped (time budget)", flush=True)
            return None
        result = run_one(system, seq, args, timeout=min(args.timeout, left), **kw)
        report["runs"].append(result)
        if result.get("fits") and report["device"] is None:
            report["device"], report["device_memory_gb"] = result["device"], result["device_memory_gb"]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        shown = (f"{result['tokens_per_s']:.0f} tokens/s, {result['tflops']:.1f} TFLOP/s" if result["fits"]
                 else "does not fit" if result["fits"] is False else f"unknown: {str(result.get('error'))[-200:]}")
        print(f"{result['system']:>5} seq {result['seq']:>7}: {shown}", flush=True)
        return result["fits"]

    # The listed lengths of every system first (the report's table), then the searches, the plain one first (short
    # lengths, cheap), ours last (the longest and slowest steps).
    found: dict[str, tuple[list[int], int | None]] = {}
    for system in args.systems:
        fitted, failed = [], None
        for seq in sorted(args.lengths):
            verdict = record(system, seq)
            if verdict is None:
                break
            if not verdict:
                failed = seq  # longer ones are not tried: memory grows with the sequence
                break
            fitted.append(seq)
        found[system] = (fitted, failed)
    for system in sorted(args.systems, key=lambda name: name != "plain"):
        fitted, failed = found[system]
        if args.find_longest and fitted:
            runs = [r for r in report["runs"] if r["system"] == system]
            guess = extrapolate(runs, report["device_memory_gb"], args.multiple)
            # A probe must also finish within the per-measurement timeout: past that length the search can only
            # say "at least" (recorded as cut).
            cap = time_cap(runs, args.timeout, args.probe_steps, args.multiple)
            limit = min(args.max_length, cap) if cap and cap > fitted[-1] else args.max_length
            if guess is not None:
                guess = min(guess, limit)
            verdicts: list[bool | None] = []

            def probe(seq: int, system: str = system) -> bool | None:
                verdicts.append(record(system, seq, steps=args.probe_steps, warmup=0))
                return verdicts[-1]

            longest = longest_fitting(probe, fitted[-1], limit, args.multiple, failed, guess)
            report["longest"][system] = longest
            if None in verdicts or (limit < args.max_length and longest + args.multiple > limit):
                report.setdefault("cut_by_time", []).append(system)
    out.write_text(json.dumps(report, indent=1))
    print(summary(report), flush=True)


if __name__ == "__main__":
    main()
