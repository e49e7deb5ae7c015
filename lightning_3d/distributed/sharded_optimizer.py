"""Optimizer state sharded over the data-parallel group (ZeRO-1, Megatron-LM's distributed optimizer).

Each data-parallel rank keeps and updates only its 1/dp of every gradient bucket: the synchronizer reduce-scatters a
bucket instead of all-reducing it, the user's torch optimizer steps on this rank's pieces of the parameters (fp32,
so also the fp32 master weights under ``bf16-true``), and the parameters are all-gathered after the step. The layout
is Megatron's: a bucket's flat gradient, padded to a multiple of dp, is cut into dp equal ranges; a parameter
overlapping this rank's range contributes one *piece* (a 1-D slice of its local tensor) to the optimizer, in place
of the parameter itself, in the same param group. The optimizer object, its param groups (learning rates, weight
decay) and so the LR schedulers stay the user's. This is why only element-wise optimizers apply (AdamW, Adam, SGD,
...): a piece is not a whole tensor, so an optimizer that looks at a parameter's shape or norm (Adafactor, LAMB) is
not sharded correctly.

Checkpoints keep the unsharded format (``state.<fqn>.<key>`` and ``param_groups.<fqn>.<key>``, DTensor-sharded over
tensor ranks, as ``get_optimizer_state_dict`` writes): a save gathers each bucket's state over the replicas and each
replica writes the parameters that start in its range; a load reads the parameters it has pieces of and slices them. Any
layout, sharded or not, loads any other. See docs/sharded_optimizer.md.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import Optimizer

from lightning_3d.utils.tensors import local


def shard_size(numel: int, dp: int) -> int:
    """Elements of one rank's range of a bucket of ``numel`` elements (the bucket is padded to ``dp`` times this)."""
    return -(-numel // dp)


def owned_elements(numel: int, dp: int, rank: int) -> int:
    """Elements of a ``numel``-element bucket whose optimizer state ``rank`` holds (its range less the padding)."""
    size = shard_size(numel, dp)
    return max(0, min(numel, (rank + 1) * size) - rank * size)


@dataclass(eq=False)
class Piece:
    """The part ``[start, end)`` of ``local(param).view(-1)`` that this rank updates; ``offset`` is its place in this
    rank's range of the unit; ``main`` is what the optimizer steps (a view of the parameter when it is fp32, else an
    fp32 master copy)."""

    param: nn.Parameter
    start: int
    end: int
    offset: int
    main: Tensor | None = None
    counted: bool = True  # enters the gradient norm on this rank (see ShardedOptimizer.clip)


@dataclass(eq=False)
class Unit:
    """Parameters laid out flat, in order, as one bucket of the gradient synchronizer (or one parameter the
    synchronizer does not bucket); ``pieces`` are this rank's parts of all of them."""

    params: list[nn.Parameter]
    numel: int
    shard: int
    pieces: list[Piece] = field(default_factory=list)

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self.params)


def units_of(optimizer: Optimizer, buckets: Sequence[Sequence[nn.Parameter]]) -> list[list[nn.Parameter]]:
    """The units of sharding: the synchronizer's buckets (reduce-scattered), then each optimized parameter it does not
    bucket (FE's tied weights, frozen ones), whose complete gradient is sliced."""
    bucketed = {id(p) for params in buckets for p in params}
    return [list(b) for b in buckets] + [[p] for g in optimizer.param_groups for p in g["params"] if id(p) not in bucketed]


_SHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sharding_of(optimizer: Optimizer) -> ShardedOptimizer | None:
    """The ``ShardedOptimizer`` that rewrote ``optimizer``'s param groups, if any (the checkpoint code asks)."""
    return _SHARDED.get(optimizer)


class ShardedOptimizer:
    """Shards ``optimizer`` (whose state must still be empty) over the data-parallel group, unit by unit.

    ``units``: parameter lists in the synchronizer's bucket order (the same on every replica); ``fqns``: parameter
    names of the module (checkpoint keys); ``tied_skip``: ids of tied copies left out of the gradient norm (counted on
    the other stage); ``tp_rank``: replicated (not tensor-sharded) parameters count in the norm on tensor rank 0 only.
    """

    def __init__(self, optimizer: Optimizer, units: Sequence[Sequence[nn.Parameter]], fqns: dict[int, str],
                 dp_group: dist.ProcessGroup | None, dp_size: int, dp_rank: int, tp_rank: int,
                 tied_skip: set[int] = frozenset(), masters: bool = True) -> None:
        if optimizer.state:
            why = "shard_optimizer_state=True" if dp_size > 1 else "Tensor parallelism's local optimizer step"
            raise RuntimeError(
                f"{why} needs a fresh optimizer, but {type(optimizer).__name__} already holds state for some"
                " parameters; return a new optimizer from configure_optimizers (a checkpoint restores its state)."
            )
        self.optimizer, self.fqns = optimizer, fqns
        self.dp_group, self.dp_size, self.dp_rank = dp_group, dp_size, dp_rank
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.group_of = group_of
        self.units: list[Unit] = []
        pieces_of_group: list[list[Tensor]] = [[] for _ in optimizer.param_groups]
        for params in units:
            params = list(params)
            numel = sum(local(p).numel() for p in params)
            unit = Unit(params, numel, shard_size(numel, dp_size))
            lo, hi, offset = dp_rank * unit.shard, (dp_rank + 1) * unit.shard, 0
            for p in params:
                n = local(p).numel()
                a, b = max(lo, offset), min(hi, offset + n)
                if a < b:
                    piece = Piece(p, a - offset, b - offset, a - lo)
                    unit.pieces.append(piece)
                    if id(p) in group_of:
                        piece.main = _main_tensor(p, piece.start, piece.end, masters)
                        tensor_sharded = isinstance(p, DTensor) and any(not isinstance(pl, Replicate) for pl in p.placements)
                        piece.counted = (tensor_sharded or tp_rank == 0) and id(p) not in tied_skip
                        pieces_of_group[group_of[id(p)]].append(piece.main)
                offset += n
            self.units.append(unit)
        self.pieces = [piece for unit in self.units for piece in unit.pieces if piece.main is not None]
        covered = {id(p) for unit in self.units for p in unit.params}
        if missing := [fqns.get(id(p), "?") for g in optimizer.param_groups for p in g["params"] if id(p) not in covered]:
            raise RuntimeError(f"shard_optimizer_state: the optimizer holds parameters {missing[:3]} that are not this"
                               " rank's stage parameters; pass only the module's own parameters to the optimizer.")
        # The optimizer's own param groups, rewritten: the same dicts (options, LR schedulers), this rank's pieces.
        self.param_order = [[p for p in g["params"]] for g in optimizer.param_groups]
        for group, pieces in zip(optimizer.param_groups, pieces_of_group):
            group["params"] = pieces
        _SHARDED[optimizer] = self

    def scatter_keys(self, full: set[int] = frozenset()) -> set[tuple[int, ...]]:
        """The units whose buckets the synchronizer may reduce-scatter: all but those holding a parameter of ``full``
        (whose complete average is needed elsewhere, e.g. a tied weight summed with another stage afterwards)."""
        return {u.key for u in self.units if not any(id(p) in full for p in u.params)}

    # ----- one step -------------------------------------------------------------------------------------------------
    def collect_grads(self, shards: dict[tuple[int, ...], Tensor]) -> None:
        """Give every piece its gradient: from the reduce-scattered shard of its unit's bucket, else sliced from the
        parameter's complete averaged gradient (SC's buckets, tied weights). The parameters' own gradients are then
        dropped: those of reduce-scattered buckets hold this replica's unreduced sums, which nothing may use."""
        for unit in self.units:
            shard = shards.get(unit.key)
            for piece in unit.pieces:
                if piece.main is None:
                    continue
                if shard is not None:
                    grad = shard[piece.offset : piece.offset + piece.end - piece.start]
                elif piece.param.grad is not None:
                    grad = local(piece.param.grad).reshape(-1)[piece.start : piece.end]
                else:
                    piece.main.grad = None
                    continue
                # Local mode: the parameter's own averaged gradient, viewed (nothing else writes it before the step).
                piece.main.grad = (grad.to(piece.main.dtype) if self.dp_size == 1 else
                                   grad.to(torch.float32, copy=True))
            if self.dp_size > 1:  # local mode keeps them: callbacks read them (on_before_optimizer_step)
                for p in unit.params:
                    p.grad = None

    def release_grads(self) -> None:
        """Local mode, after the step: drop the parameters' gradients (the pieces' are views of them), which the
        optimizer's own ``zero_grad`` (over the pieces) cannot reach."""
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def clip(self, max_norm: float, model_parallel_group: dist.ProcessGroup | None, device: torch.device) -> Tensor:
        """Clip the pieces' gradients by the global L2 norm: each element of a replica's gradient lives in exactly one
        replica's pieces, so the squares are summed over the pieces, then over the model-parallel and the
        data-parallel group (replicated tensor-parallel parameters counted on tensor rank 0, tied copies once)."""
        total = torch.zeros((), device=device, dtype=torch.float32)
        for piece in self.pieces:
            if piece.counted and piece.main.grad is not None:
                total += piece.main.grad.pow(2).sum()
        for group in (model_parallel_group, self.dp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(total, group=group)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for piece in self.pieces:
            if piece.main.grad is not None:
                piece.main.grad.mul_(coef)
        return norm

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the optimizer's step: write the fp32 masters back into their parameters, then every replica's updated
        range of every unit is all-gathered into the parameters (asynchronously, all units at once, then waited)."""
        for piece in self.pieces:
            target = _flat(piece.param)[piece.start : piece.end]
            if piece.main.data_ptr() != target.data_ptr():
                target.copy_(piece.main)
        if self.dp_size == 1:  # local mode: every piece is a whole parameter, nothing to gather
            return
        pending = []
        for unit in self.units:
            dtype = local(unit.params[0]).dtype
            send = torch.zeros(unit.shard, dtype=dtype, device=local(unit.params[0]).device)
            for piece in unit.pieces:
                send[piece.offset : piece.offset + piece.end - piece.start] = _flat(piece.param)[piece.start : piece.end]
            out = send.new_empty(unit.shard * self.dp_size)
            pending.append((unit, out, dist.all_gather_into_tensor(out, send, group=self.dp_group, async_op=True)))
        for unit, out, work in pending:
            work.wait()
            offset = 0
            for p in unit.params:
                flat = _flat(p)
                flat.copy_(out[offset : offset + flat.numel()])
                offset += flat.numel()

    def state_bytes(self) -> int:
        """Bytes of this rank's element-wise optimizer state (what sharding divides by dp; scalars such as Adam's
        ``step`` left out)."""
        return sum(v.numel() * v.element_size() for piece in self.pieces
                   for v in self.optimizer.state.get(piece.main, {}).values() if isinstance(v, Tensor) and v.ndim == 1)

    # ----- checkpoints (the unsharded format) ----------------------------------------------------------------------
    def _state_kinds(self) -> dict[str, tuple[str, torch.dtype]]:
        """Name -> ("element" | "scalar", dtype) of the optimizer's state, agreed over the replicas."""
        mine: dict[str, tuple[str, str]] = {}
        for piece in self.pieces:
            for name, value in self.optimizer.state.get(piece.main, {}).items():
                if not isinstance(value, Tensor) or not (value.ndim == 0 or value.shape == piece.main.shape):
                    raise TypeError(
                        f"shard_optimizer_state: {type(self.optimizer).__name__}'s state {name!r} is not one value per"
                        " element or a scalar: it is not an element-wise optimizer and cannot be sharded. Use AdamW, Adam"
                        " or SGD, or pass shard_optimizer_state=False."
                    )
                mine[name] = ("scalar" if value.ndim == 0 else "element", str(value.dtype).removeprefix("torch."))
        gathered: list[Any] = self._all_gather_object(mine)
        merged = {k: v for part in gathered for k, v in part.items()}
        return {k: (kind, getattr(torch, dtype)) for k, (kind, dtype) in sorted(merged.items())}

    def _scalars(self) -> dict[str, dict[str, float]]:
        """fqn -> {scalar state name: value} of every parameter some replica has state for."""
        mine: dict[str, dict[str, float]] = {}
        for piece in self.pieces:
            state = self.optimizer.state.get(piece.main)
            if state:
                mine.setdefault(self.fqns[id(piece.param)], {}).update(
                    {k: float(v) for k, v in state.items() if v.ndim == 0})
        gathered: list[Any] = self._all_gather_object(mine)
        merged: dict[str, dict[str, float]] = {}
        for part in gathered:
            for fqn, values in part.items():
                merged.setdefault(fqn, {}).update(values)
        return merged

    def _all_gather_object(self, mine: Any) -> list[Any]:
        if self.dp_size == 1:
            return [mine]
        gathered: list[Any] = [None] * self.dp_size
        dist.all_gather_object(gathered, mine, group=self.dp_group)
        return gathered

    def _groups(self) -> dict[str, Any]:
        out = {}
        for group, params in zip(self.optimizer.param_groups, self.param_order):
            for p in params:
                for k, v in group.items():
                    if k not in ("params", "param_names"):
                        out[f"param_groups.{self.fqns[id(p)]}.{k}"] = v
        return out

    def flat_state_dict(self) -> dict[str, Any]:
        """The optimizer state in the keys and shapes ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``
        gives an unsharded optimizer, each parameter's entries on one replica only (each unit's state is all-gathered,
        one unit at a time, and only this replica's parameters are kept): parameters go to replicas by where they start
        in all units laid end to end, cut into dp equal parts, so a replica holds 1/dp of the state, give or take one
        parameter, while DCP writes it. A collective on every rank."""
        kinds = self._state_kinds()
        scalars = self._scalars()
        out: dict[str, Any] = {}
        total, start = max(1, sum(u.numel for u in self.units)), 0
        for unit in self.units:
            gathered = {}
            for name, (kind, dtype) in kinds.items():
                if kind != "element":
                    continue
                send = torch.zeros(unit.shard, dtype=dtype, device=local(unit.params[0]).device)
                for piece in unit.pieces:
                    value = self.optimizer.state.get(piece.main, {}).get(name) if piece.main is not None else None
                    if value is not None:
                        send[piece.offset : piece.offset + piece.end - piece.start] = value
                if self.dp_size == 1:
                    gathered[name] = send
                    continue
                full = send.new_empty(unit.shard * self.dp_size)
                dist.all_gather_into_tensor(full, send, group=self.dp_group)
                gathered[name] = full
            offset = 0
            for p in unit.params:
                n = local(p).numel()
                fqn = self.fqns.get(id(p))
                if id(p) in self.group_of and fqn in scalars and (start + offset) * self.dp_size // total == self.dp_rank:
                    for name, (kind, dtype) in kinds.items():
                        if kind == "element":  # a copy: the unit's gathered buffer is freed after this loop
                            value = gathered[name][offset : offset + n].view(local(p).shape).clone()
                            out[f"state.{fqn}.{name}"] = _like(p, value)
                        elif name in scalars[fqn]:
                            out[f"state.{fqn}.{name}"] = torch.tensor(scalars[fqn][name], dtype=dtype)
                offset += n
            start += unit.numel
        out.update(self._groups())
        return out

    def template(self) -> dict[str, Any]:
        """What a load reads into: the state entries of the parameters this replica has pieces of, with tensors of
        the right shapes (the optimizer's state is first created by a step that changes nothing, as
        ``get_optimizer_state_dict`` does for a fresh optimizer), and every parameter's param-group options."""
        if not any(self.optimizer.state.get(piece.main) for piece in self.pieces):
            self._init_state()
        kinds = self._state_kinds()
        out: dict[str, Any] = {}
        for p in dict.fromkeys(piece.param for piece in self.pieces):
            fqn = self.fqns[id(p)]
            for name, (kind, dtype) in kinds.items():
                out[f"state.{fqn}.{name}"] = (_like(p, torch.zeros(local(p).shape, dtype=dtype, device=local(p).device))
                                              if kind == "element" else torch.zeros((), dtype=dtype))
        out.update(self._groups())
        return out

    def load_flat_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's pieces (and every param group's options) out of a loaded ``template``."""
        kinds = self._state_kinds()
        for piece in self.pieces:
            fqn = self.fqns[id(piece.param)]
            own = self.optimizer.state[piece.main]
            for name, (kind, _) in kinds.items():
                value = state.get(f"state.{fqn}.{name}")
                if value is None:
                    continue
                if kind == "element":
                    value = local(value).reshape(-1)[piece.start : piece.end]
                own[name] = value.to(device=piece.main.device if kind == "element" else own.get(name, value).device,
                                     copy=True)
        for group, params in zip(self.optimizer.param_groups, self.param_order):
            if params:
                fqn = self.fqns[id(params[0])]
                for k in list(group):
                    if k not in ("params", "param_names") and f"param_groups.{fqn}.{k}" in state:
                        group[k] = state[f"param_groups.{fqn}.{k}"]

    def _init_state(self) -> None:
        """One step with zero gradients at learning rate 0 creates the state tensors and changes no parameter."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for piece in self.pieces:
            piece.main.grad = torch.zeros_like(piece.main)
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], Tensor) else torch.zeros_like(g["lr"])
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        for piece in self.pieces:
            piece.main.grad = None


def _flat(p: nn.Parameter) -> Tensor:
    """The parameter's local values as one flat view (parameters are contiguous)."""
    return local(p).detach().view(-1)


def _main_tensor(p: nn.Parameter, start: int, end: int, masters: bool = True) -> Tensor:
    """What the optimizer steps for ``[start, end)`` of ``p``: a view of an fp32 parameter (no copy: the parameter is
    updated in place), else an fp32 master copy (bf16-true: the master weights are sharded with the state); without
    ``masters`` always the view (local mode: the optimizer steps the parameter's own dtype, as it would unwrapped)."""
    view = _flat(p)[start:end]
    return view if view.dtype == torch.float32 or not masters else view.float().clone()


# Optimizers whose update of an element depends only on that element's gradient and state (and scalars): they step a
# flat piece of a parameter exactly as the whole parameter. Shape- or norm-aware ones (Adafactor, LAMB, LARS, Muon)
# are not among them.
ELEMENTWISE_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad,
                          torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax)


def local_optimizer(optimizer: Optimizer, fqns: dict[int, str], tp_rank: int,
                    tied_skip: set[int] = frozenset()) -> ShardedOptimizer | None:
    """Tensor parallelism's optimizer step on local tensors (docs/tensor_parallel.md): an element-wise optimizer whose
    parameters include DTensors steps their local shards as plain tensors instead, one piece per parameter, in the
    parameters' own dtype. A torch optimizer's step over DTensors dispatches every element-wise op of every parameter
    through DTensor on the host, which costs more than the whole GPU step of a tensor-parallel layer; on local tensors
    its fused or foreach kernels run as for a data-parallel model. Checkpoints keep the unsharded format. Returns None
    (the optimizer unchanged) when no parameter is a DTensor or the optimizer is not known to be element-wise."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(isinstance(p, DTensor) for p in params) or type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        return None
    return ShardedOptimizer(optimizer, [[p] for p in params], fqns, None, 1, 0, tp_rank, tied_skip, masters=False)


def _like(p: nn.Parameter, value: Tensor) -> Tensor:
    """``value`` (the local tensor) laid out over the tensor-parallel mesh like ``p``."""
    if isinstance(p, DTensor):
        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return value
