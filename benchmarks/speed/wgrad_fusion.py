"""Gradient-accumulation fusion on one GPU: one GPT block's linear layers, autograd's accumulation against ours.

For each layer shape of a GPT preset (q, k, v, proj: h x h; fc: 4h x h; mlp proj: h x 4h) and one micro-batch of
``tokens`` rows, times forward + backward of ``accumulate`` micro-batches under bf16 autocast (``--precision bf16``), accumulating
the weight gradient (a) as autograd does (bf16 GEMM, cast to fp32, add into .grad) and (b) with ``FusedGradLinear``
(the GEMM adds into an fp32 slot), and reports the gradients' relative difference (fp32 accumulation in the GEMM is
the more exact of the two). ``--precision fp32`` runs the same in fp32 throughout (the GEMM's epilogue against
autograd's product and separate add; the two should agree to rounding).

    python benchmarks/speed/wgrad_fusion.py --preset 1.3b --tokens 8192 --accumulate 8 [--precision fp32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.parallel.train_throughput import environment  # noqa: E402
from lightning_3d.distributed.wgrad_fusion import fuse_gradient_accumulation, register_slot, unregister_slot  # noqa: E402
from lightning_3d.recipes.gpt.config import preset  # noqa: E402


def block_linears(hidden: int, ffn: int, device: torch.device) -> list[nn.Linear]:
    shapes = [(hidden, hidden)] * 4 + [(hidden, ffn), (ffn, hidden)]
    return [nn.Linear(i, o, device=device) for i, o in shapes]


def run(layers: list[nn.Linear], inputs: list[dict[int, torch.Tensor]], grads_out: list[dict[int, torch.Tensor]],
        autocast: bool = True) -> None:
    """``inputs[k][width]``: micro-batch k's activations (and output gradients) of that width."""
    for layer in layers:
        layer.weight.grad = None
    for x, g in zip(inputs, grads_out):
        for layer in layers:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                y = layer(x[layer.in_features])
            y.backward(g[layer.out_features])


def time_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="1.3b")
    p.add_argument("--tokens", type=int, default=8192, help="rows of one micro-batch (micro-batch size x sequence)")
    p.add_argument("--accumulate", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: autocast with bf16 activations (the mixed-precision path); fp32: fp32 throughout")
    p.add_argument("--out", type=Path, default=Path("wgrad_fusion.json"))
    args = p.parse_args()
    device = torch.device("cuda")
    cfg = preset(args.preset)
    h, f = cfg.hidden_size, cfg.ffn_size
    torch.manual_seed(0)
    reference = block_linears(h, f, device)
    fused = block_linears(h, f, device)
    for a, b in zip(fused, reference):
        b.load_state_dict(a.state_dict())
    fuse_gradient_accumulation(fused)
    slots = [torch.zeros_like(layer.weight) for layer in fused]
    for layer, slot in zip(fused, slots):
        register_slot(layer.weight, slot, None)
    def activations(requires_grad: bool) -> list[dict[int, torch.Tensor]]:
        return [{w: torch.randn(args.tokens, w, device=device, dtype=dtype, requires_grad=requires_grad)
                 for w in (h, f)} for _ in range(args.accumulate)]

    dtype, autocast = (torch.bfloat16, True) if args.precision == "bf16" else (torch.float32, False)
    inputs, grads_out = activations(True), activations(False)
    ref_ms = time_ms(lambda: run(reference, inputs, grads_out, autocast), args.repeats)
    fused_ms = time_ms(lambda: run(fused, inputs, grads_out, autocast), args.repeats)
    run(reference, inputs, grads_out, autocast)
    run(fused, inputs, grads_out, autocast)
    with torch.no_grad():
        exact = [sum(g[layer.out_features].float().t() @ x[layer.in_features].float()
                     for x, g in zip(inputs, grads_out)) for layer in reference]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())
    result = {
        "environment": environment(argparse.Namespace(accelerator="gpu", regime="nvlink")),
        "preset": args.preset, "precision": args.precision, "tokens": args.tokens, "accumulate": args.accumulate,
        "autograd_ms_per_step": ref_ms, "fused_ms_per_step": fused_ms, "speedup": ref_ms / fused_ms,
        "rel_error_vs_fp32": {"autograd": max(rel(l.weight.grad, e) for l, e in zip(reference, exact)),
                              "fused": max(rel(l.weight.grad, e) for l, e in zip(fused, exact))},
        "fused_grad_is_slot": all(l.weight.grad.data_ptr() == s.data_ptr() for l, s in zip(fused, slots)),
    }
    for layer in fused:
        unregister_slot(layer.weight)
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
