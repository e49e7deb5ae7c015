"""Context parallelism in one process group: ring attention and the cp training pattern against one process.

Cases, for the cp group spanning the world and (at world 4) for two cp=2 groups side by side (dp=2 x cp=2):

1. bad inputs raise the same ValueError on every rank before any collective (the cases that follow would hang or
   mismatch if one rank had gone on into the ring);
2. ``shard_sequence`` / ``gather_sequence`` / ``position_ids`` rebuild the full sequence and its positions exactly;
3. ring and Ulysses attention, forward and backward, contiguous and zigzag, causal and full, equal full-sequence SDPA
   on one process (the matching rows of the output, of dQ, dK and dV) within the fp32 bound of ``attention_tolerance``;
4. a tiny causal LM trained the context-parallel way (positions of the slice, loss normalised by the terms of all
   dp x cp ranks, gradients summed over dp x cp) has the loss and gradients of one process on the full batch;
5. at world 4 on CPU, ``Compressed3DStrategy(context_parallel_size=...)`` itself (``context_layouts.run_all``:
   layouts with pp, tp and dp against one process, resume across cp sizes, SC over dp x cp, bad values).

Every rank checks its own slice against a reference it computes itself; rank 0 writes what all ranks measured.
``L3D_TEST_DEVICE=cuda`` runs the same cases on GPUs with NCCL (fp32: CUDA's memory-efficient kernel, whose local
slices must be multiples of 64 tokens, hence the longer chunks there).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_3d.context import gather_sequence, position_ids, ring_attention, shard_sequence, ulysses_attention
from tests.tolerance import chain_tolerance, scaled_error

B, H, D = 2, 4, 8  # batch, heads (divisible by cp for Ulysses), head dim
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if os.environ.get("L3D_TEST_DEVICE") == "cuda" \
    else torch.device("cpu")
# Tokens per zigzag chunk: sequences of 2 * cp * CHUNK tokens (odd chunks exercise the half-splits on CPU).
CHUNK = 32 if DEVICE.type == "cuda" else 3
VOCAB, HIDDEN = 50, 16


def attention_tolerance(seq: int, cp: int, backward: bool) -> float:
    """fp32 bound (relative to the reference's scale) between ring and full attention, which differ only in the order
    of their sums. Forward chain: scores (D terms), softmax sum and value mix (``seq`` terms each), then the ring's
    merge of ``cp`` partial results (one more reduction). Backward adds dP = dO·Vᵀ and the row term rowsum(dO∘O)
    (D terms each), the products dS·K, dSᵀ·Q, Pᵀ·dO (``seq`` terms) and the ring's sum of ``cp`` block gradients."""
    return chain_tolerance(8 if backward else 4, max(seq, D, cp))


def model_tolerance(tokens: int) -> float:
    """fp32 bound for the tiny LM's gradients: the forward chain of a one-block GPT (9 reductions a block, final norm
    and head: 11, see tests/tolerance.gpt_tolerance), as many backward, and the sum over dp x cp ranks; the longest
    reduction is a weight gradient's sum over the batch's tokens (or the vocabulary / hidden size, if longer)."""
    return chain_tolerance(2 * 11 + 1, max(tokens, VOCAB, HIDDEN))


def expect_error(fragment: str, fn) -> str:
    try:
        fn()
    except ValueError as e:
        assert fragment in str(e), f"expected {fragment!r} in {e}"
        return str(e)
    raise AssertionError(f"no error containing {fragment!r}")


def bad_inputs(group, cp: int) -> dict:
    x = torch.randn(B, H, 2 * cp * CHUNK, D, device=DEVICE)
    odd = torch.randn(B, H, 2 * CHUNK + 1, D, device=DEVICE)
    return {
        "indivisible": expect_error("not divisible by", lambda: shard_sequence(torch.randn(B, 2 * cp * CHUNK + 1), cp, 0)),
        "odd_local": expect_error("(odd)", lambda: ring_attention(odd, odd, odd, group, causal=True, layout="zigzag")),
        "head_dim": expect_error("same head dim", lambda: ring_attention(x, x, x[..., :-1], group)),
        "layout": expect_error("Unknown context-parallel layout", lambda: ring_attention(x, x, x, group, layout="ring")),
        "heads": expect_error("not divisible by context_parallel_size", lambda: ulysses_attention(*(x[:, :3],) * 3, group)),
        "ulysses_odd": expect_error("(odd)", lambda: ulysses_attention(odd, odd, odd, group, causal=False)),
    }


def round_trips(group, cp: int, rank: int) -> bool:
    for layout in ("contiguous", "zigzag"):
        full = torch.randn(B, 2 * cp * CHUNK, 5, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        assert torch.equal(gather_sequence(shard_sequence(full, cp, rank, layout), group, layout), full)
        pos = position_ids(full.shape[1], cp, rank, layout, device=DEVICE)
        assert torch.equal(gather_sequence(pos[None], group, layout)[0], torch.arange(full.shape[1], device=DEVICE))
    return True


def attention_cases(group, cp: int, rank: int) -> dict:
    seq = 2 * cp * CHUNK
    errors = {}
    for kernel, layout, causal in [(k, layout, c) for k in ("ring", "ulysses") for layout in ("contiguous", "zigzag")
                                   for c in (True, False)]:
        attention = ring_attention if kernel == "ring" else ulysses_attention
        g = torch.Generator().manual_seed(7)
        q, k, v, dout = (torch.randn(B, H, seq, D, generator=g).to(DEVICE) for _ in range(4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=causal)
        ref.backward(dout)
        local = [shard_sequence(t, cp, rank, layout, dim=2).requires_grad_() for t in (q, k, v)]
        out = attention(*local, group, causal=causal, layout=layout)
        out.backward(shard_sequence(dout, cp, rank, layout, dim=2))
        fwd = scaled_error(out.detach(), shard_sequence(ref.detach(), cp, rank, layout, dim=2))
        bwd = max(scaled_error(a.grad, shard_sequence(b.grad, cp, rank, layout, dim=2)) for a, b in zip(local, full))
        name = f"{kernel},{layout},{'causal' if causal else 'full'}"
        assert fwd <= attention_tolerance(seq, cp, False), (name, "forward", fwd)
        assert bwd <= attention_tolerance(seq, cp, True), (name, "backward", bwd)
        errors[name] = (fwd, bwd)
    errors["ring,zigzag,causal,bf16"] = bf16_case(group, cp, rank)
    return errors


def bf16_case(group, cp: int, rank: int) -> tuple[float, float]:
    """The ring in bf16 (how training under autocast runs it) against full attention in fp32 on the same bf16 inputs.
    With bf16's unit roundoff u = 2^-8: the block kernel may round the probabilities to bf16 before P·V (an error of
    at most u·max|v|), each block's output is rounded to bf16 (u of the output's scale), the merge runs in fp32 and its
    result is rounded once more (u): at most 2u·max|out| + u·max|v|, plus the fp32 chain. The backward's block
    gradients can cancel, so for them only dtype and finiteness are checked here."""
    seq = 2 * cp * CHUNK
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, seq, D, generator=g).to(DEVICE, torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    local = [shard_sequence(t, cp, rank, "zigzag", dim=2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, causal=True, layout="zigzag")
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in local)
    assert all(torch.isfinite(t.grad).all() for t in local)
    error = scaled_error(out.detach(), shard_sequence(ref, cp, rank, "zigzag", dim=2))
    u = 2.0**-8
    bound = 2 * u + u * v.abs().max().item() / ref.abs().max().item() + attention_tolerance(seq, cp, False)
    assert error <= bound, ("bf16", error, bound)
    return error, 0.0


class TinyLM(nn.Module):
    """Token and learned position embeddings, one causal attention block, a head: the parts cp touches."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(seq, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.q, self.v, self.proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        # No key bias: softmax cancels it, so its exact gradient is zero and both sides would compare rounding noise.
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, group=None, layout: str = "zigzag") -> torch.Tensor:
        x = self.wte(ids) + self.wpe(positions)
        b, s, _ = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, s, -1, D).transpose(1, 2) for p in (self.q, self.k, self.v))
        if group is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = ring_attention(q, k, v, group, causal=True, layout=layout)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, s, -1)))


def training_pattern(cp_group, cp: int, cp_rank: int, dp: int, dp_rank: int, layout: str) -> dict:
    """The loss and gradients of the cp pattern against one process on the global batch (``dp`` replicas x B rows)."""
    seq = 2 * cp * CHUNK
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (dp * B, seq + 1), generator=g)
    ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[torch.rand(labels.shape, generator=g) < 0.3] = -100  # replicas and slices hold different numbers of terms
    ids, labels = ids.to(DEVICE), labels.to(DEVICE)
    ref_model = TinyLM(seq).to(DEVICE)
    logits = ref_model(ids, torch.arange(seq, device=DEVICE))
    ref_loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")
    ref_loss = ref_loss / (labels != -100).sum()
    ref_loss.backward()

    model = TinyLM(seq).to(DEVICE)
    rows = slice(dp_rank * B, (dp_rank + 1) * B)
    # Labels are shifted on the full sequence, then sliced like the inputs: every slice keeps its own targets.
    local_ids, local_labels = (shard_sequence(t[rows], cp, cp_rank, layout) for t in (ids, labels))
    local_logits = model(local_ids, position_ids(seq, cp, cp_rank, layout, device=DEVICE), cp_group, layout)
    terms = (local_labels != -100).sum()
    dist.all_reduce(terms)  # the step's loss terms over dp x cp (here the world), as the global normalisation does
    summed = F.cross_entropy(local_logits.reshape(-1, VOCAB), local_labels.reshape(-1), ignore_index=-100, reduction="sum")
    (summed / terms).backward()
    loss = (summed / terms).detach()
    dist.all_reduce(loss)
    worst = 0.0
    for p, ref_p in zip(model.parameters(), ref_model.parameters()):
        dist.all_reduce(p.grad)  # replicated parameters: summed over dp x cp (each rank's loss is a share of the mean)
        worst = max(worst, scaled_error(p.grad, ref_p.grad))
    loss_error = abs(loss.item() - ref_loss.item())
    tol = model_tolerance(dp * B * seq)
    assert worst <= tol, ("gradients", layout, worst, tol)
    assert loss_error <= tol * ref_loss.item(), ("loss", layout, loss_error)
    return {"grad_error": worst, "loss_error": loss_error}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--world", type=int)
    args = parser.parse_args()
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
        torch.backends.cuda.matmul.allow_tf32 = False  # the bounds are fp32's
    dist.init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    layouts = [(world, dist.group.WORLD, rank, 1, 0)]  # (cp, cp group, cp rank, dp, dp rank)
    if world == 4:
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        layouts.append((2, halves[rank // 2], rank % 2, 2, rank // 2))
    mine = {}
    for cp, group, cp_rank, dp, dp_rank in layouts:
        key = f"dp{dp}xcp{cp}"
        mine[key] = {"errors": bad_inputs(group, cp), "round_trips": round_trips(group, cp, cp_rank),
                     "attention": attention_cases(group, cp, cp_rank),
                     "training": {layout: training_pattern(group, cp, cp_rank, dp, dp_rank, layout)
                                  for layout in ("contiguous", "zigzag")}}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    report = {"world": world, "ranks": everyone}
    if world == 4 and DEVICE.type == "cpu":
        # 5. the strategy with a "cp" mesh dimension (tests/scenarios/context_layouts.py), in the same processes:
        # starting them is the expensive part. (On GPUs fp32 ring slices need 64-token multiples: run it alone.)
        from tests.scenarios.context_layouts import run_all

        report["strategy"] = run_all(args.report.parent)
    if rank == 0:
        args.report.write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
