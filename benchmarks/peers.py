"""Side by side, in one run on one machine: our strategy against what users would train with otherwise.

Systems (each in fresh processes started by torchrun, same model, same initial weights, same synthetic tokens):
  plain          plain PyTorch loop on one GPU (our GPT module, bf16 autocast, fused AdamW): the hardware anchor
  ddp            Lightning ``DDPStrategy`` on all GPUs of the run
  fsdp@DP,TP     Lightning ``ModelParallelStrategy``: FSDP2 (bf16 params, fp32 reduce) over DP, DTensor TP over TP
  ours@DP,PP,TP  ``Compressed3DStrategy`` (compression off unless ``+cc``)
Suffixes: ``+compile`` (per-block torch.compile, and the loss), ``+autotune`` (compile with
"max-autotune-no-cudagraphs"), ``+ckpt`` (activation checkpointing), ``+cc``
(ours only: the default compression stack), ``+nofuse`` (ours only: ``gradient_accumulation_fusion=False``).
Every system takes ``--num-microbatches`` micro-batches of ``--micro-batch-size`` sequences per replica and optimizer
step (gradient accumulation for the peers).

    python benchmarks/peers.py --preset 1.3b --seq-length 2048 --systems plain plain+compile ours@1,1,1 ours@1,1,1+compile
    python benchmarks/peers.py --preset 1.3b --gpus 2 --systems ddp fsdp@2,1 fsdp@1,2 ours@2,1,1 ours@1,2,1 ours@1,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.processes import kill_launch  # noqa: E402
from benchmarks.train_throughput import ALWAYS_ENV, FLOPS_FORMULA, PEAK_TFLOPS, REGIMES, environment  # noqa: E402

SYSTEMS = ("plain", "ddp", "fsdp", "ours")
SUFFIXES = ("compile", "autotune", "ckpt", "cc", "fp32res", "nofuse")
OURS_ONLY = ("cc", "nofuse")


def parse_system(text: str, gpus: int) -> dict:
    """``NAME[@sizes][+suffix...]`` -> {name, dp, pp, tp, world, compile, ckpt, cc, label}."""
    head, *suffixes = text.split("+")
    name, _, sizes = head.partition("@")
    bad = [s for s in suffixes if s not in SUFFIXES]
    if name not in SYSTEMS or bad or (name != "ours" and any(s in OURS_ONLY for s in suffixes)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME[@sizes][+{'|+'.join(SUFFIXES)}] with NAME in {SYSTEMS}"
                                         f" (+{', +'.join(OURS_ONLY)} for ours only)")
    numbers = [int(x) for x in sizes.split(",")] if sizes else []
    if name == "plain":
        dp, pp, tp = 1, 1, 1
    elif name == "ddp":
        dp, pp, tp = (numbers or [gpus])[0], 1, 1
    elif name == "fsdp":
        if len(numbers) != 2:
            raise argparse.ArgumentTypeError(f"{text!r}: fsdp takes @DP,TP")
        dp, pp, tp = numbers[0], 1, numbers[1]
    else:
        if len(numbers) != 3:
            raise argparse.ArgumentTypeError(f"{text!r}: ours takes @DP,PP,TP")
        dp, pp, tp = numbers
    return dict(name=name, dp=dp, pp=pp, tp=tp, world=dp * pp * tp, label=text,
                **{s: s in suffixes for s in SUFFIXES})


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=1, help="per replica and optimizer step")
    p.add_argument("--systems", nargs="+", default=["plain", "plain+compile", "ours@1,1,1", "ours@1,1,1+compile"])
    p.add_argument("--schedule", default="1f1b", help="ours with pp > 1")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of the run (ddp uses them all)")
    p.add_argument("--regime", default="nvlink", choices=tuple(REGIMES))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=1, help="run the whole list this many times, interleaved")
    p.add_argument("--profile", action="store_true", help="rank 0 prints a torch.profiler table of 2 steps (log)")
    p.add_argument("--trace", action="store_true", help="--profile, and rank 0 writes the two steps' timeline"
                   " (Chrome trace, gzip) as NN.trace.json.gz beside each system's log")
    p.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"), help="cpu: smoke test only")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per system")
    p.add_argument("--out", type=Path, default=Path("peers.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parsed = [parse_system(s, args.gpus) for s in args.systems]
    for s in args.parsed:
        if s["world"] > args.gpus:
            p.error(f"{s['label']} needs {s['world']} GPUs; the run has --gpus {args.gpus}")
        if s["name"] == "ours" and args.schedule != "gpipe" and args.num_microbatches < s["pp"]:
            p.error(f"{s['label']} with --schedule {args.schedule} needs --num-microbatches >= pp = {s['pp']}"
                    f" (got {args.num_microbatches})")
    return args


def launch(args: argparse.Namespace, system: dict, out_dir: Path, index: int) -> dict:
    """One system in fresh processes (torchrun --standalone picks a free port); its rank-0 result or an error."""
    result = out_dir / f"{index:02d}.json"
    log = out_dir / f"{index:02d}.log"
    env = {**os.environ, **ALWAYS_ENV, **REGIMES[args.regime], "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={system['world']}",
           str(Path(__file__).resolve()), *sys.argv[1:], "--worker", system["label"], "--result", str(result)]
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
            # Every worker, not only torchrun (benchmarks.processes says why). SIGUSR1 first: the workers print every
            # thread's Python stack (peer_workers.run_worker), so the log says where a stuck system waits.
            kill_launch(proc, stacks_first=True)
    wall = round(time.monotonic() - start, 1)
    if code == 0 and result.exists():
        return {**json.loads(result.read_text()), "wall_s": wall, "error": None}
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    return {"error": f"exit {code}; log {log}:\n{tail}", "wall_s": wall}


def summarize(args: argparse.Namespace, system: dict, raw: dict, flops_per_token: float) -> dict:
    tokens = system["dp"] * args.micro_batch_size * args.num_microbatches * args.seq_length
    row = {k: system[k] for k in ("label", "name", "dp", "pp", "tp", "world", *SUFFIXES)}
    row["tokens_per_step"] = tokens
    if raw.get("error"):
        return {**row, **raw}
    step_s = np.asarray(raw.pop("step_s"))
    ms = np.percentile(step_s * 1e3, [50, 10, 90]).tolist()
    tokens_s = tokens / np.median(step_s)
    tflops = flops_per_token * tokens_s / system["world"] / 1e12
    return {**row, **raw, "tokens_per_s": tokens_s, "tflops_per_gpu": tflops,
            "mfu": tflops / PEAK_TFLOPS if args.accelerator == "gpu" else None,
            "step_ms": dict(zip(("median", "p10", "p90"), ms), n=len(step_s))}


def table(rows: list[dict], header: str) -> str:
    anchor = next((r for r in rows if r.get("error") is None), None)
    lines = [header, "system | GPUs | tokens/s | TFLOP/s/GPU | MFU % | per-GPU vs first | step ms median [p10-p90]"
             " | peak mem GB | first loss"]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['label']} | {r['world']} | - | - | - | - | - | - | {r['error'].splitlines()[-1][:70]}")
            continue
        rel = (r["tokens_per_s"] / r["world"]) / (anchor["tokens_per_s"] / anchor["world"])
        mfu = f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "n/a"
        lines.append(f"{r['label']} | {r['world']} | {r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.1f} | {mfu} |"
                     f" {rel:.2f}x | {r['step_ms']['median']:.1f} [{r['step_ms']['p10']:.1f}-{r['step_ms']['p90']:.1f}]"
                     f" | {r['peak_mem_gb']:.1f} | {r['first_loss']:.4f}")
    return "\n".join(lines)


def driver(args: argparse.Namespace) -> None:
    from lightning_3d.recipes.gpt.config import preset

    config = preset(args.preset, vocab_size=args.vocab_size, seq_length=args.seq_length)
    flops_per_token = config.flops_per_token(args.seq_length)
    if args.accelerator == "cpu":  # a CPU smoke run on a GPU host keeps its workers off the GPUs
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    env = environment(argparse.Namespace(accelerator=args.accelerator, regime=args.regime))
    out_dir = args.out.resolve().with_name(args.out.stem + "_logs")
    out_dir.mkdir(parents=True, exist_ok=True)
    header = (f"GPT {args.preset} (N={config.num_parameters() / 1e6:.1f}M), seq {args.seq_length}, micro-batch"
              f" {args.micro_batch_size} x {args.num_microbatches} per replica, bf16, regime={args.regime},"
              f" {args.steps} timed steps after {args.warmup}, {args.repeats} repeat(s)\n{FLOPS_FORMULA};"
              f" MFU = TFLOP/s/GPU / {PEAK_TFLOPS:.0f}; 'per-GPU vs first' = tokens/s per GPU relative to the first row")
    print(f"command: {env['command']}\n{env['date_utc']}  torch {env['torch']}  lightning {env['lightning']}"
          f"  GPUs: {', '.join(env['gpus']) or args.accelerator}", flush=True)
    report = {"environment": env, "flops_per_token": flops_per_token, "peak_tflops_per_gpu": PEAK_TFLOPS,
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "parsed"},
              "results": []}
    index = 0
    for repeat in range(args.repeats):
        for system in args.parsed:
            raw = launch(args, system, out_dir, index)
            index += 1
            row = {**summarize(args, system, raw, flops_per_token), "repeat": repeat}
            print(f"  {system['label']}: " + (row["error"].splitlines()[0] if row["error"] else
                  f"{row['tokens_per_s']:,.0f} tokens/s, MFU {100 * (row['mfu'] or 0):.1f}%"), flush=True)
            report["results"].append(row)
            args.out.write_text(json.dumps(report, indent=1))
    print("\n" + table(report["results"], header) + f"\n\nJSON: {args.out}  logs: {out_dir}")


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.worker:
        from benchmarks.peer_workers import run_worker

        run_worker(args, parse_system(args.worker, args.gpus))
        # The result is written and the groups are destroyed: skip interpreter finalisation, where the destructors
        # of torch's C++ objects occasionally abort a finished worker on CPU (exit code -6 after "terminate called
        # without an active exception"; the original code showed it in about 1 run in 4 of the peers test).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        driver(args)


if __name__ == "__main__":
    main()
