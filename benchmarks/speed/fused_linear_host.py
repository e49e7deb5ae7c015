"""Host seconds of a linear layer's forward and backward, with the strategy's weight-gradient accumulation fusion
(``distributed.wgrad_fusion``) and with autograd's, on an otherwise idle host: the GPU is kept busy by a spin kernel
before each pass so that the host never waits for it, and the linears are small enough that no launch blocks.
Alternating shapes (h -> 4h, 4h -> h) as in an MLP; ``--repeats`` rounds alternate the two. Then a torch.profiler
table of the fused model's host work.

    python benchmarks/speed/fused_linear_host.py --json fused_linear_host.json
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
from torch import nn  # noqa: E402

from lightning_3d.distributed.wgrad_fusion import fuse_standalone  # noqa: E402


def host_per_linear(fused: bool, dev: torch.device, hidden: int, layers: int, tokens: int, passes: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(hidden, 4 * hidden) if i % 2 == 0 else nn.Linear(4 * hidden, hidden)
                           for i in range(layers)]).to(dev)
    if fused:
        fuse_standalone(model, True, "fuse_gradients")
    x = torch.randn(tokens, hidden, device=dev, requires_grad=True)
    fwd, bwd = [], []
    for r in range(passes + 5):
        if dev.type == "cuda":
            torch.cuda._sleep(int(4e7))  # tens of milliseconds of GPU work ahead of the host
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = x
            for layer in model:
                y = layer(y)
        t1 = time.perf_counter()
        y.float().sum().backward()
        t2 = time.perf_counter()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if r >= 5:
            fwd.append((t1 - t0) / layers * 1e6)
            bwd.append((t2 - t1) / layers * 1e6)
    return statistics.median(fwd), statistics.median(bwd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    out: dict = {"args": vars(args) | {"json": str(args.json)}, "torch": torch.__version__, "device": str(dev),
                 "autograd_us": [], "fused_us": []}
    for _ in range(args.repeats):
        for fused in (False, True):
            f, b = host_per_linear(fused, dev, args.hidden, args.layers, args.tokens, args.passes)
            out["fused_us" if fused else "autograd_us"].append([round(f, 1), round(b, 1)])
    print("host us per linear [forward, backward] per round: autograd", out["autograd_us"], "fused", out["fused_us"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
