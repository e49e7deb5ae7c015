"""The planner's communication terms: pipeline sends (compressed by CB where the pipeline link makes the strategy run
it), the data-parallel gradient synchronisation (SC where the data-parallel link makes it run; a reduce-scatter under
the sharded optimizer) and the sharded optimizer's parameter all-gather. docs/planner.md, "The performance model".

CB and SC are decided here as the strategy decides them at setup (strategies/cb_link.py, compression/config.py): CB
only where the bus bandwidth of an all-reduce over a pipeline's ranks is below ``cb_max_link_gbps``, SC only where the
data-parallel group's is below ``sc_max_link_gbps``, on the pipeline ranks of its default ``compressed_stages`` (all
but the last; the only one at pp = 1). The bandwidths are the cluster's figures (``ClusterSpec.bandwidth``), so a plan
for another cluster decides by that cluster's links.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_3d.costs import weight_matrices

# ``c`` is a ``planner.workload.Candidate`` and ``w`` a ``Workload`` throughout (model.py imports this module: the
# types are not imported back, which would be an import cycle).
Candidate = Workload = Any


def mesh_rank(c: Candidate, d: int, p: int, k: int, t: int) -> int:
    """The global rank of mesh coordinates (dp d, pp p, cp k, tp t): the mesh is ("dp", "pp", "cp", "tp"), tp
    innermost (distributed/parallel_dims.py)."""
    return ((d * c.pp + p) * c.cp + k) * c.tp + t


def pipeline_link(c: Candidate, w: Workload) -> float:
    """Bus bandwidth (bytes/s) of an all-reduce over one pipeline's ranks (cp x tp apart in the mesh), what CB decides
    by."""
    return w.cluster.bandwidth(c.pp, c.cp * c.tp)


def dp_link(c: Candidate, w: Workload) -> float:
    """Bus bandwidth (bytes/s) of the strategy's data-parallel group, dp x cp ranks (``Candidate.replicas``), what SC
    decides by and the gradient reduction runs over: inter-node once a group spans nodes."""
    if c.cp == 1:
        return w.cluster.bandwidth(c.dp, c.pp * c.tp)
    node = w.cluster.gpus_per_node
    spans = any(len({mesh_rank(c, d, p, k, 0) // node for d in range(c.dp) for k in range(c.cp)}) > 1
                for p in range(c.pp))
    return w.cluster.inter_node_bandwidth if spans else w.cluster.intra_node_bandwidth


def cb_runs(c: Candidate, w: Workload) -> bool:
    """Whether the strategy's default (``compressed_backprop="auto"``) compresses this candidate's activation gradients."""
    return c.compression and c.pp > 1 and pipeline_link(c, w) < w.cb_max_link_gbps * 1e9


def sc_runs(c: Candidate, w: Workload) -> bool:
    """Whether the strategy's default SC compresses this candidate's data-parallel gradients (on ``sc_ranks``)."""
    return c.compression and c.replicas > 1 and dp_link(c, w) < w.sc_max_link_gbps * 1e9


def sc_ranks(c: Candidate) -> set[int]:
    """The pipeline ranks of SC's default ``compressed_stages``: all but the last, the only one at pp = 1."""
    return set(range(max(1, c.pp - 1)))


def compression_acts(c: Candidate, w: Workload) -> bool:
    """Whether ``compression=True`` changes anything for this candidate (CB or SC runs); where it does not, it is
    the exact run under another name, and the search does not offer it."""
    return cb_runs(c, w) or sc_runs(c, w)


def send_times(c: Candidate, w: Workload) -> tuple[list[float], list[float]]:
    """Per stage boundary: activation send and gradient send seconds (CB shrinks the gradients where it runs)."""
    cl = w.cluster
    size = w.boundary_bytes(c.microbatch_size, c.cp)
    h = w.shape.hidden_size
    cb = cb_runs(c, w)
    fsend, bsend = [], []
    for s in range(c.num_stages - 1):
        r0, r1 = s % c.pp, (s + 1) % c.pp
        crosses = any(mesh_rank(c, d, r0, k, 0) // cl.gpus_per_node != mesh_rank(c, d, r1, k, 0) // cl.gpus_per_node
                      for d in range(c.dp) for k in range(c.cp))
        bw = cl.inter_node_bandwidth if crosses else cl.intra_node_bandwidth
        t = size / bw + cl.latency
        fsend.append(t)
        if cb:
            rows = size / (h * w.shape.bytes_per_element)
            small = (rows + h) * w.cb_rank * w.shape.bytes_per_element
            if size / small >= 2.0:
                flops = 4 * rows * h * w.cb_rank  # project and reconstruct
                t = small / bw + cl.latency + flops / (cl.device.peak_flops * cl.device.gemm_efficiency * 0.5)
        bsend.append(t)
    return fsend, bsend


def dp_allreduce(c: Candidate, w: Workload, params_per_rank: list[float], rank_stages: list[list[int]]) -> list[float]:
    """Seconds of each pipeline rank's gradient synchronisation over the dp x cp group (``Candidate.replicas``): a ring
    all-reduce, SC-compressed on its ranks where it runs; under the sharded optimizer a reduce-scatter, half the
    all-reduce's traffic (its all-gather of the parameters comes after the optimizer step: ``param_allgather``)."""
    replicas = c.replicas
    if replicas == 1:
        return [0.0] * c.pp
    cl = w.cluster
    bw = dp_link(c, w)
    sc = sc_runs(c, w)
    ranks = sc_ranks(c)
    out = []
    for r in range(c.pp):
        size = params_per_rank[r] * w.grad_bytes_per_param
        extra = 0.0
        if sc and r in ranks:
            kinds = stage_kinds(c, w, rank_stages[r])
            full = compressed = flops = 0.0
            for kind, count in kinds.items():
                for n, k in weight_matrices(w.shape, kind, c.tp):
                    if n * k / ((n + k) * w.sc_rank) >= 2.0:
                        full += count * n * k
                        compressed += count * (n + k) * w.sc_rank
                        flops += count * 4 * n * k * w.sc_rank
            size -= (full - compressed) * w.grad_bytes_per_param
            extra = flops / (cl.device.peak_flops * cl.device.gemm_efficiency)
        buckets = max(1.0, size / (25 * 2**20))
        # Reduce-scatter (ZeRO-1): one pass of the ring; all-reduce: two. An SC-compressed stage stays all-reduced
        # under ZeRO-1 and pays the all-gather on top (docs/sharded_optimizer.md).
        passes = 1 if c.shard_optimizer_state and not (sc and r in ranks) else 2
        out.append(passes * (replicas - 1) / replicas * size / bw + buckets * cl.latency + extra)
    return out


def param_allgather(c: Candidate, w: Workload, params_per_rank: list[float]) -> float:
    """The sharded optimizer's all-gather of the updated parameters (fp32: ``grad_bytes_per_param``) over the dp x cp
    group, waited for at the end of the step (docs/sharded_optimizer.md: not overlapped with the next forward); the
    slowest pipeline rank's. 0 without it or with one replica."""
    n = c.replicas
    if not c.shard_optimizer_state or n == 1:
        return 0.0
    size = max(params_per_rank) * w.grad_bytes_per_param
    return (n - 1) / n * size / dp_link(c, w) + max(1.0, size / (25 * 2**20)) * w.cluster.latency


def stage_kinds(c: Candidate, w: Workload, stages: list[int]) -> dict[str, int]:
    kinds = w.block_kinds()
    starts = np.concatenate([[0], np.cumsum(c.layer_split)])
    counts: dict[str, int] = {}
    for s in stages:
        for kind in kinds[starts[s]:starts[s + 1]]:
            counts[kind] = counts.get(kind, 0) + 1
    return counts
