"""What a LightningModule implements so that Compressed3DStrategy can split it across pipeline and tensor ranks.

A plain LightningModule needs none of this: with pp = tp = 1 it trains with (compressed) data parallelism
like DDP. For pp > 1 or tp > 1 the module says how to cut itself into stages and how to shard a stage.
The GPT recipe is the reference implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class StageLayout:
    """Stage ``index`` of ``num_stages`` holds the splittable layers ``layers`` (global indices).

    Per-stage settings (``None``: the model's own): ``activation_checkpointing``, whether the stage recomputes its
    layers' activations in the backward (the strategy's ``stage_activation_checkpointing``; a planner turns it on
    where a stage's memory is short). A model's ``build_pipeline_stages`` honours the settings it supports.
    """

    index: int
    num_stages: int
    layers: range
    activation_checkpointing: bool | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@runtime_checkable
class Parallel3DModule(Protocol):
    """The protocol. Methods are called once at setup (stages, tensor parallel, init) or per micro-batch (loss).

    - ``num_pipeline_layers()``: how many splittable layers (transformer blocks) the model has.
    - ``build_pipeline_stages(layouts)``: delete everything this rank's stages do not need, keeping the
      remaining parameter names unchanged, and return one ``nn.Module`` per layout (honouring the layout's
      per-stage settings, e.g. ``activation_checkpointing``, where not None). A stage is called as
      ``stage(*received, microbatch=mb)``: the first stage gets no received tensors and reads its inputs from
      the micro-batch; later stages get the previous stage's outputs. The last stage returns what
      ``pipeline_loss`` consumes. Boundary shapes must depend only on the micro-batch's tensor shapes.
    - ``parallelize_stage(stage, tp_mesh, sequence_parallel)``: apply a tensor-parallel plan to one stage
      (``torch.distributed.tensor.parallel.parallelize_module``). With tp > 1 the last stage's loss and its
      backward run inside torch's ``loss_parallel()`` context.
    - ``pipeline_loss(output, microbatch)``: the *sum* of the loss terms of one micro-batch.
    - ``pipeline_loss_terms(microbatch)``: how many terms that sum has (e.g. the target tokens that are not
      ignored), computed from the data alone so the normaliser is known before the backward starts. The step's
      loss is the sum over all micro-batches and data-parallel replicas divided by the terms of all of them (one
      all-reduce of the count), so replicas with different counts train like one process on the global batch.
    - ``pipeline_tied_parameters()``: ``{name on the first stage: name on the last stage}`` for weights that
      are tied (input and output embeddings); their gradients are summed across the two stages.
    - ``init_weights()``: materialise-time initialisation when the module was built on the meta device.
    - ``padded_parameters()`` (optional): names of parameters whose first dimension is padded to the tensor-
      parallel size (the vocabulary); a checkpoint loads into another layout even though their shapes differ.
    - ``log_pipeline_loss(loss, stage)`` (optional): log the step's mean loss (``stage`` is "train", "val" or
      "test"); without it the strategy logs ``f"{stage}_loss"``.
    - ``check_pipeline_batch(microbatch)`` (optional): raise a ValueError naming the bad value when a micro-batch
      does not fit the model (a token id outside the vocabulary, a sequence longer than the positions). Called on
      every rank before each training and evaluation step, before any collective: only one stage reads the ids
      or the labels, and without the check its error would reach the other ranks as a lost peer (every rank of a
      pipeline holds the same batch, so all of them raise). Keep it cheap (shapes, minimum and maximum), and read
      values through :func:`read_on_host`: the strategy checks all micro-batches of a step under one host
      synchronisation; the recipes use ``lightning_3d.recipes.training.check_token_batch``.
    - ``enable_context_parallel(stage, group, layout, attention)`` (optional, needed for context_parallel_size > 1):
      make the attention of ``stage`` span the sequence sliced over the cp ``group`` (``lightning_3d.context``); its
      micro-batches then hold this rank's slice of every ``context_parallel_keys`` entry (default ``input_ids`` and
      ``labels``) and the slice's global ``position_ids``. See docs/context_parallel.md.
    """

    def num_pipeline_layers(self) -> int: ...

    def build_pipeline_stages(self, layouts: Sequence[StageLayout]) -> list[nn.Module]: ...

    def parallelize_stage(self, stage: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None: ...

    def pipeline_loss(self, output: Any, microbatch: Any) -> Tensor: ...

    def pipeline_loss_terms(self, microbatch: Any) -> Tensor | int: ...

    def pipeline_tied_parameters(self) -> dict[str, str]: ...

    def init_weights(self) -> None: ...


def missing_protocol_methods(module: object) -> list[str]:
    """Names of protocol methods the module lacks (for an error message that says what to implement)."""
    required = [
        "num_pipeline_layers",
        "build_pipeline_stages",
        "parallelize_stage",
        "pipeline_loss",
        "pipeline_loss_terms",
        "pipeline_tied_parameters",
        "init_weights",
    ]
    return [name for name in required if not callable(getattr(module, name, None))]


def split_layers(num_layers: int, num_stages: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer ranges per stage: as even as possible, earlier stages taking the remainder.

    ``layers_per_stage`` overrides the split (the planner uses it to balance embedding/head stages).
    """
    if layers_per_stage is not None:
        if len(layers_per_stage) != num_stages or any(n < 1 for n in layers_per_stage):
            raise ValueError(
                f"`pipeline_layer_split={list(layers_per_stage)}` must list {num_stages} positive layer counts,"
                f" one per pipeline stage."
            )
        if sum(layers_per_stage) != num_layers:
            raise ValueError(
                f"`pipeline_layer_split={list(layers_per_stage)}` sums to {sum(layers_per_stage)} but the model has"
                f" {num_layers} layers."
            )
        counts = list(layers_per_stage)
    else:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


# The checks that ``read_on_host`` deferred in the innermost ``one_host_read`` block (a stack: blocks may nest).
_DEFERRED: list[list[tuple[Tensor, Callable[[Any], None]]]] = []


def read_on_host(values: Tensor, verdict: Callable[[Any], None]) -> None:
    """Call ``verdict(values.tolist())``, where ``values`` is an integer tensor computed from a batch on the device
    (e.g. the minimum and maximum token id), and ``verdict`` raises when they are bad.

    Reading a value of a CUDA tensor waits for the device: the GPU drains its queue and then idles while the host
    catches up. Outside :func:`one_host_read` the read happens now; inside, it is deferred to the block's end, where
    the values of every deferred check travel to the host in one copy (the strategy runs a step's
    ``check_pipeline_batch`` calls in one block: one synchronisation per step instead of one per micro-batch;
    docs/speed.md)."""
    if not _DEFERRED:
        verdict(values.tolist())
        return
    _DEFERRED[-1].append((values, verdict))


@contextmanager
def one_host_read() -> Iterator[None]:
    """Defer the :func:`read_on_host` checks made in this block, then read all their values in one device-to-host
    copy and run their verdicts in the order they were made (the first bad value raises, as it would have at once).
    Nothing is read when the block raises."""
    pending: list[tuple[Tensor, Callable[[Any], None]]] = []
    _DEFERRED.append(pending)
    try:
        yield
    finally:
        _DEFERRED.pop()
    if not pending:
        return
    device = pending[0][0].device
    on_host = _to_host(torch.cat([values.reshape(-1).to(device=device, dtype=torch.int64) for values, _ in pending]))
    for (values, verdict), piece in zip(pending, on_host.split([v.numel() for v, _ in pending]), strict=True):
        verdict(piece.reshape(values.shape).tolist())


def _to_host(values: Tensor) -> Tensor:
    """The one synchronising copy of :func:`one_host_read` (a function of its own, so that tests count its calls)."""
    return values.cpu()
