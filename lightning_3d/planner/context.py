"""The planner's context-parallel terms: where cp applies, and what a block costs on top of its layers at ``seq / cp``.

A block of a cp rank runs its layers on ``seq / cp`` tokens (the cost model at that length: ``Workload.layer_costs``)
and, in its attention, what those layers' own attention does not: the (query, key) pairs of the other ranks' keys,
and the exchange of keys and values that gives it them. Priced from what ``lightning_3d/context`` runs (the strategy
always takes the zigzag layout from the planner, whose causal work is the same on every rank and at every ring step):

- Compute: under zigzag each of the cp ring steps computes as many causal pairs as the whole attention of a
  ``seq / cp`` sequence (docs/context_parallel.md, "Layouts"), and Ulysses' one attention over the whole sequence on
  ``heads / cp`` heads the same sum. The layers at ``seq / cp`` hold one such step; the other ``cp - 1`` are the extra
  work, ``(cp - 1) * t_att`` forward and ``BACKWARD_ATTENTION`` times that backward, with ``t_att`` the causal
  attention FLOPs of ``seq / cp`` tokens at the analytic model's attention rate (a profile does not time attention
  apart from its block).
- Ring (``ring_attention.py`` on torch's ``_templated_ring_attention``): forward, the K/V slice for step i + 1 is sent
  (to rank + 1) before step i's block and waited for after it: ``cp - 1`` transfers, each hidden behind one step's
  block, exposed where longer. Backward, K/V circulate again the same way, and each step's dK/dV (fp32: the ring
  accumulates in fp32) leave after the step's block and are waited for after the next one; the last dK/dV, which
  returns them to their owner, is waited for after the last block: nothing hides it.
- Ulysses (``ulysses.py``): all-to-alls of q, k, v and the output in the forward, the same four in the backward, all
  between the attention's kernels: exposed whole.
- Memory: the stored activations are those of the layers at ``seq / cp`` (the ring and Ulysses save what SDPA saves);
  the transients add the exchange's buffers (``transient_bytes``).

Left out (docs/planner.md): the ring's merges and copies (element-wise, memory-bound), the host's launches of the
extra ring steps, and the slowdown of the block kernels while the transfers share the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_3d.context import ATTENTIONS, check_layout, check_ulysses_heads
from lightning_3d.costs.analytic import ATTENTION_EFFICIENCY, BACKWARD_ATTENTION

# ``w`` is a ``planner.workload.Workload`` (which imports this module: the type is not imported back).
Workload = Any

#: The layout the planner emits: zigzag balances causal work over the cp ranks, which the terms below assume (the
#: contiguous layout's last rank does ``2 - 1/cp`` times the average attention and would need its own terms).
LAYOUT = "zigzag"
#: Bytes per element of the ring's dK/dV accumulators and messages (``convert_to_f32`` in ``utils/compat.py``).
GRAD_ACCUM_BYTES = 4


def refusal(w: Workload, cp: int, attention: str, tp: int, sequence_parallel: bool = False) -> str | None:
    """Why ``cp`` context-parallel ranks with ``attention`` cannot train this workload at tensor-parallel size ``tp``
    (the strategy's and the recipe's checks, before any process starts), or None where they can."""
    if cp == 1:
        return None
    if attention not in ATTENTIONS:
        return f"context_parallel_attention={attention!r} is not one of {ATTENTIONS}"
    if w.context_parallel_refusal is not None:
        return w.context_parallel_refusal
    if w.target_len is not None:
        return ("an encoder-decoder's two sequences and cross-attention are not what context-parallel attention splits"
                " (causal self-attention over one sequence)")
    try:
        check_layout(w.seq_len, cp, LAYOUT, tp if sequence_parallel else 1)
        if attention == "ulysses":
            check_ulysses_heads(w.shape.num_heads // tp, cp)
    except ValueError as err:
        return str(err)
    return None


def attention_width(w: Workload) -> int:
    """Heads x head dim (``a d``), the width of q, k, v and the attention's output."""
    s = w.shape
    return s.num_heads * (s.head_dim or s.hidden_size // s.num_heads)


def slice_elements(w: Workload, mbs: int, tp: int, cp: int) -> float:
    """Elements of one of q, k, v (or the output) on one rank: ``mbs`` sequences of ``seq / cp`` tokens, its
    ``heads / tp`` heads."""
    return mbs * w.seq_len / cp * attention_width(w) / tp


def step_attention_seconds(w: Workload, mbs: int, tp: int, cp: int) -> float:
    """Forward seconds of one ring step's block: causal attention over ``seq / cp`` tokens (``4 b s² ad / 2`` FLOPs,
    over tp), at the analytic model's attention rate on the cluster's device."""
    d = w.cluster.device
    s = w.seq_len / cp
    flops = 4 * mbs * s * s * attention_width(w) / tp * 0.5
    return flops / (d.peak_flops * d.gemm_efficiency * ATTENTION_EFFICIENCY)


def link(w: Workload, cp: int, tp: int) -> float:
    """Bytes/s between the ranks of a cp group (tp apart in the mesh dp, pp, cp, tp): the cluster's figure for the
    group, inter-node once it spans nodes."""
    return w.cluster.bandwidth(cp, tp)


def ring_exposed(w: Workload, mbs: int, tp: int, cp: int) -> tuple[float, float]:
    """(forward, backward) seconds of the ring's transfers that its blocks do not hide (module docstring)."""
    bw, lat = link(w, cp, tp), w.cluster.latency
    n = slice_elements(w, mbs, tp, cp)
    kv = 2 * n * w.shape.bytes_per_element / bw + lat
    dkv = 2 * n * GRAD_ACCUM_BYTES / bw + lat
    f = step_attention_seconds(w, mbs, tp, cp)
    b = BACKWARD_ATTENTION * f
    forward = (cp - 1) * max(0.0, kv - f)
    # Backward windows: block 0 hides K/V for step 1; blocks 1..cp-2 hide K/V for the next step and the previous
    # step's dK/dV, which share the link; the last block hides the previous dK/dV; the last dK/dV is waited for whole.
    backward = max(0.0, kv - b) + (cp - 2) * max(0.0, kv + dkv - b) + max(0.0, dkv - b) + dkv
    return forward, backward


def ulysses_exposed(w: Workload, mbs: int, tp: int, cp: int) -> tuple[float, float]:
    """(forward, backward) seconds of Ulysses' all-to-alls: four per pass (q, k, v, output), each rank sending
    ``(cp - 1) / cp`` of its slice."""
    bw, lat = link(w, cp, tp), w.cluster.latency
    one = (cp - 1) / cp * slice_elements(w, mbs, tp, cp) * w.shape.bytes_per_element / bw + lat
    return 4 * one, 4 * one


def transient_bytes(w: Workload, mbs: int, tp: int, cp: int, attention: str) -> float:
    """The exchange's buffers on top of a block's own transient, at their largest (the backward). Ring: the fp32 dQ
    accumulator and the dK/dV received and sent (five fp32 slices), the K/V received and sent (four slices);
    Ulysses: an all-to-all's contiguous input and its output (two slices)."""
    n, e = slice_elements(w, mbs, tp, cp), w.shape.bytes_per_element
    if attention == "ulysses":
        return 2 * n * e
    return n * (5 * GRAD_ACCUM_BYTES + 4 * e)


@dataclass(frozen=True)
class BlockTerms:
    """What cp adds to one block's pass over one micro-batch (device seconds, bytes)."""

    forward: float  # extra attention work + exposed exchange, forward
    backward: float  # the same, backward (without the recomputed forward)
    transient: float
    compute_forward: float  # the parts apart (docs, tests)
    compute_backward: float
    comm_forward: float
    comm_backward: float


def block_terms(w: Workload, mbs: int, tp: int, cp: int, attention: str) -> BlockTerms:
    """The context-parallel terms of one block (zeros at cp = 1)."""
    if cp == 1:
        return BlockTerms(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    extra_f = (cp - 1) * step_attention_seconds(w, mbs, tp, cp)
    extra_b = BACKWARD_ATTENTION * extra_f
    comm_f, comm_b = (ulysses_exposed if attention == "ulysses" else ring_exposed)(w, mbs, tp, cp)
    return BlockTerms(extra_f + comm_f, extra_b + comm_b, transient_bytes(w, mbs, tp, cp, attention), extra_f, extra_b,
                      comm_f, comm_b)
