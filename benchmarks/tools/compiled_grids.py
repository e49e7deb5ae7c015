"""Add compiled grids to a GPT or T5 profile that lacks them (``planner.add_compiled``): the blocks and the head as
the recipes compile them (``compile=True``), timed over the micro-batch sizes and lengths given here (for T5 also the
decoder's target lengths), written beside the profile's eager grids, overheads and sustained section. For the plans
of a model that compiles its blocks: the multi-task data module's planner and
``benchmarks/dynamic/multitask_microbatching.py --compile`` price such a model with the compiled grids
(``recipes/data/multitask_planning.priced_as_trained``).

    python benchmarks/tools/compiled_grids.py --add-to PROFILE --out NEW --preset 1.3b --vocab-size 32000 \\
        --seq-length 2048 --sizes 1,2,4,8,16,32 --lens 256,512,1024,2048
    python benchmarks/tools/compiled_grids.py --add-to PROFILE --out NEW --model t5 --preset 770m \\
        --seq-length 1024 --target-length 256 --sizes 1,2,4,8,16,32 --lens 64,256,1024 --target-lens 64,256

Every new shape may compile again (after the second, torch marks the changing sizes dynamic, as in training), so
keep the grid to the shapes the plans use. A GPU is required: the compiled kernels are the GPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

import lightning_3d.recipes  # noqa: E402,F401  (registers the recipes' costs)
from benchmarks.dynamic.multitask_planned import profile_config  # noqa: E402
from lightning_3d.planner import add_compiled  # noqa: E402
from lightning_3d.planner.timing import LEAD_RERUNS  # noqa: E402


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values) or values != sorted(set(values)):
        raise SystemExit(f"--{name} {text!r}: give increasing positive integers separated by commas, e.g. 1,2,4,8")
    return values


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--add-to", type=Path, required=True, metavar="PROFILE", help="the profile (of the --model with"
                   " --preset, --vocab-size, --seq-length and for T5 --target-length) to add compiled grids to")
    p.add_argument("--out", type=Path, required=True, help="the profile with its compiled grids")
    p.add_argument("--model", choices=("gpt", "t5"), default="gpt")
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the profile's")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--target-length", type=int, default=None, help="T5: the decoder's length (default: --seq-length)")
    p.add_argument("--sizes", default="1,2,4,8,16,32", help="micro-batch sizes, comma-separated")
    p.add_argument("--lens", default="256,512,1024,2048", help="sequence lengths, comma-separated (at most"
                   " --seq-length)")
    p.add_argument("--target-lens", default=None, help="T5: decoder lengths, comma-separated (at most"
                   " --target-length; default: the --lens that fit)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default=None, help="default: the current GPU ('cpu' for tests only)")
    args = p.parse_args(argv)
    sizes, lens = _ints(args.sizes, "sizes"), _ints(args.lens, "lens")
    if args.warmup < 0 or args.repeats < 1:
        raise SystemExit(f"--warmup {args.warmup} / --repeats {args.repeats}: give a warm-up of 0 or more and at least"
                         " one repeat (each point's time is the median of its repeats)")
    if lens[-1] > args.seq_length:
        raise SystemExit(f"--lens {args.lens}: {lens[-1]} is longer than --seq-length {args.seq_length}")
    target_lens = target_length = None
    if args.model == "gpt":
        if args.target_length is not None or args.target_lens is not None:
            raise SystemExit("--target-length/--target-lens are T5's decoder lengths: leave them out with --model gpt")
    else:
        target_length = args.target_length if args.target_length is not None else args.seq_length
        if target_length <= 0:
            raise SystemExit(f"--target-length {target_length}: give a positive decoder length")
        if args.target_lens is None:
            target_lens = [n for n in lens if n <= target_length]
            if not target_lens:
                raise SystemExit(f"--lens {args.lens}: none is at most --target-length {target_length}; give the decoder's"
                                 " lengths with --target-lens")
        else:
            target_lens = _ints(args.target_lens, "target-lens")
            if target_lens[-1] > target_length:
                raise SystemExit(f"--target-lens {args.target_lens}: give decoder lengths up to --target-length"
                                 f" {target_length}")
    if args.device is None and not torch.cuda.is_available():
        raise SystemExit("no GPU is visible: compiled grids time the GPU's kernels (--device cpu for tests only)")
    doc = json.loads(args.add_to.read_text())
    vocab = args.vocab_size if args.vocab_size is not None else (doc.get("model") or {}).get("vocab_size")
    # The config benchmarks/dynamic/multitask_microbatching.py's `--profile measure` profiles for the same model.
    cfg = profile_config(args.model, args.preset, vocab, args.seq_length, target_length,
                         "bf16-mixed" if args.device != "cpu" else "32-true")
    started = time.monotonic()
    try:
        add_compiled(doc, cfg, microbatch_sizes=sizes, seq_lens=lens, target_lens=target_lens, device=args.device,
                     warmup=args.warmup, repeats=args.repeats)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    args.out.write_text(json.dumps(doc, allow_nan=False))
    remeasured = {kind: e["remeasured"] for kind, entries in doc["layers"].items() for e in entries
                  if e.get("compiled") and e.get("remeasured")}
    print(json.dumps({"wrote": str(args.out), "seconds": round(time.monotonic() - started, 1),
                      "compile_errors": doc.get("compile_errors"), "remeasured": remeasured,
                      "device_passes": dict(LEAD_RERUNS)}), flush=True)


if __name__ == "__main__":
    main()
