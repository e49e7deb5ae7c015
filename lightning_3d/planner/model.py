"""The planner's performance model: one candidate configuration → step time and memory per GPU.

Per pipeline stage and micro-batch: compute of its layers (the cost model, at ``seq / cp`` tokens), recomputation
where the stage checkpoints, tensor-parallel all-reduces, context-parallel attention's extra work and exchange
(``context.py``), and the stage-boundary sends. Per step: the schedule's closed form (GPipe, 1F1B, interleaved, and
the zero-bubble ``zb_h1``/``zb_interleaved``; ``tests/test_planner_model.py`` checks them against
``pipeline/timing.py``), the gradient all-reduce over the dp x cp replicas that stays exposed after each rank's last
backward (the first stage finishes last), the
optimizer step, and Optimus-CC compression: compressed backpropagation (CB) shrinks the cool-down's gradient sends
and costs a low-rank projection; selective compression (SC) shrinks the data-parallel all-reduce of the compressed
stages' weight matrices on links slower than ``sc_max_link_gbps`` and costs two GEMMs per matrix.
Memory per rank: weights, gradients and optimizer state (``state_bytes_per_param``), stored activations × the
micro-batches in flight (which the schedule fixes), the largest transient, SC's error-feedback buffers.
docs/planner.md derives every term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_3d.costs import layer_parameters, weight_matrices
from lightning_3d.costs.analytic import ATTENTION_EFFICIENCY, BACKWARD_ATTENTION
from lightning_3d.costs.host import microbatch_overhead, stage_pass_seconds

# The memory terms per rank are shared with the strategy's fit check (costs/memory.py: the strategies may not import
# the planner); re-exported here for the planner's users.
from lightning_3d.costs.memory import graph_gradient_bytes, in_flight, rank_memory
from lightning_3d.pipeline.schedules import schedule_spec
from lightning_3d.planner.communication import dp_allreduce, param_allgather, sc_ranks, sc_runs, send_times

# Candidate and Workload live in workload.py (what is priced); re-exported here, where the planner's users import them.
from lightning_3d.planner.workload import GIB, Candidate, Workload

__all__ = ["GIB", "Candidate", "Prediction", "Workload", "graph_gradient_bytes", "in_flight", "layer_terms",
           "lower_bound_memory", "pipeline_time", "predict", "rank_memory", "sharded_state_bytes", "simulate_candidate",
           "stage_costs", "stage_device_host", "stage_terms", "weight_grad_fraction", "weight_grad_seconds"]


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
            "cuda_graphs": c.cuda_graphs, "sequence_parallel": c.sequence_parallel,
            "shard_optimizer_state": c.shard_optimizer_state, "context_parallel_size": c.cp,
            "context_parallel_attention": c.cp_attention if c.cp > 1 else None, "compile": c.compile,
            "costs": self.source,
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
        how = (c.microbatch_size, c.tp, ckpt, c.sequence_parallel, c.cp, c.cp_attention)
        blocks, emb, head = w.layer_costs(*how)
        _, _, pst, pp_, pdf, pdb, phf, phb = w.prefix_sums(*how)
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


#: The zero-bubble schedules the model prices, by the schedule whose order of forwards and backwards they keep.
ZERO_BUBBLE = {"zb_h1": "1f1b", "zb_interleaved": "interleaved_1f1b"}


def pipeline_time(schedule: str, pp: int, v: int, m: int, fwd: list[float], bwd: list[float],
                  fsend: list[float], bsend: list[float], wgrad: list[float] | None = None) -> float:
    """Closed-form makespan of one step's pipeline (sends per boundary: ``fsend`` activations, ``bsend`` gradients;
    ``wgrad``: per stage, the weight-gradient seconds a zero-bubble schedule defers, 0 where it does not split)."""
    hops = sum(fsend) + sum(bsend)
    if schedule in ZERO_BUBBLE:
        # The base order (1F1B, interleaved 1F1B) with each split backward's W moved into the warm-up and drain: the
        # idle time per rank falls from (pp - 1)(F + B + W) to (pp - 1)(F + B - W) per stage (chunk, interleaved) of
        # the base's bubble (pipeline/zero_bubble.py; the simulator gives exactly this for equal chunks, tested); the
        # smallest split W bounds the gain.
        split = [x for x in (wgrad or []) if x > 0]
        gain = 2 * (pp - 1) * min(split) if split and pp > 1 else 0.0
        return pipeline_time(ZERO_BUBBLE[schedule], pp, v, m, fwd, bwd, fsend, bsend) - gain
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
        total = pipeline_time(c.schedule, pp, v, m, fwd, bwd, fsend, bsend, weight_grad_seconds(c, w, bwd))
        # Rank r's last backward ends before the step's end by the backwards (and gradient hops) of the ranks
        # before it in the drain.
        ends = [total - sum(bwd[k] + bsend[k] for k in range(r)) for r in range(pp)]
    else:
        total, ends = timeline[0], list(timeline[1])
    ar = dp_allreduce(c, w, params_rank, rank_stages)
    finish = max(e + a for e, a in zip(ends, ar))
    # The sharded optimizer's all-gather of the parameters is waited for at the step's end: exposed whole.
    exposed = max(0.0, finish - total) + param_allgather(c, w, params_rank)
    d = w.cluster.device
    # The replicas are dp x cp: cp ranks hold the same parameters and reduce with the data-parallel ones.
    zero = c.shard_optimizer_state and c.replicas > 1
    per_param = getattr(w.cost_model, "optimizer_seconds_per_parameter", None)
    if per_param:
        optimizer = max(params_rank) * per_param  # measured by the profiler
    else:
        optimizer = 2 * max(params_rank) * w.state_bytes_per_param / d.memory_bandwidth  # Adam reads and writes its state
    if zero:
        optimizer /= c.replicas  # each replica updates its share of the parameters (an element-wise optimizer)
    state_bytes = sharded_state_bytes(w.state_bytes_per_param, c.replicas) if zero else w.state_bytes_per_param
    sc = sc_runs(c, w)
    memory = []
    for r, stages in enumerate(rank_stages):
        held = in_flight(c.schedule, pp, v, m, r)
        state = params_rank[r] * state_bytes
        if sc and r in sc_ranks(c):
            state += params_rank[r] * w.grad_bytes_per_param  # SC's error feedback
        top = max(stored[s] for s in stages)  # the rank's largest stored activations of one micro-batch
        if c.cuda_graphs:
            state += graph_gradient_bytes(params_rank[r], w.grad_bytes_per_param, top)
        memory.append(rank_memory(state, held, top, max(peak[s] for s in stages)))
    tokens = w.global_batch_size * (w.target_len if w.shape.family == "t5" and w.target_len else w.seq_len)
    fixed = step_overhead(c, w, rank_stages)
    return Prediction(c, total + exposed + optimizer + fixed, total, exposed, optimizer, fwd, bwd, memory, max(memory),
                      w.memory_budget, tokens, getattr(w.cost_model, "source", ""), fixed)


def sharded_state_bytes(state_bytes_per_param: float, dp: int) -> float:
    """Bytes per parameter under ZeRO-1 at ``dp``: weights and gradients whole, the optimizer's share 1/dp — fp32
    moments (8 of 16 bytes), or moments and fp32 master weights under bf16-true (12 of the 8 + 12 bytes; 8 is what the
    planner holds for bf16-true replicated: costs/memory.py ``TrainingState``)."""
    if state_bytes_per_param == 8.0:  # bf16-true: bf16 weights and gradients, fp32 moments and master weights sharded
        return 4.0 + 12.0 / dp
    return state_bytes_per_param / 2 + state_bytes_per_param / 2 / dp


def weight_grad_fraction(w: Workload) -> float:
    """The share of a block's backward that is its weight gradients (W of a zero-bubble schedule), from its FLOPs:
    the weight GEMMs (as many FLOPs as the forward's GEMMs) over the backward's GEMMs (twice the forward's) and
    attention (``BACKWARD_ATTENTION`` times its forward, at ``ATTENTION_EFFICIENCY``), tp = 1; memory-bound work is
    counted in B. Causal attention for GPT (half the scores' work), full for T5."""
    shape = w.shape
    kind = w.block_kinds()[0] if w.block_kinds() else "block"
    gemm = 2 * sum(n * k for n, k in weight_matrices(shape, kind, 1))
    ad = shape.num_heads * (shape.head_dim or shape.hidden_size // shape.num_heads)
    attn = 4 * w.seq_len * ad * (0.5 if shape.family == "gpt" else 1.0)
    return gemm / (2 * gemm + BACKWARD_ATTENTION * attn / ATTENTION_EFFICIENCY)


def weight_grad_seconds(c: Candidate, w: Workload, bwd: list[float]) -> list[float]:
    """Per stage, the seconds of W its schedule defers (``weight_grad_fraction`` of its backward): stages of a
    splitting schedule (``zb_h1``, ``zb_interleaved``) but the first (stage 0's input gradient goes nowhere: it keeps
    whole backwards, ``zero_bubble.defer_weights``), else 0."""
    if not schedule_spec(c.schedule).splits_backward:
        return [0.0] * len(bwd)
    frac = weight_grad_fraction(w)
    return [frac * b if s > 0 else 0.0 for s, b in enumerate(bwd)]


def simulate_candidate(c: Candidate, w: Workload) -> Prediction:
    """``predict`` with the pipeline timed by the schedule simulator (exact for unequal stages and sends)."""
    from lightning_3d.pipeline.schedules import build_schedule
    from lightning_3d.pipeline.timing import simulate

    fwd, bwd, stored, peak, _, dev_f, dev_b, host_f, host_b = stage_terms(c, w)
    fsend, bsend = send_times(c, w)
    orders = [build_schedule(c.schedule, c.pp, c.virtual_stages, c.num_microbatches, r) for r in range(c.pp)]
    lat = lambda a: fsend[a.stage] if a.kind == "F" else bsend[a.stage - 1]  # noqa: E731
    # A split backward: B is the backward less its W, and W runs as an action of its own (zero-bubble schedules).
    frac = [x / b if b > 0 else 0.0 for x, b in zip(weight_grad_seconds(c, w, bwd), bwd)]

    def part(a, x: float, s: int) -> float:
        return x * frac[s] if a.kind == "W" else x * (1 - frac[s]) if frac[s] else x

    if w.host_runahead:
        # The device's seconds, each rank's host issuing one action ahead (pipeline/timing.py): a stage waiting for a
        # message has its next kernels queued already, and a host-bound pass overlaps the device's previous one.
        duration = lambda a: dev_f[a.stage] if a.kind == "F" else part(a, dev_b[a.stage], a.stage)  # noqa: E731
        host = lambda a: host_f[a.stage] if a.kind == "F" else part(a, host_b[a.stage], a.stage)  # noqa: E731
    else:  # each action takes max(device, host): the host waits for the device at every action
        duration, host = (lambda a: fwd[a.stage] if a.kind == "F" else part(a, bwd[a.stage], a.stage)), None
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


def lower_bound_memory(w: Workload, tp: int, pp: int, sharded_over: int = 1) -> float:
    """Weights + optimizer state per GPU at the most even split (what no micro-batch setting can reduce); a tied
    head is the embedding's tensor where one stage holds both (as ``stage_terms`` counts it). ``sharded_over``: the
    dp degree the optimizer state is sharded over (ZeRO-1), 1 without."""
    total = sum(layer_parameters(w.shape, k, tp) for k in w.shape.layer_kinds())
    if pp == 1 and w.shape.tied_embeddings:
        total -= layer_parameters(w.shape, "embedding", tp)
    per_param = sharded_state_bytes(w.state_bytes_per_param, sharded_over) if sharded_over > 1 else w.state_bytes_per_param
    return total / pp * per_param


def is_finite(p: Prediction) -> bool:
    return math.isfinite(p.step_time) and math.isfinite(p.peak_memory)
