"""What the planner prices: a ``Candidate`` configuration (what the emitted YAML sets) and the ``Workload`` it runs
(model, lengths, batch, cost model, cluster), with the per-layer costs the performance model (``model.py``) sums:
each layer's forward and backward seconds (device and host apart), stored and transient bytes and parameters at a
micro-batch size, tensor-parallel degree, checkpointing, sequence- and context-parallel setting. docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lightning_3d.costs import ClusterSpec, CostModel, ModelShape, layer_parameters
from lightning_3d.costs.host import layer_host_time
from lightning_3d.planner import context

GIB = 2**30


@dataclass(frozen=True)
class Candidate:
    """One configuration: what the emitted YAML sets. ``layer_split``/``stage_checkpointing`` have pp × v entries.
    ``cuda_graphs``: the strategy's ``cuda_graphs=True`` (pp = tp = cp = 1 only; docs/planner.md, "CUDA graphs");
    ``sequence_parallel`` and ``shard_optimizer_state`` are the strategy's options of those names; ``cp`` and
    ``cp_attention`` its ``context_parallel_size`` and ``context_parallel_attention`` (the layout is always zigzag:
    ``planner/context.py``); ``compile`` the model's ``compile``. The world is dp × pp × cp × tp."""

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
    sequence_parallel: bool = False  # tp > 1 only: the residual stream sharded over the sequence between tp regions
    shard_optimizer_state: bool = False  # dp x cp > 1 only: ZeRO-1 (docs/sharded_optimizer.md)
    cp: int = 1
    cp_attention: str = "ring"
    # The recipe's ``compile`` (blocks compiled with torch.compile): priced by the profile's compiled grids. The search
    # offers it where the profile has them (api.plan); a workload's cost model is either eager or compiled.
    compile: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which gradients are reduced (and ZeRO-1 shards): the strategy's
        data-parallel group is dp x cp (docs/context_parallel.md)."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp


@dataclass
class Workload:
    """What is trained and where: the model shape and lengths, the global batch (sequences per optimizer step),
    the cost model, the cluster, and the training state's bytes per parameter (fp32 weights, gradients and Adam's
    two moments: 16). ``host_runahead``: ``simulate_candidate`` times each pipeline rank's device and host apart, the
    host issuing one action ahead of the device (pipeline/timing.py; docs/planner.md says why it is off by default).
    ``context_parallel_refusal``: why the model or its data cannot run context parallelism (the recipe's rule, read
    from the config by ``api.workload_from_config``), None where they can."""

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
    cb_max_link_gbps: float = 100.0  # the strategy's default (CompressionConfig): CB runs only on slower pipeline links
    host_runahead: bool = False
    context_parallel_refusal: str | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def memory_budget(self) -> float:
        return self.cluster.memory_per_gpu - self.memory_reserve

    def block_kinds(self) -> list[str]:
        return [k for k in self.shape.layer_kinds() if k not in ("embedding", "head")]

    def layer_costs(self, mbs: int, tp: int, recompute: bool, sp: bool = False, cp: int = 1,
                    attention: str = "ring") -> tuple[np.ndarray, ...]:
        """Per block (pipeline order) and for embedding/head: fwd, bwd, stored, peak seconds/bytes, parameters, and
        the device's fwd, bwd and the host's fwd, bwd seconds apart (fwd = max(device, host) per layer); cached.
        ``sp``: sequence parallelism at tp > 1, which changes a block's memory only (below). ``cp``: every layer on
        ``seq_len / cp`` tokens, each block with its context-parallel attention's terms (``planner/context.py``)."""
        key = (mbs, tp, recompute, sp, cp, attention)
        if key not in self._cache:
            out = {}
            seq = self.seq_len // cp
            ring = context.block_terms(self, mbs, tp, cp, attention)
            for kind in {*self.block_kinds(), "embedding", "head"}:
                kw = dict(target_len=self.target_len, recompute=recompute and kind not in ("embedding", "head"), tp=tp)
                f, b = self.cost_model.layer_time(kind, mbs, seq, **kw)
                # A layer takes at least the host's time to issue its kernels (eager PyTorch launches each from
                # Python): the floor that holds where the measured span does not already show it (a tp shard the
                # profile lacks, whose compute is scaled down but whose launches are not; the host's time inside
                # the training loop, which the isolated span does not hold). Zeros for models without host times.
                hf, hb = layer_host_time(self.cost_model, kind, mbs, seq, **kw)
                st, pk = self.cost_model.layer_memory(kind, mbs, seq, **kw)
                if sp and tp > 1 and kind not in ("embedding", "head"):
                    # Every tensor a block stores is split over tp, its norms and residuals included: a tp = 1 block's
                    # memory on seq / tp tokens (the strategy's fit check counts it alike, costs/memory.py). Its
                    # time is the tp block's: the reduce-scatter and all-gather that replace each all-reduce carry
                    # the same bytes in a ring, and the norms' share of the work on 1/tp of the tokens is not modelled.
                    t = None if self.target_len is None else self.target_len / tp
                    st, pk = self.cost_model.layer_memory(kind, mbs, seq / tp, target_len=t,
                                                          recompute=kw["recompute"], tp=1)
                measured = getattr(self.cost_model, "includes_tp_collectives", None)
                kind_rc = recompute and kind not in ("embedding", "head")
                # A grid measured across tp GPUs holds its collectives in its span (and their launches in its host
                # time): only a derived grid gets the modelled all-reduces.
                comm = 0.0 if measured is not None and measured(kind, kind_rc, tp) else self.tp_comm(kind, mbs, tp, cp)
                extra_bwd = comm if kind_rc else 0.0
                df, db = float(f) + comm, float(b) + comm + extra_bwd
                if kind == "block" and cp > 1:
                    # The attention's work on the other ranks' keys and its exchange; a checkpointed block runs its
                    # forward (the ring or the all-to-alls included) again in the backward.
                    df += ring.forward
                    db += ring.backward + (ring.forward if kind_rc else 0.0)
                    pk = float(pk) + ring.transient
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

    def prefix_sums(self, mbs: int, tp: int, recompute: bool, sp: bool = False, cp: int = 1,
                    attention: str = "ring") -> tuple[list[float], ...]:
        self.layer_costs(mbs, tp, recompute, sp, cp, attention)
        return self._cache[("prefix", mbs, tp, recompute, sp, cp, attention)]

    def tokens(self, mbs: int, kind: str = "block", cp: int = 1) -> float:
        """Tokens one rank's layer of ``kind`` processes per micro-batch (its ``seq_len / cp`` slice)."""
        t = self.target_len if self.target_len is not None else self.seq_len
        return mbs * (t if kind in ("decoder_block", "head") else self.seq_len) / cp

    def tp_comm(self, kind: str, mbs: int, tp: int, cp: int = 1) -> float:
        """Tensor-parallel all-reduces of one layer's forward (the backward has as many), ring cost."""
        if tp == 1:
            return 0.0
        count = {"embedding": 1, "head": 1, "decoder_block": 3}.get(kind, 2)
        size = self.tokens(mbs, kind, cp) * self.shape.hidden_size * self.shape.bytes_per_element
        bw = self.cluster.bandwidth(tp)
        return count * (2 * (tp - 1) / tp * size / bw + self.cluster.latency)

    def boundary_bytes(self, mbs: int, cp: int = 1) -> float:
        """Bytes one pipeline boundary carries per micro-batch (T5 carries the encoder output and the decoder state);
        under cp each rank sends its slice."""
        e, h = self.shape.bytes_per_element, self.shape.hidden_size
        if self.shape.family == "t5":
            return mbs * (self.seq_len + (self.target_len or self.seq_len)) * h * e / cp
        return mbs * self.seq_len * h * e / cp
