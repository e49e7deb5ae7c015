"""The host's seconds per micro-batch inside the training loop for models that differ only in width, fusion or
nothing at all: does the profiler's stand-in (the recipe's tiny widths at the real depth, ``planner.overheads``)
take the host time of the real model, and how much does the same measurement move between fits?

Each case trains under the strategy on one GPU (``planner.tiny_runs.train_tiny``, as the profiler does) at 1 and 4
micro-batches of one sequence of ``--seq-length`` tokens; per micro-batch = (median step(4) - median step(1)) / 3.
At these lengths every case is host-bound (the kernels of even the real widths take less than their launches).

    python benchmarks/planner/in_situ_widths.py --json in_situ_widths.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

import lightning_3d.recipes  # noqa: E402,F401  (registers the recipes' costs)
from lightning_3d.planner.tiny_runs import train_tiny  # noqa: E402
from lightning_3d.recipes.gpt.costs import TINY  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b", help="the real widths")
    p.add_argument("--layers", type=int, default=24, help="the depth of every case")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    precision = "bf16-mixed" if dev.type == "cuda" else "32-true"
    base = dict(vocab_size=512, seq_length=args.seq_length, num_layers=args.layers)
    # The tiny case runs first and last: the spread of one configuration between two fits of one process.
    cases = [("tiny_auto", dict(base, preset_name="tiny"), "auto"),
             (f"{args.preset}_auto", dict(base, preset_name=args.preset), "auto"),
             (f"{args.preset}_unfused", dict(base, preset_name=args.preset), False),
             ("tiny_fused_all", dict(base, preset_name="tiny"), True),
             ("tiny_auto_again", dict(base, preset_name="tiny"), "auto")]
    out: dict = {"args": vars(args) | {"json": str(args.json)}, "torch": torch.__version__, "cases": {}}
    for name, model_args, fuse in cases:
        steps = train_tiny(TINY, model_args, dict(vocab_size=512, seq_length=args.seq_length), dev, precision, 4, 3,
                           10, fuse)
        one, four = statistics.median(steps[1]), statistics.median(steps[4])
        out["cases"][name] = {"step1_ms": one * 1e3, "step4_ms": four * 1e3, "per_microbatch_ms": (four - one) / 3 * 1e3,
                              "gradient_accumulation_fusion": fuse}
        print(f"{name:16s} per micro-batch {out['cases'][name]['per_microbatch_ms']:7.2f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
