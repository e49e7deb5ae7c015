"""The planner's performance model: one candidate configuration → step time and memory per GPU.

Per pipeline stage and micro-batch: compute of its layers (the cost model), recomputation where the stage
checkpoints, tensor-parallel all-reduces, and the stage-boundary sends. Per step: the schedule's closed form (GPipe,
1F1B, interleaved; ``tests/test_planner_model.py`` checks them against ``pipeline/timing.py``), the data-parallel
gradient all-reduce that stays exposed after each rank's last backward (the first stage finishes last), the
optimizer step, and Optimus-CC compression: compressed backpropagation (CB) shrinks the cool-down's gradient sends
and costs a low-rank projection; selective compression (SC) shrinks the data-parallel all-reduce of the compressed
stages' weight matrices on links slower than ``sc_max_link_gbps`` and costs two GEMMs per matrix.
Memory per rank: weights, gradients and optimizer state (``state_bytes_per_param``), stored activations × the
micro-batches in flight (which the schedule fixes), the largest transient, SC's error-feedback buffers.
docs/planner.md derives every term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lightning_3d.costs import ClusterSpec, CostModel, ModelShape, layer_parameters, weight_matrices
from lightning_3d.costs.host import layer_host_time, microbatch_overhead, stage_pass_seconds

# The memory terms per rank are shared with the strategy's fit check (costs/memory.py: the strategies may not import
# the planner); re-exported here for the planner's users.
from lightning_3d.costs.memory import graph_gradient_bytes, in_flight, rank_memory

GIB = 2**30


@dataclass(frozen=True)
class Candidate:
    """One configuration: what the emitted YAML sets. ``layer_split``/``stage_checkpointing`` have pp × v entries.
    ``cuda_graphs``: the strategy's ``cuda_graphs=True`` (pp = tp = 1 only; docs/planner.md, "CUDA graphs")."""

    dp: int
    pp: int
    tp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    layer_split: tuple[int, ...]
    stage_checkpointing: tuple[bool, ...]
    compression: bool
    cuda_graphs: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages


@dataclass
class Workload:
    """What is trained and where: the model shape and lengths, the global batch (sequences per optimizer step),
    the cost model, the cluster, and the training state's bytes per parameter (fp32 weights, gradients and Adam's
    two moments: 16). ``host_runahead``: ``simulate_candidate`` times each pipeline rank's device and host apart, the
    host issuing one action ahead of the device (pipeline/timing.py; docs/planner.md says why it is off by default)."""

    shape: ModelShape
    seq_len: int
    global_batch_size: int
    cost_model: CostModel
    cluster: ClusterSpec
    target_len: int | None = None
    state_bytes_per_param: float = 16.0
    grad_bytes_per_param: float = 4.0
    memory_reserve: float = 1.5 * GIB  # CUDA context, allocator fragmentation, communication buffers
    cb_rank: int = 16
    sc_rank: int = 128
    sc_max_link_gbps: float = 50.0
    host_runahead: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def memory_budget(self) -> float:
        return self.cluster.memory_per_gpu - self.memory_reserve

    def block_kinds(self) -> list[str]:
        return [k for k in self.shape.layer_kinds() if k not in ("embedding", "head")]

    def layer_costs(self, mbs: int, tp: int, recompute: bool) -> tuple[np.ndarray, ...]:
        """Per block (pipeline order) and for embedding/head: fwd, bwd, stored, peak seconds/bytes, parameters, and
        the device's fwd, bwd and the host's fwd, bwd seconds apart (fwd = max(device, host) per layer); cached."""
        key = (mbs, tp, recompute)
        if key not in self._cache:
            out = {}
            for kind in {*self.block_kinds(), "embedding", "head"}:
                kw = dict(target_len=self.target_len, recompute=recompute and kind not in ("embedding", "head"), tp=tp)
                f, b = self.cost_model.layer_time(kind, mbs, self.seq_len, **kw)
                # A layer takes at least the host's time to issue its kernels (eager PyTorch launches each from
                # Python): the floor that holds where the measured span does not already show it (a tp shard the
                # profile lacks, whose compute is scaled down but whose launches are not; the host's time inside
                # the training loop, which the isolated span does not hold). Zeros for models without host times.
                hf, hb = layer_host_time(self.cost_model, kind, mbs, self.seq_len, **kw)
                st, pk = self.cost_model.layer_memory(kind, mbs, self.seq_len, **kw)
                measured = getattr(self.cost_model, "includes_tp_collectives", None)
                kind_rc = recompute and kind not in ("embedding", "head")
                # A grid measured across tp GPUs holds its collectives in its span (and their launches in its host
                # time): only a derived grid gets the modelled all-reduces.
                comm = 0.0 if measured is not None and measured(kind, kind_rc, tp) else self.tp_comm(kind, mbs, tp)
                extra_bwd = comm if recompute and kind not in ("embedding", "head") else 0.0
                df, db = float(f) + comm, float(b) + comm + extra_bwd
                out[kind] = (max(df, float(hf)), max(db, float(hb)), float(st), float(pk),
                             layer_parameters(self.shape, kind, tp), df, db, float(hf), float(hb))
            kinds = self.block_kinds()
            blocks = tuple(np.array([out[k][i] for k in kinds]) for i in range(9))
            self._cache[key] = (blocks, out["embedding"], out["head"])
            # Prefix sums (Python floats) of forward, backward, stored, parameters, and the device's and host's
            # forward and backward: O(1) stage sums; infinite (unprofiled) layers are counted apart, so that a stage
            # holding one is inf (not inf - inf = nan).
            self._cache[("prefix", *key)] = tuple(
                (np.concatenate([[0.0], np.cumsum(np.where(np.isinf(blocks[i]), 0.0, blocks[i]))]).tolist(),
                 np.concatenate([[0], np.cumsum(np.isinf(blocks[i]))]).tolist()) for i in (0, 1, 2, 4, 5, 6, 7, 8))
        return self._cache[key]

    def prefix_sums(self, mbs: int, tp: int, recompute: bool) -> tuple[list[float], ...]:
        self.layer_costs(mbs, tp, recompute)
        return self._cache[("prefix", mbs, tp, recompute)]

    def tokens(self, mbs: int, kind: str = "block") -> float:
        t = self.target_len if self.target_len is not None else self.seq_len
        return mbs * (t if kind in ("decoder_block", "head") else self.seq_len)

    def tp_comm(self, kind: str, mbs: int, tp: int) -> float:
        """Tensor-parallel all-reduces of one layer's forward (the backward has as many), ring cost."""
        if tp == 1:
            return 0.0
        count = {"embedding": 1, "head": 1, "decoder_block": 3}.get(kind, 2)
        size = self.tokens(mbs, kind) * self.shape.hidden_size * self.shape.bytes_per_element
        bw = self.cluster.bandwidth(tp)
        return count * (2 * (tp - 1) / tp * size / bw + self.cluster.latency)

    def boundary_bytes(self, mbs: int) -> float:
        """Bytes one pipeline boundary carries per micro-batch (T5 carries the encoder output and the decoder state)."""
        e, h = self.shape.bytes_per_element, self.shape.hidden_size
        if self.shape.family == "t5":
            return mbs * (self.seq_len + (self.target_len or self.seq_len)) * h * e
        return mbs * self.seq_len * h * e


@dataclass
class Prediction:
    """The model's answer for one candidate (seconds, bytes)."""

    candidate: Candidate
    step_time: float
    pipeline_time: float
    exposed_dp_time: float
    optimizer_time: float
    stage_forward: list[float]
    stage_backward: list[float]
    stage_memory: list[float]  # per pipeline rank
    peak_memory: float
    memory_budget: float
    tokens_per_step: float
    source: str = ""
    overhead_time: float = 0.0  # per step, outside the micro-batches and the optimizer (Lightning's loop, hooks)

    @property
    def fits(self) -> bool:
        """Runs: every cost finite (profiled) and the peak memory within the budget."""
        return math.isfinite(self.step_time) and self.peak_memory <= self.memory_budget

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_time if self.step_time > 0 else 0.0

    def summary(self) -> dict:
        c = self.candidate
        return {
            "step_time_s": round(self.step_time, 6), "tokens_per_s": round(self.tokens_per_second, 1),
            "peak_memory_gib": round(self.peak_memory / GIB, 3), "memory_budget_gib": round(self.memory_budget / GIB, 3),
            "pipeline_s": round(self.pipeline_time, 6), "exposed_dp_allreduce_s": round(self.exposed_dp_time, 6),
            "optimizer_s": round(self.optimizer_time, 6), "step_overhead_s": round(self.overhead_time,
                                                                                   6), "dp": c.dp, "pp": c.pp, "tp": c.tp,
            "microbatch_size": c.microbatch_size, "num_microbatches": c.num_microbatches, "schedule": c.schedule,
            "virtual_stages": c.virtual_stages, "layer_split": list(c.layer_split),
            "stage_checkpointing": list(c.stage_checkpointing), "compression": c.compression,
            "cuda_graphs": c.cuda_graphs, "costs": self.source,
        }


def stage_costs(c: Candidate, w: Workload) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    """Per stage (pipeline order, pp × v): forward s, backward s, stored bytes/micro-batch, transient bytes, params.

    A stage's pass over a micro-batch takes max(its layers' device seconds, their host seconds): the host issues the
    next layers' kernels while the device runs the earlier ones, so the two overlap across the stage's layers, not
    only within each (a per-layer max would charge every layer the slower of the two). A graphed stage
    (``c.cuda_graphs``) takes its layers' device seconds alone: the host issues one replay for all of them."""
    return stage_terms(c, w)[:5]


def stage_device_host(c: Candidate, w: Workload) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per stage: the device's forward and backward seconds and the host's (its issue time, the per-micro-batch
    overhead's half on each pass included): what the simulator times with the host running ahead of the device."""
    return stage_terms(c, w)[5:]


def stage_terms(c: Candidate, w: Workload) -> tuple[list[float], ...]:
    """``stage_costs``' five lists, then the device's forward and backward and the host's forward and backward."""
    fwd, bwd, stored, peak, params = [], [], [], [], []
    dev_f, dev_b, host_f, host_b = [], [], [], []
    start = 0
    mb_overhead = microbatch_overhead(w.cost_model)
    for s, (n, ckpt) in enumerate(zip(c.layer_split, c.stage_checkpointing)):
        blocks, emb, head = w.layer_costs(c.microbatch_size, c.tp, ckpt)
        _, _, pst, pp_, pdf, pdb, phf, phb = w.prefix_sums(c.microbatch_size, c.tp, ckpt)
        lo, hi = start, start + n
        start = hi
        st, p, df, db, hf, hb = (math.inf if count[hi] > count[lo] else total[hi] - total[lo]
                                 for total, count in (pst, pp_, pdf, pdb, phf, phb))
        pk = float(blocks[3][lo:hi].max()) if n else 0.0
        for is_end, x in ((s == 0, emb), (s == c.num_stages - 1, head)):
            if is_end:
                st, pk, p = st + x[2], max(pk, x[3]), p + x[4]
                df, db, hf, hb = df + x[5], db + x[6], hf + x[7], hb + x[8]
        if c.num_stages == 1 and w.shape.tied_embeddings:
            p -= emb[4]  # one stage holds the embedding and the head that shares its weight: one tensor, not two
        if c.cuda_graphs:
            # One replay launches the embedding's, blocks' and head's (the loss's) kernels: no per-layer host time.
            # The per-micro-batch overhead below stays: the engine's Python around each micro-batch, the forward and
            # backward calls, the input copies and the replay call run on the host outside the graph
            # (docs/planner.md, "CUDA graphs").
            hf = hb = 0.0
        # The rule dynamic micro-batching prices its micro-batches by too (costs/host.py): max(device, host) per
        # pass, plus half the per-micro-batch overhead on each (one forward and one backward call per stage).
        f, b = stage_pass_seconds(df, db, hf, hb, mb_overhead)
        fwd.append(float(f)), bwd.append(float(b)), stored.append(float(st)), peak.append(pk), params.append(float(p))
        dev_f.append(float(df)), dev_b.append(float(db))
        host_f.append(float(hf) + mb_overhead / 2), host_b.append(float(hb) + mb_overhead / 2)
    return fwd, bwd, stored, peak, params, dev_f, dev_b, host_f, host_b


def layer_terms(mbs: int, tp: int, recompute: bool, w: Workload) -> dict[str, float]:
    """One micro-batch through the whole model on one stage, term by term (seconds; what ``stage_costs`` adds up):
    the blocks' device and host seconds, the embedding's and head's, the per-micro-batch overhead."""
    blocks, emb, head = w.layer_costs(mbs, tp, recompute)
    out = {"blocks_device_f": float(blocks[5].sum()), "blocks_device_b": float(blocks[6].sum()),
           "blocks_host_f": float(blocks[7].sum()), "blocks_host_b": float(blocks[8].sum()),
           "embedding_device": emb[5] + emb[6], "embedding_host": emb[7] + emb[8],
           "head_device": head[5] + head[6], "head_host": head[7] + head[8],
           "microbatch_overhead": microbatch_overhead(w.cost_model)}
    return out


def pipeline_time(schedule: str, pp: int, v: int, m: int, fwd: list[float], bwd: list[float],
                  fsend: list[float], bsend: list[float]) -> float:
    """Closed-form makespan of one step's pipeline (sends per boundary: ``fsend`` activations, ``bsend`` gradients)."""
    hops = sum(fsend) + sum(bsend)
    if v == 1 and schedule == "gpipe":
        return sum(fwd) + (m - 1) * max(fwd) + sum(bwd) + (m - 1) * max(bwd) + hops
    if v == 1:
        # Steady state: a stage alternates one forward and one backward, and stage j can hold only pp - j
        # micro-batches, so its cycle is also bounded by the round trip through the stages after it over pp - j.
        both = [f + b for f, b in zip(fwd, bwd)]
        cycle = max(both)
        for j in range(pp):
            trip = sum(both[j:]) + sum(fsend[j:]) + sum(bsend[j:])
            cycle = max(cycle, trip / min(pp - j, m))
        return sum(both) + (m - 1) * cycle + hops
    per_rank = [sum(fwd[s] + bwd[s] for s in range(r, pp * v, pp)) for r in range(pp)]
    chunk = max(f + b for f, b in zip(fwd, bwd))
    return m * max(per_rank) + (pp - 1) * chunk + hops / v


def send_times(c: Candidate, w: Workload) -> tuple[list[float], list[float]]:
    """Per stage boundary: activation send and gradient send seconds (CB shrinks the gradients when on)."""
    cl = w.cluster
    size = w.boundary_bytes(c.microbatch_size)
    h = w.shape.hidden_size
    fsend, bsend = [], []
    for s in range(c.num_stages - 1):
        r0, r1 = s % c.pp, (s + 1) % c.pp
        crosses = any(((d * c.pp + r0) * c.tp) // cl.gpus_per_node != ((d * c.pp + r1) * c.tp) // cl.gpus_per_node
                      for d in range(c.dp))
        bw = cl.inter_node_bandwidth if crosses else cl.intra_node_bandwidth
        t = size / bw + cl.latency
        fsend.append(t)
        if c.compression:
            rows = size / (h * w.shape.bytes_per_element)
            small = (rows + h) * w.cb_rank * w.shape.bytes_per_element
            if size / small >= 2.0:
                flops = 4 * rows * h * w.cb_rank  # project and reconstruct
                t = small / bw + cl.latency + flops / (cl.device.peak_flops * cl.device.gemm_efficiency * 0.5)
        bsend.append(t)
    return fsend, bsend


def dp_allreduce(c: Candidate, w: Workload, params_per_rank: list[float], rank_stages: list[list[int]]) -> list[float]:
    """Seconds of each pipeline rank's gradient all-reduce over the dp group (SC-compressed where it applies)."""
    if c.dp == 1:
        return [0.0] * c.pp
    cl = w.cluster
    bw = cl.bandwidth(c.dp, c.pp * c.tp)
    sc = c.compression and bw < w.sc_max_link_gbps * 1e9
    out = []
    for r in range(c.pp):
        size = params_per_rank[r] * w.grad_bytes_per_param
        extra = 0.0
        if sc:
            kinds = _stage_kinds(c, w, rank_stages[r])
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
        out.append(2 * (c.dp - 1) / c.dp * size / bw + buckets * cl.latency + extra)
    return out


def _stage_kinds(c: Candidate, w: Workload, stages: list[int]) -> dict[str, int]:
    kinds = w.block_kinds()
    starts = np.concatenate([[0], np.cumsum(c.layer_split)])
    counts: dict[str, int] = {}
    for s in stages:
        for kind in kinds[starts[s]:starts[s + 1]]:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def step_overhead(c: Candidate, w: Workload, rank_stages: list[list[int]]) -> float:
    """The step's own seconds outside the micro-batches and the optimizer's kernels (the loop, the non-finite check,
    per-parameter bookkeeping), measured by the profiler: its value at the tiny model's blocks, plus its growth per
    block for the blocks the busiest rank holds beyond those (docs/planner.md, "The step's own seconds grow with
    depth"). Every rank does its own in parallel, so the rank with the most blocks sets it."""
    cm = w.cost_model
    fixed = float(getattr(cm, "step_overhead_seconds", 0.0) or 0.0)
    per_block = float(getattr(cm, "step_overhead_per_block_seconds", 0.0) or 0.0)
    if per_block:
        blocks = max(sum(c.layer_split[s] for s in stages) for stages in rank_stages)
        fixed += per_block * max(0, blocks - int(getattr(cm, "step_overhead_blocks", 0) or 0))
    return fixed


def predict(c: Candidate, w: Workload, *, timeline: tuple[float, list[float]] | None = None) -> Prediction:
    """Step time and memory of ``c`` (closed form; ``timeline`` = (makespan, per-rank end) from the simulator)."""
    fwd, bwd, stored, peak, params = stage_costs(c, w)
    fsend, bsend = send_times(c, w)
    v, pp, m = c.virtual_stages, c.pp, c.num_microbatches
    rank_stages = [list(range(r, c.num_stages, pp)) for r in range(pp)]
    params_rank = [sum(params[s] for s in st) for st in rank_stages]
    if timeline is None:
        total = pipeline_time(c.schedule, pp, v, m, fwd, bwd, fsend, bsend)
        # Rank r's last backward ends before the step's end by the backwards (and gradient hops) of the ranks
        # before it in the drain.
        ends = [total - sum(bwd[k] + bsend[k] for k in range(r)) for r in range(pp)]
    else:
        total, ends = timeline[0], list(timeline[1])
    ar = dp_allreduce(c, w, params_rank, rank_stages)
    finish = max(e + a for e, a in zip(ends, ar))
    exposed = max(0.0, finish - total)
    d = w.cluster.device
    per_param = getattr(w.cost_model, "optimizer_seconds_per_parameter", None)
    if per_param:
        optimizer = max(params_rank) * per_param  # measured by the profiler
    else:
        optimizer = 2 * max(params_rank) * w.state_bytes_per_param / d.memory_bandwidth  # Adam reads and writes its state
    memory = []
    for r, stages in enumerate(rank_stages):
        held = in_flight(c.schedule, pp, v, m, r)
        state = params_rank[r] * w.state_bytes_per_param
        if c.compression and c.dp > 1 and w.cluster.bandwidth(c.dp, pp * c.tp) < w.sc_max_link_gbps * 1e9:
            state += params_rank[r] * w.grad_bytes_per_param  # SC's error feedback
        top = max(stored[s] for s in stages)  # the rank's largest stored activations of one micro-batch
        if c.cuda_graphs:
            state += graph_gradient_bytes(params_rank[r], w.grad_bytes_per_param, top)
        memory.append(rank_memory(state, held, top, max(peak[s] for s in stages)))
    tokens = w.global_batch_size * (w.target_len if w.shape.family == "t5" and w.target_len else w.seq_len)
    fixed = step_overhead(c, w, rank_stages)
    return Prediction(c, total + exposed + optimizer + fixed, total, exposed, optimizer, fwd, bwd, memory, max(memory),
                      w.memory_budget, tokens, getattr(w.cost_model, "source", ""), fixed)


def simulate_candidate(c: Candidate, w: Workload) -> Prediction:
    """``predict`` with the pipeline timed by the schedule simulator (exact for unequal stages and sends)."""
    from lightning_3d.pipeline.schedules import build_schedule
    from lightning_3d.pipeline.timing import simulate

    fwd, bwd, stored, peak, _, dev_f, dev_b, host_f, host_b = stage_terms(c, w)
    fsend, bsend = send_times(c, w)
    orders = [build_schedule(c.schedule, c.pp, c.virtual_stages, c.num_microbatches, r) for r in range(c.pp)]
    lat = lambda a: fsend[a.stage] if a.kind == "F" else bsend[a.stage - 1]  # noqa: E731
    if w.host_runahead:
        # The device's seconds, each rank's host issuing one action ahead (pipeline/timing.py): a stage waiting for a
        # message has its next kernels queued already, and a host-bound pass overlaps the device's previous one.
        duration = lambda a: dev_f[a.stage] if a.kind == "F" else dev_b[a.stage]  # noqa: E731
        host = lambda a: host_f[a.stage] if a.kind == "F" else host_b[a.stage]  # noqa: E731
    else:  # each action takes max(device, host): the host waits for the device at every action
        duration, host = (lambda a: fwd[a.stage] if a.kind == "F" else bwd[a.stage]), None
    t = simulate(orders, c.num_stages, duration, latency=lat, stored=lambda a: stored[a.stage],
                 transient=lambda a: peak[a.stage], check=False, host=host)
    pred = predict(c, w, timeline=(t.makespan, list(t.rank_end)))
    # Memory from the simulated order (exact in-flight counts), with the weights and optimizer state added.
    closed = predict(c, w)
    state = [m - _act for m, _act in zip(closed.stage_memory, _activation_memory(c, stored, peak))]
    pred.stage_memory = [s + a for s, a in zip(state, t.peak_memory)]
    pred.peak_memory = max(pred.stage_memory)
    return pred


def _activation_memory(c: Candidate, stored: list[float], peak: list[float]) -> list[float]:
    out = []
    for r in range(c.pp):
        stages = list(range(r, c.num_stages, c.pp))
        out.append(in_flight(c.schedule, c.pp, c.virtual_stages, c.num_microbatches, r) * max(stored[s] for s in stages)
                   + max(peak[s] for s in stages))
    return out


def lower_bound_memory(w: Workload, tp: int, pp: int) -> float:
    """Weights + optimizer state per GPU at the most even split (what no micro-batch setting can reduce); a tied
    head is the embedding's tensor where one stage holds both (as ``stage_terms`` counts it)."""
    total = sum(layer_parameters(w.shape, k, tp) for k in w.shape.layer_kinds())
    if pp == 1 and w.shape.tied_embeddings:
        total -= layer_parameters(w.shape, "embedding", tp)
    return total / pp * w.state_bytes_per_param


def is_finite(p: Prediction) -> bool:
    return math.isfinite(p.step_time) and math.isfinite(p.peak_memory)
