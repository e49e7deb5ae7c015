"""Tensor-parallel layers that compute on local tensors, with DTensor parameters.

The layers are the model's own ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm`` modules, turned in place into the
subclasses below (names, state dicts and checkpoints unchanged). Their parameters become DTensors sharded as Megatron
shards them (column: ``Shard(0)``, row: ``Shard(1)``, vocabulary: ``Shard(0)``, the rest ``Replicate``), so
checkpoints, resharding, clipping and export keep reading DTensors; the forward computes on ``param.to_local()``
views and crosses ranks only through the explicit collectives of :mod:`lightning_3d.tensor_parallel.mappings`. The
gradient of a ``to_local`` view lands in the DTensor parameter's ``.grad`` with the parameter's placements; that of
a replicated parameter whose input is sharded over the sequence (norms and row biases under sequence parallelism)
lands as ``Partial``, which the gradient synchronizer reduces once after the last micro-batch. Why not DTensor
modules: docs/tensor_parallel.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor

from lightning_3d.tensor_parallel.mappings import TensorParallel, column_parallel_linear, reduce_from_region
from lightning_3d.utils.compat import (
    dtensor_local_tensor,
    dtensor_spec,
    dtensor_with_spec,
    run_post_accumulate_grad_hooks,
    set_compiled_call,
)

_PARTIAL = (Partial(),)


def local_view(param: Tensor, partial_grad: bool = False) -> Tensor:
    """This rank's part of ``param`` as a plain tensor whose gradient flows into the DTensor's ``.grad``.
    ``partial_grad``: each rank's gradient is a partial sum (the parameter saw only this rank's tokens).

    Eagerly, the plain tensor is a leaf sharing the parameter's local storage (``_LocalLeaf``): autograd accumulates
    into it as into any plain tensor, and the DTensor's ``.grad`` is only wrapped around the first micro-batch's
    gradient and added to in place after. Through ``to_local`` every parameter would cost a DTensor construction and
    a DTensor ``add`` per micro-batch on the host, and the GPU of a tensor-parallel step waits for the host
    (benchmarks/RESULTS.md#2026-11-27). Inside compiled code this is ``to_local``, because a graph cannot run the
    leaf cache; blocks compiled by :func:`compile_on_local_tensors` read the same leaves another way (see there)."""
    if not isinstance(param, DTensor):
        return param
    if torch.compiler.is_compiling():
        return param.to_local(grad_placements=_PARTIAL if partial_grad else None)
    return _eager_view(param, partial_grad, torch.is_grad_enabled())


def _eager_view(param: DTensor, partial_grad: bool, grad_enabled: bool) -> Tensor:
    """:func:`local_view` outside compiled code, with grad mode given (the staging of a block reads it once)."""
    if not grad_enabled or not param.requires_grad:
        return param.to_local(grad_placements=_PARTIAL if partial_grad else None)
    return _LocalLeaf.of(param, _PARTIAL if partial_grad else param.placements).tensor


class _LocalLeaf:
    """A plain leaf tensor viewing a DTensor parameter's local storage, whose accumulated gradient is handed to the
    parameter as its own: wrapped as a DTensor ``.grad`` with the gradient's placements, or added in place to the
    local part of the one already there; then the parameter's post-accumulate-grad hooks run, as autograd would run
    them (the data-parallel synchronizer listens there). The leaf's own ``.grad`` is emptied every time, so no
    gradient stays behind it when the parameter's is cleared (``zero_grad``) between a forward and its backward."""

    __slots__ = ("tensor", "placements", "param", "handle", "spec", "grad_dtype", "__weakref__")

    def __init__(self, param: DTensor, placements: tuple[Placement, ...]) -> None:
        with torch.no_grad():
            base = param.to_local()
        self.tensor = base.detach().requires_grad_(True)
        self.placements = tuple(placements)
        self.param = weakref.ref(param)
        # The gradient's DTensor metadata, the same every step (the leaf is made again when the parameter changes).
        self.grad_dtype = base.dtype
        self.spec = dtensor_spec(param.device_mesh, self.placements, param.shape, param.stride(), base.dtype)
        self.handle = self.tensor.register_post_accumulate_grad_hook(self._hand_over)

    @staticmethod
    def of(param: DTensor, placements: tuple[Placement, ...]) -> _LocalLeaf:
        """The parameter's leaf, made again when its storage moved (loading, ``to_empty``) or its placements of
        the gradient differ from the cached leaf's."""
        leaf = param.__dict__.get("_l3d_local_leaf")
        # Checked on every layer call of every micro-batch, so read without to_local's no_grad context, which costs
        # several times the comparisons (the local tensor is the object to_local returns with grad mode off).
        base = dtensor_local_tensor(param)
        placements = placements if type(placements) is tuple else tuple(placements)
        if (leaf is None or leaf.placements != placements or leaf.tensor.data_ptr() != base.data_ptr()
                or leaf.tensor.shape != base.shape or leaf.tensor.dtype != base.dtype):
            if leaf is not None:
                leaf.handle.remove()
            leaf = _LocalLeaf(param, placements)
            param.__dict__["_l3d_local_leaf"] = leaf
        return leaf

    def _hand_over(self, tensor: Tensor) -> None:
        param = self.param()
        grad, tensor.grad = tensor.grad, None
        if param is None or grad is None:
            return
        # Autograd runs the hook with grad mode off unless the backward builds a graph (create_graph=True); a no_grad
        # context per parameter and micro-batch costs more host time than the rest of an accumulation.
        if torch.is_grad_enabled():
            with torch.no_grad():
                self._accumulate(param, grad)
        else:
            self._accumulate(param, grad)
        run_post_accumulate_grad_hooks(param)

    def _accumulate(self, param: DTensor, grad: Tensor) -> None:
        if param.grad is None:
            # What DTensor.from_local(grad, mesh, placements, shape=, stride=) makes, without its host time.
            if grad.dtype == self.grad_dtype and not grad.requires_grad:
                param.grad = dtensor_with_spec(grad, self.spec)
            else:
                param.grad = DTensor.from_local(grad, param.device_mesh, self.placements, run_check=False,
                                                shape=param.shape, stride=param.stride())
        elif param.grad.placements == self.placements:
            dtensor_local_tensor(param.grad).add_(grad)
        else:  # e.g. a partial gradient onto one already reduced (accumulation over several batches)
            param.grad = param.grad + DTensor.from_local(grad, param.device_mesh, self.placements,
                                                         run_check=False, shape=param.shape, stride=param.stride())


class _LocalTensorLayer:
    """What the layers below share: each reads its parameters through :meth:`_local`, which is :func:`local_view`
    eagerly and, inside a block compiled by :func:`compile_on_local_tensors`, the plain tensors that the block's
    wrapper put on the layer just before the call (:meth:`_stage_locals`)."""

    tensor_parallel: TensorParallel

    def _local_params(self) -> tuple[tuple[str, bool], ...]:
        """(parameter name, whether its gradient is a partial sum) for each parameter the forward reads."""
        return (("weight", False), ("bias", False))

    def _local(self, name: str, partial_grad: bool = False) -> Tensor | None:
        if torch.compiler.is_compiling():
            staged = self.__dict__.get(_STAGED_PREFIX + name)
            if staged is not None:
                return staged
        param = getattr(self, name)
        return None if param is None else local_view(param, partial_grad)

    def _stage_locals(self, grad_enabled: bool, compiling: bool = False) -> None:
        """Put this layer's local tensors where the compiled graph reads them; ``grad_enabled``: torch's grad mode,
        read once per block call by its wrapper; ``compiling``: the wrapper is traced by an outer compile, whose
        graph takes ``local_view``'s ``to_local`` views (it cannot run the leaf cache)."""
        d = self.__dict__
        plan = d.get(_PLAN_ATTR)
        if plan is None or plan[0] is not self.tensor_parallel:
            # (attribute of the staged tensor, parameter name, partial): what _local_params says, kept because the
            # layer's parameters and sequence parallelism are fixed once it is tensor-parallel, and the tuple is
            # rebuilt (a named_parameters walk for ReplicatedNorm) on every call otherwise.
            plan = (self.tensor_parallel, tuple((_STAGED_PREFIX + name, name, partial)
                                                for name, partial in self._local_params()))
            d[_PLAN_ATTR] = plan
        for key, name, partial in plan[1]:
            param = getattr(self, name)
            # A plain attribute, not a buffer: module traversals (``.to()``, state dicts, the strategy's buffer
            # handling) must not see it. Dynamo lifts it into the graph as an input, like a parameter.
            d[key] = (None if param is None else param if not isinstance(param, DTensor)
                      else local_view(param, partial) if compiling else _eager_view(param, partial, grad_enabled))


# The attribute under which a compiled block finds a layer's local tensor of parameter ``name``.
_STAGED_PREFIX = "_l3d_local_"
# The layer's staging plan (_LocalTensorLayer._stage_locals).
_PLAN_ATTR = "_l3d_stage_plan"


def compile_on_local_tensors(module: nn.Module, **compile_kwargs) -> None:
    """``module.compile(**compile_kwargs)`` for a block holding tensor-parallel layers, with the graph computing on
    plain local tensors instead of the DTensor parameters.

    Compiled as is, a block's graph takes its DTensor parameters as inputs: every call then unwraps each parameter
    and wraps each of its gradients as a DTensor on the host, and autograd adds the DTensor gradients of successive
    micro-batches, the per-parameter host time that :func:`local_view` keeps out of the eager step
    (docs/tensor_parallel.md). Here an eager wrapper runs before each compiled call: it puts each layer's local
    leaves (the eager path's, so gradients reach ``param.grad`` the same way) on the layer as plain tensors, which
    the graph reads as inputs. The wrapper is plain Python: one dictionary update per parameter, no DTensor
    operation once the leaves exist. A module without tensor-parallel layers is compiled as ``Module.compile`` would
    (the wrapper then stages nothing); the layers are looked up at the first call, so the block may be compiled
    before the plan swaps them in."""
    compiled = torch.compile(module._call_impl, **compile_kwargs)
    # Found at the first call, not here: the recipes compile their blocks before the strategy applies the
    # tensor-parallel plan (build_pipeline_stages, then parallelize_stage), so no layer is tensor-parallel yet.
    layers: list[_LocalTensorLayer] | None = None

    def call(*args, **kwargs):
        nonlocal layers
        if layers is None:
            layers = [m for m in module.modules() if isinstance(m, _LocalTensorLayer)]
        grad_enabled, compiling = torch.is_grad_enabled(), torch.compiler.is_compiling()
        for layer in layers:
            layer._stage_locals(grad_enabled, compiling)
        return compiled(*args, **kwargs)

    set_compiled_call(module, call)


def distribute_parameters(module: nn.Module, placements: dict[str, Placement], tp: TensorParallel,
                          memo: dict[int, nn.Parameter]) -> None:
    """Make ``module``'s own parameters DTensors with the given placement. ``memo`` (old id -> new parameter) keeps a
    parameter shared by two modules (a tied embedding and head) one parameter."""
    for name, placement in placements.items():
        param = getattr(module, name)
        if param is None or isinstance(param, DTensor):
            continue
        new = memo.get(id(param))
        if new is None:
            new = nn.Parameter(distribute_tensor(param.data, tp.mesh, [placement]), requires_grad=param.requires_grad)
            memo[id(param)] = new
        setattr(module, name, new)


def _swap(module: nn.Module, base: type, cls: type, tp: TensorParallel) -> None:
    if type(module) is not base:
        raise TypeError(f"{type(module).__name__} cannot become a {cls.__name__}: only a plain {base.__name__} can"
                        " (a subclass's own forward would be lost).")
    module.__class__ = cls
    module.tensor_parallel = tp


class ColumnParallelLinear(_LocalTensorLayer, nn.Linear):
    """Output features sharded: the full input (f, or the sequence all-gather) times this rank's rows."""

    def forward(self, x: Tensor) -> Tensor:
        return column_parallel_linear(x, self._local("weight"), self._local("bias"), self.tensor_parallel)


class RowParallelLinear(_LocalTensorLayer, nn.Linear):
    """Input features sharded: this rank's partial product, reduced (g, or the sequence reduce-scatter), plus the bias
    once."""

    def _local_params(self) -> tuple[tuple[str, bool], ...]:
        return (("weight", False), ("bias", self.tensor_parallel.sequence_parallel))

    def forward(self, x: Tensor) -> Tensor:
        tp = self.tensor_parallel
        # The bias through _local only, also to test for None: reading ``self.bias`` in a compiled block would make
        # the DTensor parameter a graph input, guarded and unwrapped on every call for nothing.
        bias = self._local("bias", partial_grad=tp.sequence_parallel)
        y = tp.exit(F.linear(x, self._local("weight")))
        return y if bias is None else y + bias


class VocabParallelEmbedding(_LocalTensorLayer, nn.Embedding):
    """Vocabulary rows sharded: each rank looks up the ids in its range (zeros elsewhere), then the sum (g)."""

    def _local_params(self) -> tuple[tuple[str, bool], ...]:
        return (("weight", False),)

    def forward(self, ids: Tensor) -> Tensor:
        weight = self._local("weight")
        start = self.tensor_parallel.rank * weight.shape[0]
        shifted = ids - start
        outside = (shifted < 0) | (shifted >= weight.shape[0])
        out = F.embedding(torch.where(outside, 0, shifted), weight)
        return reduce_from_region(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tensor_parallel.group)


class ReplicatedLayerNorm(_LocalTensorLayer, nn.LayerNorm):
    """A norm with replicated parameters on local activations (this rank's tokens under sequence parallelism)."""

    def _local_params(self) -> tuple[tuple[str, bool], ...]:
        partial = self.tensor_parallel.sequence_parallel
        return (("weight", partial), ("bias", partial))

    def forward(self, x: Tensor) -> Tensor:
        partial = self.tensor_parallel.sequence_parallel
        return F.layer_norm(x, self.normalized_shape, self._local("weight", partial), self._local("bias", partial),
                            self.eps)


class ReplicatedNorm(_LocalTensorLayer):
    """A recipe's own norm class (one that is not ``nn.LayerNorm``, as T5's RMS norm) as a replicated layer on local
    activations: the recipe subclasses this and its norm class, and its ``forward`` reads the parameters through
    :meth:`local_parameter`, which a compiled block serves like any layer's. Under sequence parallelism each rank's
    gradient is a partial sum (the norm saw this rank's tokens only), as :class:`ReplicatedLayerNorm`'s."""

    def _local_params(self) -> tuple[tuple[str, bool], ...]:
        partial = self.tensor_parallel.sequence_parallel
        return tuple((name, partial) for name, _ in self.named_parameters(recurse=False))

    def local_parameter(self, name: str) -> Tensor | None:
        return self._local(name, self.tensor_parallel.sequence_parallel)


class ReplicatedEmbedding(_LocalTensorLayer, nn.Embedding):
    """An embedding table replicated on every rank, looked up by full (replicated) ids (positions)."""

    def _local_params(self) -> tuple[tuple[str, bool], ...]:
        return (("weight", False),)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self._local("weight"))


def column_parallel(linear: nn.Linear, tp: TensorParallel, memo: dict[int, nn.Parameter]) -> None:
    distribute_parameters(linear, {"weight": Shard(0), "bias": Shard(0)}, tp, memo)
    _swap(linear, nn.Linear, ColumnParallelLinear, tp)


def row_parallel(linear: nn.Linear, tp: TensorParallel, memo: dict[int, nn.Parameter]) -> None:
    distribute_parameters(linear, {"weight": Shard(1), "bias": Replicate()}, tp, memo)
    _swap(linear, nn.Linear, RowParallelLinear, tp)


def vocab_parallel_embedding(embedding: nn.Embedding, tp: TensorParallel, memo: dict[int, nn.Parameter]) -> None:
    if embedding.num_embeddings % tp.size:
        raise ValueError(f"The vocabulary of {embedding.num_embeddings} rows does not split over"
                         f" tensor_parallel_size={tp.size}: pad it to a multiple (GPTConfig.padded_vocab_size).")
    distribute_parameters(embedding, {"weight": Shard(0)}, tp, memo)
    _swap(embedding, nn.Embedding, VocabParallelEmbedding, tp)


def replicated(module: nn.Module, tp: TensorParallel, memo: dict[int, nn.Parameter]) -> None:
    """A LayerNorm or an embedding (of replicated ids) with replicated parameters."""
    distribute_parameters(module, {n: Replicate() for n, _ in module.named_parameters(recurse=False)}, tp, memo)
    if type(module) is nn.LayerNorm:
        _swap(module, nn.LayerNorm, ReplicatedLayerNorm, tp)
    else:
        _swap(module, nn.Embedding, ReplicatedEmbedding, tp)


def fused_column_parallel(x: Tensor, linears: Sequence[nn.Linear], tp: TensorParallel) -> tuple[Tensor, ...]:
    """Several column-parallel layers of one input as one GEMM (q, k, v): one f (or all-gather) forward, one
    all-reduce (or reduce-scatter) of the input gradient backward, overlapped with the weight-gradient GEMM
    (:func:`column_parallel_linear`), and one GEMM of this rank's rows of each.

    The parameters stay separate (checkpoints and export see ``q``, ``k``, ``v``); the fused weight is their local
    shards side by side, so the result is ``(linear(x) for linear in linears)`` with this rank's columns. A layer
    without bias contributes zeros to the fused bias when another has one."""
    weights = [l._local("weight") for l in linears]
    biases = [l._local("bias") for l in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights)])
    out = column_parallel_linear(x, torch.cat(weights), bias, tp)
    return out.split([w.shape[0] for w in weights], dim=-1)
