"""Memory per GPU of a training layout: weights, gradients, optimizer state, stored activations × the micro-batches a
schedule keeps in flight, and the largest transient (docs/planner.md, "Memory per rank").

One model, two users: the planner (``planner/model.py`` sums its stages with cached prefix sums and adds the rank
terms with ``rank_memory`` and ``in_flight`` from here) and the strategy's fit check (``strategies/fit_check.py``,
which asks ``layout_memory`` for a whole layout before any collective). It lives in ``costs`` because the strategies
may not import the planner (tests/test_layering.py); the per-layer activations are the cost model's
``layer_memory``, the parameters ``layer_parameters``.

On top of what the planner searches, a layout here may have context parallelism (each rank runs ``seq_len / cp``
tokens through every layer; the ring's key/value buffers are not counted), sequence parallelism (every stored tensor
of a block is split over tp: a block on ``seq_len / tp`` tokens at tp = 1), a sharded optimizer (the optimizer state,
and the fp32 master weights under bf16-true, divided over the dp x cp replicas) and a chunked loss (the head's logits exist for one
chunk of tokens at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_3d.costs.analytic import layer_parameters
from lightning_3d.costs.model import CostModel, ModelShape

GIB = 2**30
#: Elements of one chunk's logits in the chunked (fused) loss; equal to ``recipes.kernels.CHUNK_ELEMENTS`` (tested:
#: this layer may not import the recipes).
LOSS_CHUNK_ELEMENTS = 2**28


def in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> int:
    """Micro-batch chunks a rank holds at most (Megatron's warm-up count + 1 for interleaving)."""
    if schedule == "gpipe":
        return m * v
    if schedule == "zb_h1":  # rank r: pp - r forwards plus r split backwards awaiting their W (pipeline/zero_bubble.py)
        return min(pp, m)
    if v == 1:
        return min(pp - rank, m)
    # interleaved 1F1B's warm-up + 1; zb_interleaved adds rank r's r split backwards awaiting their W
    extra = rank if schedule == "zb_interleaved" else 0
    return min(m * v, (pp - rank - 1) * 2 + (v - 1) * pp + 1 + extra)


def graph_gradient_bytes(params: float, grad_bytes_per_param: float, stored: float = 0.0) -> float:
    """The extra bytes of a stage trained with ``cuda_graphs=True`` (pipeline/graphs.py): its backward graph writes
    every trainable parameter's gradient into a fixed output buffer of the parameters' dtype, held for the whole run
    on top of ``.grad``. The buffers live in the graphs' shared memory pool, where the backward's capture frees the
    micro-batch's ``stored`` activations as it writes them, so the allocator hands the buffers those blocks first
    (the forward replay of the next micro-batch overwrites them after autograd has taken the gradients): the rank
    holds only what the gradients exceed one micro-batch's stored activations by. The pool otherwise holds the
    micro-batch's activations and working memory, what an eager stage holds at its peak too. Not counted: the
    graph's input buffers (one micro-batch's token ids: KiB). docs/planner.md, "CUDA graphs"."""
    return max(0.0, params * grad_bytes_per_param - stored)


def rank_memory(state: float, held_chunks: int, stored: float, transient: float) -> float:
    """One rank's memory: training state + ``held_chunks`` micro-batches' stored activations (the rank's largest
    stage's) + the largest transient."""
    return state + held_chunks * stored + transient


@dataclass(frozen=True)
class TrainingState:
    """Bytes per parameter of the weights, their gradients and the optimizer's state (AdamW: two moments)."""

    weights: float
    grads: float
    optimizer: float

    @classmethod
    def of(cls, precision: str, *, dp: int = 1, shard_optimizer_state: bool = False) -> TrainingState:
        """fp32 weights and gradients with fp32 moments (32-true, bf16-mixed: 16 bytes, the planner's default); bf16
        weights, gradients and moments under bf16-true (8); the sharded optimizer keeps fp32 moments, and fp32 master
        weights under bf16-true, for 1/dp of the parameters (docs/sharded_optimizer.md)."""
        low = precision == "bf16-true"
        weights = grads = 2.0 if low else 4.0
        if shard_optimizer_state and dp > 1:
            return cls(weights, grads, (12.0 if low else 8.0) / dp)
        return cls(weights, grads, 4.0 if low else 8.0)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


@dataclass(frozen=True)
class MemoryLayout:
    """What decides a layout's memory. ``layer_split``: blocks per stage (pp × v entries, stage order);
    ``stage_checkpointing``: per stage, whether it recomputes its blocks; ``position_parameters``: a learned position
    table on the first stage (GPT's: seq_length × hidden); ``tied_head``: the output projection shares the embedding's
    weight, so a rank holding both holds it once."""

    layer_split: tuple[int, ...]
    stage_checkpointing: tuple[bool, ...]
    microbatch_size: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    precision: str = "32-true"
    shard_optimizer_state: bool = False
    chunked_loss: bool = False
    position_parameters: int = 0
    tied_head: bool = False
    cuda_graphs: bool = False


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's estimate (bytes): the components and their sum."""

    weights: float
    grads: float
    optimizer: float
    activations: float  # stored activations × micro-batches in flight
    transient: float  # the largest working set above them (a recomputed block, the logits and loss)
    in_flight: int
    graph_buffers: float = 0.0  # cuda_graphs: the backward graph's gradient buffers (``graph_gradient_bytes``)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient + self.graph_buffers

    def components(self) -> dict[str, float]:
        out = {"weights": self.weights, "gradients": self.grads, "optimizer state": self.optimizer,
               "activations": self.activations, "transient (recompute, logits, loss)": self.transient}
        if self.graph_buffers:
            out["CUDA graphs' gradient buffers"] = self.graph_buffers
        return out


def stage_activations(cost_model: CostModel, shape: ModelShape, kinds: Sequence[str], layout: MemoryLayout,
                      seq_len: int, target_len: int | None, checkpointing: bool, first: bool, last: bool) -> tuple[float, float]:
    """(stored bytes per micro-batch, largest transient) of one stage holding blocks ``kinds``."""
    b, tp = layout.microbatch_size, layout.tp
    s = seq_len / layout.cp
    t = target_len / layout.cp if target_len is not None else None
    stored = transient = 0.0
    for kind in kinds:
        if layout.sequence_parallel and tp > 1:
            # Every tensor a block stores is split over tp, its replicated norms and residuals included: the memory
            # of a tp = 1 block on seq_len / tp tokens.
            st, pk = cost_model.layer_memory(kind, b, s / tp, target_len=None if t is None else t / tp,
                                             recompute=checkpointing, tp=1)
        else:
            st, pk = cost_model.layer_memory(kind, b, s, target_len=t, recompute=checkpointing, tp=tp)
        stored += float(st)
        transient = max(transient, float(pk))
    if first:
        st, pk = cost_model.layer_memory("embedding", b, s, target_len=t, tp=tp)
        stored, transient = stored + float(st), max(transient, float(pk))
    if last:
        if layout.chunked_loss:
            # The chunked loss keeps the hidden states' gradient (the size of the final norm's output, which the norm
            # keeps too) and the fp32 weight gradient; one chunk's logits, their fp32 loss and gradient are the
            # transient: the head's own memory at the chunk's tokens.
            tokens = b * (t if t is not None else s)
            vocab = shape.vocab_size / tp
            chunk = max(1.0, min(tokens, LOSS_CHUNK_ELEMENTS // max(1, int(vocab))))
            st, pk = cost_model.layer_memory("head", 1, chunk, target_len=chunk if t is not None else None, tp=tp)
            stored += 2 * shape.bytes_per_element * tokens * shape.hidden_size + 4 * vocab * shape.hidden_size
            transient = max(transient, float(st) + float(pk))
        else:
            st, pk = cost_model.layer_memory("head", b, s, target_len=t, tp=tp)
            stored, transient = stored + float(st), max(transient, float(pk))
    return stored, transient


def layout_memory(cost_model: CostModel, shape: ModelShape, seq_len: int, layout: MemoryLayout,
                  target_len: int | None = None) -> list[RankMemory]:
    """Per pipeline rank, the estimate of ``layout`` training ``shape`` on micro-batches of ``microbatch_size`` ×
    ``seq_len`` tokens (× ``target_len`` for T5's decoder)."""
    blocks = [k for k in shape.layer_kinds() if k not in ("embedding", "head")]
    stages = len(layout.layer_split)
    if stages != layout.pp * layout.virtual_stages or sum(layout.layer_split) != len(blocks):
        raise ValueError(f"layer_split={list(layout.layer_split)} must give {layout.pp * layout.virtual_stages} stages"
                         f" the model's {len(blocks)} blocks.")
    # The optimizer is sharded over the replicas of every parameter: dp x cp (cp ranks hold the same parameters).
    state = TrainingState.of(layout.precision, dp=layout.dp * layout.cp, shard_optimizer_state=layout.shard_optimizer_state)
    start, per_stage = 0, []
    for i, (n, ckpt) in enumerate(zip(layout.layer_split, layout.stage_checkpointing)):
        kinds = blocks[start:start + n]
        start += n
        first, last = i == 0, i == stages - 1
        params = sum(layer_parameters(shape, k, layout.tp) for k in kinds)
        params += (layer_parameters(shape, "embedding", layout.tp) + layout.position_parameters) if first else 0.0
        params += layer_parameters(shape, "head", layout.tp) if last else 0.0
        if first and last and layout.tied_head:
            params -= layer_parameters(shape, "embedding", layout.tp)
        stored, transient = stage_activations(cost_model, shape, kinds, layout, seq_len, target_len, ckpt, first, last)
        per_stage.append((params, stored, transient))
    out = []
    for r in range(layout.pp):
        mine = per_stage[r::layout.pp]
        params = sum(p for p, _, _ in mine)
        held = in_flight(layout.schedule, layout.pp, layout.virtual_stages, layout.num_microbatches, r)
        stored, transient = max(s for _, s, _ in mine), max(t for _, _, t in mine)
        graphs = graph_gradient_bytes(params, state.grads, stored) if layout.cuda_graphs else 0.0
        out.append(RankMemory(params * state.weights, params * state.grads, params * state.optimizer,
                              rank_memory(0.0, held, stored, 0.0), transient, held, graphs))
    return out
