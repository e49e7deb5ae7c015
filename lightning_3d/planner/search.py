"""The configuration search: every uniform (dp, pp, cp, tp, micro-batch, schedule, virtual stages, compression)
"skeleton", and within each the stage split and per-stage activation checkpointing.

Within a skeleton: exhaustively over every split × checkpointing vector where that space is small
(``exhaustive_limit``); otherwise a balanced split (binary search on the slowest stage's time with a greedy fill,
memory caps included, embedding and head costs on the end stages), checkpointing switched on where a stage's memory
does not fit, and then Aceso's bottleneck relief on the few best skeletons: move a layer off the slowest stage to
another stage, or flip the slowest stage's checkpointing, while the predicted step time falls. The best candidates are
re-timed with the schedule simulator (``pipeline/timing.py``) and the top-k returned, with every further re-timed
candidate within the model's error of the best (``planner/confidence.py``). A wall-clock budget bounds
the whole search (the best found so far is returned, marked ``truncated``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from lightning_3d.context import ATTENTIONS
from lightning_3d.pipeline.schedules import SCHEDULES, schedule_spec
from lightning_3d.planner import context
from lightning_3d.planner.communication import compression_acts
from lightning_3d.planner.confidence import check_model_error, validated_error, within_error
from lightning_3d.planner.model import GIB, ZERO_BUBBLE, Candidate, Prediction, Workload, lower_bound_memory, predict, simulate_candidate

#: The schedules the performance model prices (closed forms in model.pipeline_time, memory in costs.memory.in_flight).
PRICED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", *ZERO_BUBBLE)


@dataclass
class SearchOptions:
    """What the search may choose. ``per_stage_checkpointing=False`` keeps checkpointing uniform (all stages or
    none), for strategies without ``stage_activation_checkpointing``."""

    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_interleaved")
    max_virtual_stages: int = 4
    microbatch_sizes: tuple[int, ...] | None = None  # default: powers of two up to 64 that divide the replica batch
    compression: tuple[bool, ...] = (False, True)
    cuda_graphs: tuple[bool, ...] = (False, True)  # offered where the strategy accepts it: pp = tp = 1
    sequence_parallel: tuple[bool, ...] = (False, True)  # offered at tp > 1
    shard_optimizer_state: tuple[bool, ...] = (False, True)  # offered at dp > 1 (eager: not with CUDA graphs)
    tensor_parallel_sizes: tuple[int, ...] | None = None
    pipeline_parallel_sizes: tuple[int, ...] | None = None
    # Context parallelism (planner/context.py): the cp degrees tried where the model, its data and the sequence allow
    # them (None: every divisor of the GPUs; (1,): none), and the attentions tried at cp > 1.
    context_parallel_sizes: tuple[int, ...] | None = None
    context_parallel_attention: tuple[str, ...] = ATTENTIONS
    # The model's compile (api.plan searches each value with its own cost model): None offers both where the profile
    # has compiled grids, eager alone where it has none; (True,) needs compiled grids.
    compile: tuple[bool, ...] | None = None
    per_stage_checkpointing: bool = True
    allow_checkpointing: bool = True
    exhaustive_limit: int = 2048
    relief_skeletons: int = 16
    time_budget_s: float = 60.0
    top_k: int = 5
    simulate_max_actions: int = 8_000  # larger pipelines keep their closed-form time (the simulator is Python)
    # The model's time error (a fraction): candidates beyond the top-k within it of the best are returned too
    # (planner/confidence.py); None: the validated error documented in docs/planner.md.
    model_error: float | None = None

    def __post_init__(self) -> None:
        for name in ("schedules", "context_parallel_attention"):
            if isinstance(getattr(self, name), str):  # one name given where a tuple is expected
                setattr(self, name, (getattr(self, name),))
        unknown = [s for s in self.schedules if s not in PRICED_SCHEDULES]
        if unknown:
            registered = [s for s in unknown if s in SCHEDULES]
            why = (f" ({', '.join(map(repr, registered))} is registered, but the performance model has no makespan or"
                   " memory rule for it)" if registered else "")
            raise ValueError(f"SearchOptions(schedules={self.schedules!r}): {', '.join(map(repr, unknown))} cannot be"
                             f" searched{why}; use schedules from {PRICED_SCHEDULES}.")
        bad = [a for a in self.context_parallel_attention if a not in ATTENTIONS]
        if bad or not self.context_parallel_attention:
            raise ValueError(f"SearchOptions(context_parallel_attention={self.context_parallel_attention!r}): give one or"
                             f" more of {ATTENTIONS} (the strategy's context_parallel_attention values).")
        if self.compile is not None and (not self.compile or any(not isinstance(x, bool) for x in self.compile)):
            raise ValueError(f"SearchOptions(compile={self.compile!r}): give (False,), (True,), (False, True) or None"
                             " (both where the profile has compiled grids).")
        sizes = self.context_parallel_sizes
        if sizes is not None and (not sizes or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in sizes)):
            raise ValueError(f"SearchOptions(context_parallel_sizes={sizes!r}): give positive integers, e.g. (1, 2, 4),"
                             " (1,) to search without context parallelism, or None for every degree that applies.")


@dataclass
class SearchResult:
    top: list[Prediction]
    skeletons: int
    evaluated: int
    seconds: float
    truncated: bool
    shortfall: list[str] = field(default_factory=list)
    model_error: float = 0.0  # the error the runner-ups were chosen by (planner/confidence.py)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_parallel_choices(w: Workload, num_gpus: int, tp: int, opts: SearchOptions) -> list[tuple[int, str]]:
    """(cp, attention) pairs to try at tensor-parallel size ``tp``: (1, "ring") (no context parallelism), then every
    cp > 1 of ``opts`` dividing the GPUs left by tp with each attention the strategy and the model accept there
    (``context.refusal``: the recipe's rule, the zigzag layout's divisibility, Ulysses' heads)."""
    out = [(1, "ring")] if opts.context_parallel_sizes is None or 1 in opts.context_parallel_sizes else []
    for cp in opts.context_parallel_sizes or _divisors(num_gpus // tp):
        if cp == 1 or (num_gpus // tp) % cp:
            continue
        out += [(cp, a) for a in opts.context_parallel_attention if context.refusal(w, cp, a, tp) is None]
    return out


def skeletons(w: Workload, num_gpus: int, opts: SearchOptions):
    """Every uniform configuration that the strategy accepts, as (dp, pp, tp, mbs, m, schedule, v, compression,
    cuda_graphs, sequence_parallel, shard_optimizer_state, cp, cp_attention). ``compression=True`` only where CB or SC
    would run on the cluster's links (``communication.compression_acts``: elsewhere it is the exact run);
    ``cuda_graphs=True`` only at pp = tp = cp = 1 (the strategy's check_cuda_graphs; at pp = 1 the schedule is 1F1B);
    sequence parallelism at tp > 1 (with cp, where the rank's slice divides by tp); the sharded optimizer with
    several replicas (dp x cp > 1), eager; context parallelism where ``context_parallel_choices`` allows it. For each
    (layout, micro-batching, schedule, compression) the plain variant (no graphs, sequence parallelism or sharding)
    comes first."""
    shape, cl = w.shape, w.cluster
    blocks = len(w.block_kinds())
    tps = opts.tensor_parallel_sizes or [t for t in _divisors(num_gpus) if t <= cl.gpus_per_node]
    for tp in tps:
        if num_gpus % tp or shape.num_heads % tp or shape.hidden_size % tp or shape.ffn_hidden_size % tp:
            continue
        for cp, attention in context_parallel_choices(w, num_gpus, tp, opts):
            yield from _layouts(w, num_gpus, tp, cp, attention, blocks, opts)


def _layouts(w: Workload, num_gpus: int, tp: int, cp: int, attention: str, blocks: int, opts: SearchOptions):
    """``skeletons`` at one (tp, cp, attention)."""
    for pp in opts.pipeline_parallel_sizes or _divisors(num_gpus // (tp * cp)):
        if (num_gpus // (tp * cp)) % pp or pp > blocks:
            continue
        dp = num_gpus // (tp * cp * pp)
        if w.global_batch_size % dp:
            continue
        replica = w.global_batch_size // dp
        sizes = opts.microbatch_sizes or [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= replica]
        for mbs in sizes:
            if replica % mbs:
                continue
            m = replica // mbs
            for schedule in opts.schedules:
                if pp == 1 and schedule != "1f1b":
                    continue  # one stage: every schedule runs the same order
                if schedule in ("1f1b", "zb_h1") and m < pp:
                    continue
                vs = [1]
                if schedule_spec(schedule).interleaved:  # several looped stages per rank, m a multiple of pp
                    if pp < 2 or m % pp:
                        continue
                    vs = [v for v in range(2, opts.max_virtual_stages + 1) if pp * v <= blocks]
                for v in vs:
                    probe = Candidate(dp, pp, tp, mbs, m, schedule, v, (), (), True, cp=cp, cp_attention=attention)
                    for comp in sorted(set(opts.compression)) if compression_acts(probe, w) else (False,):
                        for graphs in sorted(set(opts.cuda_graphs)) if (pp == tp == cp == 1) else (False,):
                            for sp in sorted(set(opts.sequence_parallel)) if sp_fits(w, tp, cp, attention) else (False,):
                                zeros = (sorted(set(opts.shard_optimizer_state)) if dp * cp > 1 and not graphs
                                         else (False,))
                                for zero in zeros:
                                    yield dp, pp, tp, mbs, m, schedule, v, comp, graphs, sp, zero, cp, attention


def sp_fits(w: Workload, tp: int, cp: int = 1, attention: str = "ring") -> bool:
    """Whether sequence parallelism applies: tp > 1 and every sequence (and target) length divisible by tp; with cp,
    each rank's slice (the strategy's check_layout)."""
    if cp > 1:
        return tp > 1 and context.refusal(w, cp, attention, tp, sequence_parallel=True) is None
    return tp > 1 and w.seq_len % tp == 0 and (w.target_len is None or w.target_len % tp == 0)


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if i < extra else 0) for i in range(stages))


class _Skeleton:
    """Prefix sums of per-block costs for one skeleton: O(1) stage sums for the balanced split."""

    def __init__(self, w: Workload, base: Candidate) -> None:
        self.w, self.base = w, base
        self.S = base.num_stages
        self.L = len(w.block_kinds())
        self.pref, self.ends = {}, {}
        # Per layer: max(device, host) seconds; a graphed stage's layers cost their device seconds (model.stage_terms).
        f, b = (5, 6) if base.cuda_graphs else (0, 1)
        for ckpt in (False, True):
            blocks, emb, head = w.layer_costs(base.microbatch_size, base.tp, ckpt, False, base.cp, base.cp_attention)
            # Unprofiled layers (inf) as a huge finite time: the bisection stays well defined and avoids them.
            self.pref[ckpt] = np.concatenate([[0.0], np.cumsum(np.minimum(blocks[f] + blocks[b], 1e30))])
            self.ends[ckpt] = (min(emb[f] + emb[b], 1e30), min(head[f] + head[b], 1e30))

    def stage_time(self, s: int, lo: int, hi: int, ckpt: bool) -> float:
        t = self.pref[ckpt][hi] - self.pref[ckpt][lo]
        if s == 0:
            t += self.ends[ckpt][0]
        if s == self.S - 1:
            t += self.ends[ckpt][1]
        return t

    def balanced(self, ckpt: tuple[bool, ...], caps: list[int] | None = None) -> tuple[int, ...] | None:
        """The split minimising the slowest stage's time (binary search over that time, greedy fill);
        ``caps[s]``: most layers stage s may hold (memory)."""
        S, L = self.S, self.L
        if S > L:
            return None

        def fill(limit: float) -> tuple[int, ...] | None:
            out, pos = [], 0
            for s in range(S):
                rest = S - s - 1
                most = L - rest - pos
                if caps is not None:
                    most = min(most, caps[s])
                if most < 1:
                    return None
                if s == S - 1:
                    if L - pos > most or self.stage_time(s, pos, L, ckpt[s]) > limit:
                        return None
                    out.append(L - pos)
                    return tuple(out)
                # Largest k with stage_time(s, pos, pos + k) <= limit (costs are non-negative: bisect the prefix).
                pref = self.pref[ckpt[s]]
                extra = self.ends[ckpt[s]][0] if s == 0 else 0.0
                k = bisect.bisect_right(pref, pref[pos] + limit - extra, pos + 1, pos + most + 1) - 1 - pos
                if k < 1:
                    return None
                out.append(k)
                pos += k
            return None

        hi = max(self.stage_time(s, 0, L, True) for s in (0, S - 1)) + self.pref[True][-1]
        if fill(hi) is None:
            return None
        lo = 0.0
        while hi - lo > 1e-4 * hi:  # 0.01 % of the slowest stage: finer changes no split
            mid = (lo + hi) / 2
            if fill(mid) is None:
                lo = mid
            else:
                hi = mid
        return fill(hi)


def optimise_skeleton(w: Workload, base: Candidate, opts: SearchOptions) -> tuple[Prediction | None, int]:
    """The best split and checkpointing of one skeleton (exhaustive where small); (prediction, evaluations)."""
    S, L = base.num_stages, len(w.block_kinds())
    ckpt_choices = [(False,) * S] + ([(True,) * S] if opts.allow_checkpointing else [])
    if opts.allow_checkpointing and opts.per_stage_checkpointing:
        ckpt_space = 2**S
    else:
        ckpt_space = len(ckpt_choices)
    if math.comb(L - 1, S - 1) * ckpt_space <= opts.exhaustive_limit:
        vectors = itertools.product((False, True), repeat=S) if ckpt_space == 2**S else ckpt_choices
        vectors = list(vectors)
        best, n = None, 0
        for cut in itertools.combinations(range(1, L), S - 1):
            split = tuple(b - a for a, b in zip((0, *cut), (*cut, L)))
            for ckpt in vectors:
                p = predict(replace(base, layer_split=split, stage_checkpointing=ckpt), w)
                n += 1
                if p.fits and (best is None or p.step_time < best.step_time):
                    best = p
        return best, n
    sk = _Skeleton(w, base)
    best, n = None, 0
    for ckpt in ckpt_choices:
        split = sk.balanced(ckpt) or even_split(L, S)
        cand = replace(base, layer_split=split, stage_checkpointing=ckpt)
        p = predict(cand, w)
        n += 1
        # Stages over memory: checkpoint them (per stage), rebalance; a few rounds settle it.
        for _ in range(3):
            if p.fits or not (opts.allow_checkpointing and opts.per_stage_checkpointing) or all(ckpt):
                break
            over = {r for r, mem in enumerate(p.stage_memory) if mem > p.memory_budget}
            ckpt = tuple(c or (s % base.pp in over) for s, c in enumerate(ckpt))
            split = sk.balanced(ckpt) or split
            p = predict(replace(cand, layer_split=split, stage_checkpointing=ckpt), w)
            n += 1
        if p.fits and (best is None or p.step_time < best.step_time):
            best = p
    return best, n


def relieve_bottleneck(w: Workload, p: Prediction, opts: SearchOptions, max_rounds: int = 200) -> tuple[Prediction, int]:
    """Aceso's bottleneck relief: move a layer off the slowest stage, or flip its checkpointing, while it helps."""
    n = 0
    for _ in range(max_rounds):
        c = p.candidate
        times = [f + b for f, b in zip(p.stage_forward, p.stage_backward)]
        # Few stages: every single-layer move and checkpointing flip (interleaved ranks balance their chunks' sum,
        # which the slowest stage alone does not show); many stages: Aceso's moves around the slowest stage only.
        sources = range(c.num_stages) if c.num_stages <= 16 else [int(np.argmax(times))]
        moves = []
        split = list(c.layer_split)
        for s in sources:
            # One layer from s to any stage t (the boundaries between them shift by one): reaches splits that single
            # moves to a neighbour only reach through a worse intermediate.
            for t in range(c.num_stages):
                if t != s and split[s] > 1:
                    new = split.copy()
                    new[s] -= 1
                    new[t] += 1
                    moves.append(replace(c, layer_split=tuple(new)))
            if opts.allow_checkpointing and opts.per_stage_checkpointing:
                flip = list(c.stage_checkpointing)
                flip[s] = not flip[s]
                moves.append(replace(c, stage_checkpointing=tuple(flip)))
                # A checkpointed neighbour that could stop checkpointing absorbs a layer better.
                for t in (s - 1, s + 1):
                    if 0 <= t < c.num_stages and c.stage_checkpointing[t]:
                        g = list(c.stage_checkpointing)
                        g[t] = False
                        moves.append(replace(c, stage_checkpointing=tuple(g)))
        preds = [predict(m, w) for m in moves]
        n += len(preds)
        better = [q for q in preds if q.fits and q.step_time < p.step_time * (1 - 1e-9)]
        if not better:
            break
        p = min(better, key=lambda q: q.step_time)
    return p, n


def search(w: Workload, num_gpus: int, opts: SearchOptions | None = None) -> SearchResult:
    """The top-k candidates for ``num_gpus`` GPUs (see the module docstring)."""
    opts = opts or SearchOptions()
    error = validated_error(num_gpus) if opts.model_error is None else check_model_error(opts.model_error)
    start = time.perf_counter()
    L = len(w.block_kinds())
    found: list[Prediction] = []
    count = evaluated = 0
    truncated = False
    plain: dict[tuple, float] = {}  # each skeleton's best step time without graphs, sp or sharding, for its variants
    plain_best: dict[tuple, Prediction] = {}
    for dp, pp, tp, mbs, m, schedule, v, comp, graphs, sp, zero, cp, attention in skeletons(w, num_gpus, opts):
        if time.perf_counter() - start > opts.time_budget_s:
            truncated = True
            break
        count += 1
        if lower_bound_memory(w, tp, pp, dp * cp if zero else 1) > w.memory_budget:
            continue
        S = pp * v
        base = Candidate(dp, pp, tp, mbs, m, schedule, v, even_split(L, S), (False,) * S, comp, graphs, sp, zero, cp,
                         attention)
        key = (dp, pp, tp, mbs, m, schedule, v, comp, cp, attention)
        variant = graphs or sp or zero
        done = plain_best.get(key)
        if variant and not graphs and done is not None and not any(done.candidate.stage_checkpointing):
            # Memory did not bind the plain skeleton (no stage checkpoints), so what sequence parallelism and the
            # sharded optimizer buy beyond it does not depend on the split: its best split, with the option.
            best, n = predict(replace(done.candidate, sequence_parallel=sp, shard_optimizer_state=zero), w), 1
            best = best if best.fits else None
        else:
            best, n = optimise_skeleton(w, base, opts)
        evaluated += n
        if best is not None and not variant:
            plain[key] = best.step_time
            plain_best[key] = best
        # A variant is kept only where it is predicted faster than the plain skeleton: graphs cost memory, and
        # sequence parallelism and the sharded optimizer only buy memory (and, sharded, an optimizer step on 1/dp of
        # the parameters for an all-gather): where the plain one fits as fast, they would tie or lose.
        if best is not None and (not variant or best.step_time < plain.get(key, math.inf)):
            found.append(best)
    found.sort(key=lambda p: p.step_time)
    relieved = []
    for p in found[: opts.relief_skeletons]:
        if time.perf_counter() - start > opts.time_budget_s:
            truncated = True
            relieved.append(p)
            continue
        q, n = relieve_bottleneck(w, p, opts)
        evaluated += n
        relieved.append(q)
    pool = sorted(relieved + found[opts.relief_skeletons:], key=lambda p: p.step_time)
    # The closed forms are exact for uniform stages; unequal ones are re-timed with the simulator before ranking.
    timed = []
    for p in pool[: 3 * opts.top_k]:
        c = p.candidate
        if c.pp > 1 and 2 * c.num_stages * c.num_microbatches <= opts.simulate_max_actions:
            p = simulate_candidate(c, w)
        if p.fits:
            timed.append(p)
    timed.sort(key=lambda p: p.step_time)
    top = timed[: opts.top_k] + [p for p in timed[opts.top_k:] if within_error(timed[0].step_time, p.step_time, error)]
    if top:
        shortfall = []
    elif truncated and not found:
        shortfall = [f"the search's time budget ({opts.time_budget_s} s) ran out after {count} layouts, before any"
                     f" configuration that fits was found; raise time_budget_s (--time-budget)."]
    else:
        shortfall = explain_shortfall(w, num_gpus, opts, count)
    return SearchResult(top, count, evaluated, time.perf_counter() - start, truncated, shortfall, error)


def explain_shortfall(w: Workload, num_gpus: int, opts: SearchOptions, skeleton_count: int) -> list[str]:
    """Why nothing fits: what is short (configurations, layers for the stages, memory per GPU)."""
    L = len(w.block_kinds())
    if skeleton_count == 0:
        return [f"no (dp, pp, tp) layout of {num_gpus} GPUs fits the model and batch: dp must divide the global batch"
                f" of {w.global_batch_size} sequences, pp x virtual stages at most the model's {L} layers, tp divide"
                f" the {w.shape.num_heads} heads and at most {w.cluster.gpus_per_node} GPUs per node."]
    budget = w.memory_budget
    best = None
    for tp in [t for t in _divisors(num_gpus) if t <= w.cluster.gpus_per_node and w.shape.num_heads % t == 0]:
        for cp, attention in context_parallel_choices(w, num_gpus, tp, opts):
            for pp in _divisors(num_gpus // (tp * cp)):
                if pp > L:
                    continue
                replica = w.global_batch_size // max(1, num_gpus // (tp * cp * pp))
                if replica < 1:
                    continue
                S = pp
                c = Candidate(num_gpus // (tp * cp * pp), pp, tp, 1, max(replica, pp), "1f1b", 1, even_split(L, S),
                              (opts.allow_checkpointing,) * S, False, cp=cp, cp_attention=attention)  # eager: graphs only add memory
                p = predict(c, w)
                if best is None or p.peak_memory < best.peak_memory:
                    best = p
    if best is None:
        return [f"the model's {L} layers cannot be split over any pipeline size of {num_gpus} GPUs."]
    c = best.candidate
    if not math.isfinite(best.peak_memory) or not math.isfinite(best.step_time):
        return [f"the cost model ({best.source}) has no finite cost for sequence length {w.seq_len}"
                + (f" / target length {w.target_len}" if w.target_len else "") + " at micro-batch size 1: a profile"
                " covers only the shapes it measured (profile the lengths and micro-batch sizes you train)."]
    cp = f", cp={c.cp} {c.cp_attention}" if c.cp > 1 else ""
    no_cp = (f" Context parallelism was not searched: {w.context_parallel_refusal}."
             if w.context_parallel_refusal and (opts.context_parallel_sizes or (2,)) != (1,) else "")
    return [f"memory per GPU is short: the leanest layout (dp={c.dp}, pp={c.pp}, tp={c.tp}{cp}, micro-batch 1, activation"
            f" checkpointing {'on' if c.stage_checkpointing[0] else 'off'}) needs {best.peak_memory / GIB:.2f} GiB per GPU"
            f" but {budget / GIB:.2f} GiB are usable ({w.cluster.memory_per_gpu / GIB:.2f} GiB minus"
            f" {w.memory_reserve / GIB:.2f} GiB reserved). Use more GPUs, GPUs with more memory, or a smaller model." + no_cp]
