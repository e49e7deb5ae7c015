"""Side by side, in one run on one machine: our strategy against what users would train with otherwise.

Systems (each in fresh processes started by torchrun, same model, same initial weights, same synthetic tokens):
  plain          plain PyTorch loop on one GPU (our recipe's model, bf16 autocast, fused AdamW): the hardware anchor
  user           a GPT written plainly as a user would, not our recipe's model (benchmarks/speed/user_gpt.py), same loop;
                 ``+whole`` compiles it with its loss, ``+ourinit`` starts it from the recipe's initial weights,
                 ``+torchinit`` from PyTorch's default initialisation
  hf             the same loop with transformers' GPT2LMHeadModel (SDPA) or T5ForConditionalGeneration, our weights
  ddp            Lightning ``DDPStrategy`` on all GPUs of the run
  fsdp@DP,TP     Lightning ``ModelParallelStrategy``: FSDP2 (bf16 params, fp32 reduce) over DP, DTensor TP over TP
  ours@DP,PP,TP  ``Compressed3DStrategy`` (compression off unless ``+cc``)
  megatron@DP,PP,TP  Megatron-core from the registry (``megatron-core``, no TransformerEngine, no apex): GPTModel with
                 the local layer spec, Float16Module bf16, its DDP, optimizer and pipeline schedule, the preset's shape
                 with Megatron's own initial weights (benchmarks/speed/megatron_peer.py says what differs from ours
                 and what the missing TE/apex rules out); GPUs only, ``+ckpt`` (full recompute per layer) its only
                 suffix. Install on this machine with ``pip install --no-deps megatron-core`` (it needs only torch,
                 numpy and packaging; --no-deps keeps the installed torch); for a GPU machine that reaches no
                 registry, fetch the wheel here with ``pip download --no-deps --only-binary=:all: --python-version
                 3.12 -d .whl megatron-core`` (``.whl/`` is git-ignored; carry it by path) and install it there with
                 ``pip install --no-deps .whl/megatron_core-*.whl``
Suffixes: ``+compile`` (per-block torch.compile, and the loss; hf: the whole model and loss), ``+autotune`` (compile
with "max-autotune-no-cudagraphs"; with +whole, the whole model's compile in that mode), ``+whole`` (plain only:
``torch.compile`` of the whole model with its loss, as a user compiles a plain model), ``+ckpt`` (activation
checkpointing), ``+cc`` (ours only: the default compression
stack), ``+nofuse`` (ours only: ``gradient_accumulation_fusion=False``, no layer fused), ``+fuse`` (ours only:
``gradient_accumulation_fusion=True``, every fusable layer fused; without either, ours runs the strategy's default
``"auto"``: only weights of at least 2**23 elements, docs/speed.md), ``+fusedce`` (GPT, plain and ours: the
chunked fused head + cross-entropy, ``GPT(fused_head_loss=True)``), ``+stage`` (ours only, with +compile: one graph
per pipeline stage, ``compile_scope="stage"``), ``+explicit`` (T5, plain and ours: attention as scores, fp32 softmax and
value mix, ``T5(attention="explicit")``; without it our T5 rows run ``attention="sdpa"``, one SDPA call per
attention), ``+cudagraphs`` (plain with +whole: the compiled model and loss replayed as CUDA graphs,
``mode="reduce-overhead"``, its peak GB the allocator's counted peak, below what the graphs' pool holds; ours: the
strategy's ``cuda_graphs=True``, each stage's forward and backward replayed),
``+torchsdpa`` (our recipes' systems: ``sdpa_backends="torch"``, SDPA under torch's own backend choice, cuDNN included),
``+nocudnn`` (our recipes' systems: ``sdpa_backends="no_cudnn"``, never cuDNN's attention); without either the recipes'
default ``"auto"``, which on these fixed shapes is ``"torch"`` (recipes/attention.py), ``+pygc`` (ours only:
``gc_interval=None``, Python's automatic garbage collection as the peers have it; without it ours runs the strategy's
default, automatic collection off and a full collection every 50 steps), ``+gc1`` (ours only: ``gc_interval=1``, a full
collection before every step after the first, frozen after the first: its cost per step), ``+nocheck`` (ours only:
``on_nonfinite="ignore"``, no non-finite check of the step: the bound on what the check costs; without it ours runs
the default ``"skip"``, whose verdict reaches the host a step late with the fused AdamW these systems use). ``--model t5`` runs the T5
recipe (inputs of ``--seq-length``, targets of ``--target-length`` tokens) against transformers' T5.
Every system takes ``--num-microbatches`` micro-batches of ``--micro-batch-size`` sequences per replica and optimizer
step (gradient accumulation for the peers).

    python benchmarks/speed/peers.py --preset 1.3b --seq-length 2048 --systems plain plain+compile ours@1,1,1 ours@1,1,1+compile
    python benchmarks/speed/peers.py --preset 1.3b --gpus 2 --systems ddp fsdp@2,1 fsdp@1,2 ours@2,1,1 ours@1,2,1 ours@1,1,2
    python benchmarks/speed/peers.py --preset 1.3b --gpus 2 --num-microbatches 4 --systems ours@1,2,1 megatron@1,2,1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.parallel.train_throughput import ALWAYS_ENV, FLOPS_FORMULA, PEAK_TFLOPS, REGIMES, T5_FLOPS_FORMULA, environment  # noqa: E402
from benchmarks.tools.processes import kill_launch  # noqa: E402

SYSTEMS = ("plain", "hf", "ddp", "fsdp", "ours", "user", "megatron")
SUFFIXES = ("compile", "autotune", "ckpt", "cc", "fp32res", "nofuse", "fuse", "whole", "fusedce", "stage", "explicit",
            "cudagraphs", "torchsdpa", "nocudnn", "pygc", "gc1", "nocheck", "ourinit", "torchinit")
OURS_ONLY = ("cc", "nofuse", "fuse", "pygc", "gc1", "nocheck")
# Which systems take a suffix, where not all do (transformers' models: compiled whole or not, nothing else).
ONLY_FOR = {"cc": ("ours",), "nofuse": ("ours",), "fuse": ("ours",), "pygc": ("ours",), "gc1": ("ours",), "nocheck": ("ours",),
            "stage": ("ours",), "whole": ("plain", "user"), "ourinit": ("user",), "torchinit": ("user",), "fusedce": ("plain", "ours"),
            "explicit": ("plain", "ours"), "cudagraphs": ("plain", "ours"),
            "autotune": ("plain", "ddp", "fsdp", "ours"), "ckpt": ("plain", "ddp", "fsdp", "ours", "megatron"),
            "fp32res": ("plain", "ddp", "fsdp", "ours"), "torchsdpa": ("plain", "ddp", "fsdp", "ours"),
            "nocudnn": ("plain", "ddp", "fsdp", "ours")}
MODEL_DEFAULTS = {"gpt": dict(preset="1.3b", vocab_size=50257), "t5": dict(preset="770m", vocab_size=32128)}


def parse_system(text: str, gpus: int) -> dict:
    """``NAME[@sizes][+suffix...]`` -> {name, dp, pp, tp, world, compile, ckpt, cc, label}."""
    head, *suffixes = text.split("+")
    name, _, sizes = head.partition("@")
    bad = [s for s in suffixes if s not in SUFFIXES]
    if name not in SYSTEMS or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME[@sizes][+{'|+'.join(SUFFIXES)}] with NAME in {SYSTEMS}")
    for suffix in suffixes:
        if name not in ONLY_FOR.get(suffix, SYSTEMS):
            only = ONLY_FOR[suffix]
            raise argparse.ArgumentTypeError(f"{text!r}: +{suffix} is for {' and '.join(only)}"
                                             f"{' only' if len(only) == 1 else ''}, not {name}")
    if "whole" in suffixes and "compile" in suffixes:
        raise argparse.ArgumentTypeError(f"{text!r}: +whole compiles the whole model; drop +compile (+autotune sets"
                                         " its mode)")
    if "whole" in suffixes and "fusedce" in suffixes:
        raise argparse.ArgumentTypeError(f"{text!r}: +fusedce runs its chunks outside the compiled model; not with +whole")
    if "cudagraphs" in suffixes and name == "plain" and "whole" not in suffixes:
        raise argparse.ArgumentTypeError(f"{text!r}: +cudagraphs replays the whole-model compile; add +whole")
    if "cudagraphs" in suffixes and name == "ours" and "fuse" in suffixes:
        raise argparse.ArgumentTypeError(f"{text!r}: cuda_graphs=True refuses gradient_accumulation_fusion=True; drop +fuse")
    for backends in ("torchsdpa", "nocudnn"):
        if backends in suffixes and "explicit" in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r}: +{backends} picks SDPA's backends and +explicit runs no SDPA;"
                                             " drop one")
    if "torchsdpa" in suffixes and "nocudnn" in suffixes:
        raise argparse.ArgumentTypeError(f"{text!r}: +torchsdpa and +nocudnn are two SDPA backend choices; pick one")
    if "fuse" in suffixes and "nofuse" in suffixes:
        raise argparse.ArgumentTypeError(f"{text!r}: +fuse and +nofuse are two gradient-accumulation fusion settings;"
                                         " pick one")
    if "pygc" in suffixes and "gc1" in suffixes:
        raise argparse.ArgumentTypeError(f"{text!r}: +pygc and +gc1 are two garbage-collection settings; pick one")
    if "stage" in suffixes and not ("compile" in suffixes or "autotune" in suffixes):
        raise argparse.ArgumentTypeError(f"{text!r}: +stage sets what one compiled graph covers; add +compile")
    if name == "user" and (set(suffixes) - {"whole", "ourinit", "torchinit"} or sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: user runs on one GPU and takes +whole, +ourinit and +torchinit"
                                         " only (it is written as a user writes it, with none of the recipe's options)")
    if name == "megatron" and set(suffixes) - {"ckpt"}:
        raise argparse.ArgumentTypeError(f"{text!r}: megatron takes +ckpt only (Megatron-core's own model and loop,"
                                         " none of the recipes' options)")
    if "ourinit" in suffixes and "torchinit" in suffixes:
        raise argparse.ArgumentTypeError(f"{text!r}: +ourinit and +torchinit are two initialisations; pick one")
    numbers = [int(x) for x in sizes.split(",")] if sizes else []
    if name in ("plain", "hf", "user"):
        dp, pp, tp = 1, 1, 1
    elif name == "ddp":
        dp, pp, tp = (numbers or [gpus])[0], 1, 1
    elif name == "fsdp":
        if len(numbers) != 2:
            raise argparse.ArgumentTypeError(f"{text!r}: fsdp takes @DP,TP")
        dp, pp, tp = numbers[0], 1, numbers[1]
    else:
        if len(numbers) != 3:
            raise argparse.ArgumentTypeError(f"{text!r}: {name} takes @DP,PP,TP")
        dp, pp, tp = numbers
    return dict(name=name, dp=dp, pp=pp, tp=tp, world=dp * pp * tp, label=text,
                **{s: s in suffixes for s in SUFFIXES})


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt", choices=tuple(MODEL_DEFAULTS), help="recipe: GPT or T5")
    p.add_argument("--preset", default=None, help="a preset of the model's recipe (default: gpt 1.3b, t5 770m)")
    p.add_argument("--vocab-size", type=int, default=None, help="default: gpt 50257, t5 32128")
    p.add_argument("--seq-length", type=int, default=2048, help="gpt: sequence length; t5: input length")
    p.add_argument("--target-length", type=int, default=None, help="t5 only: target (decoder) length (default 128)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=1, help="per replica and optimizer step")
    p.add_argument("--systems", nargs="+", default=["plain", "plain+compile", "ours@1,1,1", "ours@1,1,1+compile"])
    p.add_argument("--num-workers", type=int, default=0, help="data loader worker processes of every system: our and"
                   " Lightning's data modules get num_workers=N, the plain loops read through a torch DataLoader with"
                   " N workers; 0 collates in the training process (ours: the step's batch, between steps; the"
                   " others: each micro-batch)")
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
    p.add_argument("--deadline", type=float, default=None, help="Unix time by which the whole list must be done (a"
                   " job's time limit): each system gets min(--timeout, the time left); one with less than"
                   " --min-system-s left is skipped and reported so")
    p.add_argument("--min-system-s", type=float, default=45.0, help="with --deadline: the least time worth a launch")
    p.add_argument("--out", type=Path, default=Path("peers.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key, value in MODEL_DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.num_workers < 0:
        p.error(f"--num-workers {args.num_workers}: give 0 (collate in the training process) or more worker processes")
    if args.model == "gpt" and args.target_length is not None:
        p.error("--target-length is for --model t5 (GPT trains on --seq-length tokens)")
    if args.model == "t5" and args.target_length is None:
        args.target_length = 128
    args.parsed = [parse_system(s, args.gpus) for s in args.systems]
    if any(s["name"] == "megatron" for s in args.parsed):  # before any launch: a missing package fails here, once
        from benchmarks.speed.megatron_peer import megatron_version

        try:
            megatron_version()
        except ImportError as error:
            p.error(str(error))
    for s in args.parsed:
        if s["world"] > args.gpus:
            p.error(f"{s['label']} needs {s['world']} GPUs; the run has --gpus {args.gpus}")
        if args.model == "gpt" and s["explicit"]:
            p.error(f"{s['label']}: +explicit is T5's attention option (GPT has no relative position bias);"
                    " use --model t5")
        if args.model == "t5" and s["name"] == "user":
            p.error(f"{s['label']}: user is a GPT; --model t5 runs plain, hf, ddp and ours")
        if args.model == "t5" and (s["name"] == "fsdp" or s["fusedce"] or s["fp32res"]):
            p.error(f"{s['label']}: --model t5 runs plain, hf, ddp and ours, without +fusedce or +fp32res")
        if s["name"] == "megatron" and (args.model != "gpt" or args.accelerator != "gpu"):
            p.error(f"{s['label']}: the megatron peer is a GPT on GPUs (megatron-core allocates on CUDA throughout)")
        if s["name"] == "ours" and args.schedule != "gpipe" and args.num_microbatches < s["pp"]:
            p.error(f"{s['label']} with --schedule {args.schedule} needs --num-microbatches >= pp = {s['pp']}"
                    f" (got {args.num_microbatches})")
    return args


def launch(args: argparse.Namespace, system: dict, out_dir: Path, index: int, timeout: float) -> dict:
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
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
            # Every worker, not only torchrun (benchmarks.tools.processes says why). SIGUSR1 first: the workers print every
            # thread's Python stack (peer_workers.run_worker), so the log says where a stuck system waits.
            kill_launch(proc, stacks_first=True)
    wall = round(time.monotonic() - start, 1)
    if code == 0 and result.exists():
        return {**json.loads(result.read_text()), "wall_s": wall, "error": None}
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    return {"error": f"exit {code}; log {log}:\n{tail}", "wall_s": wall}


def summarize(args: argparse.Namespace, system: dict, raw: dict, flops_per_token: float) -> dict:
    tokens = system["dp"] * args.micro_batch_size * args.num_microbatches * sample_tokens(args)
    row = {k: system[k] for k in ("label", "name", "dp", "pp", "tp", "world", *SUFFIXES)}
    row["tokens_per_step"] = tokens
    if raw.get("error"):
        return {**row, **raw}
    step_s = np.asarray(raw.pop("step_s"))
    ms = np.percentile(step_s * 1e3, [50, 10, 90, 0, 100]).tolist()
    tokens_s = tokens / np.median(step_s)
    tflops = flops_per_token * tokens_s / system["world"] / 1e12
    return {**row, **raw, "tokens_per_s": tokens_s, "tflops_per_gpu": tflops,
            "mfu": tflops / PEAK_TFLOPS if args.accelerator == "gpu" else None,
            "step_ms": dict(zip(("median", "p10", "p90", "min", "max"), ms), mean=float(step_s.mean()) * 1e3,
                            n=len(step_s))}


def sample_tokens(args: argparse.Namespace) -> int:
    """Tokens of one sample: GPT's sequence, T5's input plus target (the count its FLOPs per token refer to)."""
    return args.seq_length + (args.target_length if args.model == "t5" else 0)


def model_flops(args: argparse.Namespace) -> tuple[Any, float, str]:
    """(recipe config, training FLOPs per token, the convention's text)."""
    if args.model == "t5":
        from lightning_3d.recipes.t5.config import preset as t5_preset

        config = t5_preset(args.preset, vocab_size=args.vocab_size)
        return config, config.flops_per_token(args.seq_length, args.target_length), T5_FLOPS_FORMULA
    from lightning_3d.recipes.gpt.config import preset

    config = preset(args.preset, vocab_size=args.vocab_size, seq_length=args.seq_length)
    return config, config.flops_per_token(args.seq_length), FLOPS_FORMULA


def table(rows: list[dict], header: str) -> str:
    anchor = next((r for r in rows if r.get("error") is None), None)
    lines = [header, "system | GPUs | tokens/s | TFLOP/s/GPU | MFU % | per-GPU vs first | step ms median [p10-p90]"
             " {min-max} | peak mem GB | first loss | GC ms/step [gen 0/1/2 collections]; GPU clock (NVML)"]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['label']} | {r['world']} | - | - | - | - | - | - | {r['error'].splitlines()[-1][:70]} | -")
            continue
        rel = (r["tokens_per_s"] / r["world"]) / (anchor["tokens_per_s"] / anchor["world"])
        mfu = f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "n/a"
        lines.append(f"{r['label']} | {r['world']} | {r['tokens_per_s']:,.0f} | {r['tflops_per_gpu']:.1f} | {mfu} |"
                     f" {rel:.2f}x | {r['step_ms']['median']:.1f} [{r['step_ms']['p10']:.1f}-{r['step_ms']['p90']:.1f}]"
                     f" {{{r['step_ms']['min']:.1f}-{r['step_ms']['max']:.1f}}}"
                     f" | {r['peak_mem_gb']:.1f} | {r['first_loss']:.4f} | {_gc_text(r.get('gc'))}{_clock_text(r)}")
    megatron = next((r for r in rows if r.get("megatron_core")), None)
    if megatron is not None:
        lines.append(f"megatron: megatron-core {megatron['megatron_core']}, {megatron['megatron_missing']}")
    return "\n".join(lines)


def profile_digest(log: Path, rows: int = 6) -> list[str]:
    """A few lines from a worker log's ``--profile`` tables (peer_workers.StepProfiler): the two steps' self CPU and
    device totals (host-bound when CPU exceeds device), the top ``rows`` ops by device time and by CPU time. Printed
    to stdout because a remote job often brings back its output before (and sometimes instead of) its files."""
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    out, totals = [], []
    for title, key in (("by device time", "Self CUDA"), ("by CPU time", "Self CPU")):
        start = next((i for i, line in enumerate(lines) if line.startswith("PROFILE") and title in line), None)
        if start is None:
            continue
        header = next((i for i in range(start, len(lines)) if "Name" in lines[i]), None)
        if header is None:
            continue
        columns = [c.strip() for c in re.split(r"\s{2,}", lines[header].strip())]
        column = next((i for i, c in enumerate(columns) if c == key or (key == "Self CUDA" and c == "Self device")),
                      None)
        picked = []
        for line in lines[header + 2:]:
            if line.startswith("-"):
                continue
            if line.startswith("Self ") and "time total" in line:
                if line not in totals:
                    totals.append(line.strip())
                continue
            if not line.strip() or line.startswith("PROFILE"):
                break
            cells = [c.strip() for c in re.split(r"\s{2,}", line.strip())]
            if column is not None and len(cells) == len(columns) and len(picked) < rows:
                picked.append(f"{cells[0][:48]} {cells[column]} x{cells[-1]}")
        if picked:
            out.append(f"    top {title}: " + "; ".join(picked))
    return ([f"    {'; '.join(totals)}"] if totals else []) + out


def profiled_ms(digest: list[str], which: str) -> float | None:
    """``which`` ("CPU" or "CUDA") self time total of a digest's first line, in ms, or None."""
    match = re.search(rf"Self {which} time total: ([0-9.]+)(us|ms|s)\b", digest[0]) if digest else None
    return None if match is None else float(match.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[match.group(2)]


def _clock_text(row: dict) -> str:
    """The GPU's median SM clock and power over the timed steps (peer_workers samples them through NVML), or ""."""
    clocks = row.get("clocks")
    if not clocks:
        return ""
    reasons = ", ".join(f"{k} {100 * v:.0f}%" for k, v in clocks["throttle_share"].items())
    return (f"; SM {clocks['sm_mhz_median']:.0f} MHz [{clocks['sm_mhz_p10_p90'][0]:.0f}-{clocks['sm_mhz_p10_p90'][1]:.0f}],"
            f" {clocks['power_w_median']:.0f} W (max {clocks['power_w_max']:.0f}), {clocks['temp_c_median']:.0f} C"
            + (f", throttled: {reasons}" if reasons else ""))


def _gc_text(gc: dict | None) -> str:
    """Python's garbage collections inside the timed steps (peer_workers.GCTime), or "-" for older results."""
    if not gc:
        return "-"
    return f"{gc['ms_per_step']:.1f} [{'/'.join(str(n) for n in gc['collections'])}]"


def driver(args: argparse.Namespace) -> None:
    config, flops_per_token, formula = model_flops(args)
    if args.accelerator == "cpu":  # a CPU smoke run on a GPU host keeps its workers off the GPUs
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    env = environment(argparse.Namespace(accelerator=args.accelerator, regime=args.regime))
    out_dir = args.out.resolve().with_name(args.out.stem + "_logs")
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = f"{args.seq_length}+{args.target_length}" if args.model == "t5" else str(args.seq_length)
    header = (f"{args.model.upper()} {args.preset} (N={config.num_parameters() / 1e6:.1f}M), seq {lengths}, micro-batch"
              f" {args.micro_batch_size} x {args.num_microbatches} per replica, bf16, regime={args.regime},"
              f" {args.steps} timed steps after {args.warmup}, {args.repeats} repeat(s)\n{formula};"
              f" MFU = TFLOP/s/GPU / {PEAK_TFLOPS:.0f}; 'per-GPU vs first' = tokens/s per GPU relative to the first row")
    print(f"command: {env['command']}\n{env['date_utc']}  torch {env['torch']}  lightning {env['lightning']}"
          f"  GPUs: {', '.join(env['gpus']) or args.accelerator}", flush=True)
    report = {"environment": env, "flops_per_token": flops_per_token, "peak_tflops_per_gpu": PEAK_TFLOPS,
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "parsed"},
              "results": []}
    index = 0
    for repeat in range(args.repeats):
        for system in args.parsed:
            timeout = args.timeout if args.deadline is None else min(args.timeout, args.deadline - time.time())
            if timeout < (args.min_system_s if args.deadline is not None else 0):
                raw = {"error": f"skipped: {max(timeout, 0):.0f} s left before --deadline", "wall_s": 0.0}
            else:
                raw = launch(args, system, out_dir, index, timeout)
            index += 1
            row = {**summarize(args, system, raw, flops_per_token), "repeat": repeat}
            print(f"  {system['label']}: " + (row["error"].splitlines()[0] if row["error"] else
                  f"{row['tokens_per_s']:,.0f} tokens/s, MFU {100 * (row['mfu'] or 0):.1f}%{_clock_text(row)}"),
                  flush=True)
            report["results"].append(row)
            args.out.write_text(json.dumps(report, indent=1))
    if args.profile or args.trace:
        print("\nPROFILE digests (rank 0, the two profiled steps; full tables in the logs)")
        for index, row in enumerate(report["results"]):
            digest = profile_digest(out_dir / f"{index:02d}.log")
            busy = ""
            if row.get("error") is None and (device_ms := profiled_ms(digest, "CUDA")) is not None:
                # The kernels' summed time over the two profiled steps' wall time (about two median steps): well
                # under 100 % means the device waits for the host.
                busy = f" (device busy ~{100 * device_ms / (2 * row['step_ms']['median']):.0f} % of two median steps)"
            print(f"  {row['label']}:" + ("" if row.get("error") is None else " (failed)") + busy)
            print("\n".join(digest))
    print("\n" + table(report["results"], header) + f"\n\nJSON: {args.out}  logs: {out_dir}")


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.worker:
        from benchmarks.speed.peer_workers import run_worker

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
