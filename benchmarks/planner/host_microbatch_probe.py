"""Seconds per micro-batch of a GPT inside the training loop, per micro-batch size: the full-width model and the
profiler's tiny-width model at the same depth (the planner's host term, docs/planner.md).

The one-GPU validations measured host-bound GPT-350M micro-batches costing more at micro-batch size 1 than at 2 and
4, while the same layers launch the same kernels at every size (docs/planner.md, "What the host term holds"); the
profile's in-situ host term comes from tiny-width models trained with micro-batches of one sample. This trains both
models as the profiler's in-situ measurement does (``Compressed3DStrategy`` on one device, 1 and 4 micro-batches;
per micro-batch (c(4) - c(1)) / 3, medians of the timed steps) at each size of ``--sizes``. The tiny model is
host-bound at every size: if its seconds fall from size 1 to 2 as the full model's do, the excess belongs to the host
at micro-batch 1 (the in-situ run would have to use the planned size); if they stay flat while the full model's fall,
the host's cost depends on how busy the device is (launches onto an idle GPU), which the in-situ run on tiny widths
cannot show.

    python benchmarks/planner/host_microbatch_probe.py --out $OUT/host_microbatch_probe.json    # GPT-350M, sizes 1 2 4
    python benchmarks/planner/host_microbatch_probe.py --device cpu --preset tiny --layers 2 --models tiny --sizes 1 2 \\
        --warmup 1 --steps 2                                                             # smoke (tests/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import lightning_3d.recipes  # noqa: E402,F401  (registers the GPT recipe and its tiny model)
from lightning_3d.costs import recipe_costs  # noqa: E402
from lightning_3d.planner import train_tiny  # noqa: E402
from lightning_3d.recipes.gpt.config import PRESETS  # noqa: E402

MICROBATCHES = 4  # as the profiler's in-situ run


def per_microbatch(step_s: dict[int, list[float]]) -> tuple[float, float, float]:
    """(per micro-batch, step with 1, step with MICROBATCHES) seconds from the timed steps' medians."""
    one, many = statistics.median(step_s[1]), statistics.median(step_s[MICROBATCHES])
    return (many - one) / (MICROBATCHES - 1), one, many


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="350m", help="the GPT preset of the full-width model")
    parser.add_argument("--layers", type=int, default=None, help="depth of both models (default: the preset's)")
    parser.add_argument("--seq-length", type=int, default=1024, help="the full-width model's sequence length")
    parser.add_argument("--vocab-size", type=int, default=50257, help="the full-width model's vocabulary")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="micro-batch sizes (sequences)")
    parser.add_argument("--models", nargs="+", choices=("tiny", "full"), default=["tiny", "full"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fusion", default="auto", choices=("auto", "true", "false"),
                        help="gradient_accumulation_fusion, as the profile's")
    parser.add_argument("--device", default=None, help="default: the current GPU; cpu: smoke test")
    parser.add_argument("--out", default=None, help="JSON rows")
    ns = parser.parse_args(argv)
    if ns.preset not in PRESETS:
        parser.error(f"--preset {ns.preset!r}: choose one of {sorted(PRESETS)}")
    if any(b < 1 for b in ns.sizes):
        parser.error(f"--sizes {ns.sizes}: micro-batch sizes are positive")
    if ns.device is None and not torch.cuda.is_available():
        parser.error("no GPU visible: pass --device cpu for the smoke test")
    device = torch.device(ns.device or f"cuda:{torch.cuda.current_device()}")
    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    fusion = {"auto": "auto", "true": True, "false": False}[ns.fusion]
    depth = ns.layers or PRESETS[ns.preset].num_layers
    tiny = recipe_costs("lightning_3d.recipes.GPT").tiny
    models = {"tiny": (dict(tiny.model_args, num_layers=depth), tiny.data_args),
              "full": (dict(preset_name=ns.preset, vocab_size=ns.vocab_size, num_layers=depth),
                       dict(vocab_size=ns.vocab_size, seq_length=ns.seq_length))}
    warnings.simplefilter("ignore")
    for lg in ("lightning.pytorch", "lightning.fabric", "lightning_3d"):  # start-up notes of every fit: quiet
        logging.getLogger(lg).setLevel(logging.ERROR)
    rows = []
    for name in ns.models:
        model_args, data_args = models[name]
        for b in ns.sizes:
            step_s = train_tiny(tiny, model_args, data_args, device, precision, MICROBATCHES, ns.warmup, ns.steps,
                                fusion, samples=b)
            mb, one, many = per_microbatch(step_s)
            rows.append({"model": name, "layers": depth, "microbatch_size": b, "per_microbatch_s": mb,
                         "step_1_s": one, f"step_{MICROBATCHES}_s": many,
                         "timed_steps": [len(step_s[1]), len(step_s[MICROBATCHES])]})
            print(f"{name:4s} {depth} layers, micro-batch {b}: {mb * 1e3:8.2f} ms per micro-batch"
                  f" (steps {one * 1e3:.1f} / {many * 1e3:.1f} ms)", flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps({"preset": ns.preset, "fusion": ns.fusion, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
