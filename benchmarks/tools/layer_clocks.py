"""Does the profiler time a layer as fast as the training loop runs it? One GPT layer kind at one shape, timed three
ways, with the GPU's SM clock, power and throttle reasons sampled through NVML (``gpu_clocks.ClockSampler``):

- ``isolated``: the profiler's own primitive (``planner.timing.measure``: one forward and backward per repeat,
  behind a spin kernel that keeps the GPU busy but draws little power);
- ``sustained``: the same pass back to back for about three seconds (the power a training step draws), median of the
  second half; a pass whose host is slower than its kernels times the host here, not the kernels;
- ``isolated_after_warm``: ``measure`` right after the sustained loop (the clock the power cap left);
- ``graphed``: the profiler's sustained-clock measurement (``planner.clocks.sustained_ratio``: one forward and
  backward as a CUDA graph, replayed in isolation and back to back; no host in the way at any size).

    python benchmarks/tools/layer_clocks.py --preset 1.3b --seq-length 1024 --micro-batch-size 4 --json clocks.json

``--add-to PROFILE --out NEW``: instead, the profile's ``sustained`` section measured for a profile written without it
(``planner.layers.add_sustained``; the model's preset, vocabulary and lengths as given here), the grids kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

import lightning_3d.recipes  # noqa: E402,F401  (registers the recipes' costs)
from benchmarks.tools.gpu_clocks import ClockSampler  # noqa: E402
from lightning_3d.costs import recipe_costs  # noqa: E402
from lightning_3d.distributed.wgrad_fusion import fuse_standalone  # noqa: E402
from lightning_3d.planner.clocks import sustained_ratio  # noqa: E402
from lightning_3d.planner.layers import add_sustained, grid_lengths  # noqa: E402
from lightning_3d.planner.timing import measure  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--kinds", nargs="+", default=["block", "head"])
    p.add_argument("--seconds", type=float, default=3.0, help="length of the sustained loop")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--add-to", type=Path, default=None, metavar="PROFILE", help="measure the sustained section of this"
                   " profile (of a GPT with --preset, --vocab-size, --seq-length) and write it with --out")
    p.add_argument("--out", type=Path, default=None, help="with --add-to: the profile with its sustained section")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this measures a GPU; none is visible")
    if (args.add_to is None) != (args.out is None):
        p.error("--add-to and --out go together")
    cfg = {"trainer": {"precision": "bf16-mixed"},
           "model": {"class_path": "lightning_3d.recipes.GPT",
                     "init_args": {"preset_name": args.preset, "vocab_size": args.vocab_size}},
           "data": {"init_args": {"seq_length": args.seq_length}}}
    if args.add_to is not None:
        doc = add_sustained(json.loads(args.add_to.read_text()), cfg, seconds=args.seconds)
        args.out.write_text(json.dumps(doc, allow_nan=False))
        print(f"wrote {args.out}")
        return
    dev, seq, mbs = torch.device("cuda", 0), args.seq_length, args.micro_batch_size
    shape, _, _ = grid_lengths(cfg)
    layers = recipe_costs("lightning_3d.recipes.GPT").layers(dict(cfg["model"]["init_args"]),
                                                             dict(cfg["data"]["init_args"]), shape, dev)
    out: dict = {"args": vars(args) | {"json": str(args.json)}, "device": torch.cuda.get_device_name(dev),
                 "torch": torch.__version__}
    for kind in args.kinds:
        module, make, run = layers[kind]
        module.to(dev)
        fuse_standalone(module, "auto", "fuse_gradients")  # as the strategy trains it
        inputs = make(mbs, seq, seq, torch.bfloat16)
        kw = dict(recompute=False, device=dev, dtype=torch.bfloat16, warmup=2, repeats=5)

        def passes(n: int) -> list[tuple[float, float]]:
            marks = []
            for _ in range(n):
                for prm in module.parameters():
                    prm.grad = None
                a, b, c = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                a.record()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = run(module, *inputs)
                b.record()
                y.backward(torch.ones_like(y) if y.dim() == 0 else torch.full_like(y, 1e-3))
                c.record()
                marks.append((a, b, c))
            torch.cuda.synchronize()
            return [(a.elapsed_time(b), b.elapsed_time(c)) for a, b, c in marks]

        def timed(fn) -> tuple[object, dict | None]:
            sampler = ClockSampler(0, 0.005)
            sampler.start()
            result = fn()
            sampler.stop()
            return result, sampler.result()

        res = {}
        m, clocks = timed(lambda: measure(module, inputs, run, **kw))
        res["isolated"] = {"forward_ms": m["forward"] * 1e3, "backward_ms": m["backward"] * 1e3, "clocks": clocks}
        passes(3)
        t0 = time.perf_counter()
        passes(5)
        n = max(20, int(args.seconds / max((time.perf_counter() - t0) / 5, 1e-4)))
        marks, clocks = timed(lambda: passes(n))
        tail = marks[n // 2:]
        res["sustained"] = {"passes": n, "forward_ms": statistics.median(f for f, _ in tail),
                            "backward_ms": statistics.median(b for _, b in tail), "clocks": clocks}
        passes(n)
        m, clocks = timed(lambda: measure(module, inputs, run, **kw))
        res["isolated_after_warm"] = {"forward_ms": m["forward"] * 1e3, "backward_ms": m["backward"] * 1e3,
                                      "clocks": clocks}
        g, clocks = timed(lambda: sustained_ratio(module, inputs, run, device=dev, dtype=torch.bfloat16, seconds=args.seconds))
        out[kind] = res
        out[kind + "_graphed"] = dict(g, clocks=clocks)
        print(f"{kind:6s} graphed pass: isolated {g['isolated_seconds'] * 1e3:7.3f} ms  sustained"
              f" {g['sustained_seconds'] * 1e3:7.3f} ms  ratio {g['ratio']:.3f}  SM {clocks and clocks.get('sm_mhz_median')} MHz"
              f"  {clocks and clocks.get('power_w_median')} W", flush=True)
        for way, r in res.items():
            c = r["clocks"] or {}
            print(f"{kind:6s} {way:20s} forward {r['forward_ms']:7.3f} ms  backward {r['backward_ms']:7.3f} ms  "
                  f"SM {c.get('sm_mhz_median')} MHz  {c.get('power_w_median')} W  {c.get('throttle_share')}", flush=True)
        module.to("cpu")
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
