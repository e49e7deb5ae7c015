"""Data-parallel gradient all-reduce, tied-embedding synchronisation and global-norm clipping.

Written by hand rather than wrapping stages in DDP because (a) DDP does not take DTensor parameters on a
multi-dimensional mesh, (b) pipeline stages must reduce only after their *last* micro-batch, and
(c) selective stage compression and fused embedding synchronisation need to choose per bucket and per
parameter what travels. Buckets follow DDP's idea: gradients in reverse registration order, launched as
soon as every gradient of a bucket is final and all earlier buckets have launched (the same order on
every replica), overlapping the rest of the backward. With sharded optimizer state, the buckets the sharded
optimizer names (``scatter``) are reduce-scattered instead: each replica receives the average of its own range
(``take_shards``; docs/sharded_optimizer.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_3d.compression.selective import DataParallelPowerSGD
from lightning_3d.distributed.wgrad_fusion import register_slot, unregister_slot
from lightning_3d.utils.comm_stats import CommunicationStats
from lightning_3d.utils.tensors import local

#: the data-parallel all-reduce buckets' size (``RuntimeConfig.bucket_size_mb``'s default)
DEFAULT_BUCKET_SIZE_MB = 25.0


@dataclass(eq=False)  # buckets are found by identity (list.index), never compared by value
class Bucket:
    params: list[nn.Parameter]
    stage: int | None
    ready: set[int] = field(default_factory=set)
    flat: Tensor | None = None
    work: dist.Work | torch.futures.Future | None = None
    compressed: bool = False  # selective stage compression (SC) applies to this bucket
    buffer: Tensor | None = None  # fused weights: the persistent flat fp32 gradients, each weight's .grad a view of it
    numel: int = 0  # of its gradients (the buffer and a reduce-scattered flat are padded to a multiple of dp)
    shard: Tensor | None = None  # sharded optimizer: this replica's range of the averaged flat, once reduce-scattered

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self.params)


class GradientSynchronizer:
    """Averages gradients over the data-parallel group, bucket by bucket."""

    def __init__(
        self,
        params_by_stage: dict[int | None, list[nn.Parameter]],
        dp_group: dist.ProcessGroup | None,
        dp_size: int,
        bucket_size_mb: float = DEFAULT_BUCKET_SIZE_MB,
        exclude: set[int] = frozenset(),
        compressor: DataParallelPowerSGD | None = None,
        compressed_stages: set[int | None] = frozenset(),
        stats: CommunicationStats | None = None,
        fused: Sequence[nn.Parameter] = (),
        pad_to: int = 1,
    ) -> None:
        """``exclude``: ids of parameters synchronised elsewhere (fused embedding sync); ``compressed_stages``:
        stages whose buckets go through ``compressor`` (SC); they ignore ``bucket_size_mb`` (see below); ``fused``:
        weights of ``FusedGradLinear`` layers, whose gradients accumulate straight into their buckets (wgrad_fusion);
        ``pad_to``: dp where the optimizer state is sharded, so that a fused bucket's buffer can be reduce-scattered
        as it is (``scatter``, docs/sharded_optimizer.md)."""
        self._pad_to = pad_to
        # Keys (parameter ids) of the buckets that are reduce-scattered instead of all-reduced (sharded optimizer).
        self.scatter: set[tuple[int, ...]] = set()
        self._fused = {id(p) for p in fused}
        self.dp_group, self.dp_size = dp_group, dp_size
        self.compressor, self.stats = compressor, stats
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        self._armed: set[int | None] = set()
        self._next_launch = 0
        self._syncing = False
        self._fused_accumulations = 0
        cap = bucket_size_mb * 2**20
        # Later stages finish their backward first (interleaved schedules); within a stage, gradients arrive
        # roughly in reverse registration order.
        for stage in sorted(params_by_stage, key=lambda s: -1 if s is None else s, reverse=True):
            params = list(reversed([p for p in params_by_stage[stage] if p.requires_grad and id(p) not in exclude]))
            if stage in compressed_stages:
                # SC: one bucket per dtype for the whole stage, same-shape matrices side by side. PowerSGD's cost is
                # per shape group (a handful of small kernels each), not per byte: 25 MB buckets cut a GPT stage into
                # dozens of buckets and thousands of kernel launches per step, host-bound (benchmarks/compression/sc_kernels.py;
                # the numbers: benchmarks/RESULTS.md#2026-11-22d-sc-kernels), and the compressed collectives are small
                # enough to gain nothing from overlap.
                # Adjacent shapes let the compressor work on views of the bucket, in place.
                for kind in dict.fromkeys(self._kind(p) for p in params):
                    same_kind = [p for p in params if self._kind(p) == kind]
                    order = {shape: i for i, shape in enumerate(dict.fromkeys(local(p).shape for p in same_kind))}
                    self._add_bucket(sorted(same_kind, key=lambda p: order[local(p).shape]), stage)
                continue
            # Fused weights first, in their own buckets (their gradients are the buckets), then the rest (biases,
            # norms: small): alternating them would cut a bucket at every layer.
            params = [p for p in params if id(p) in self._fused] + [p for p in params if id(p) not in self._fused]
            current: list[nn.Parameter] = []
            size = 0.0
            for p in params:
                if current and (size + _nbytes(p) > cap or self._kind(p) != self._kind(current[0])):
                    self._add_bucket(current, stage)
                    current, size = [], 0.0
                current.append(p)
                size += _nbytes(p)
            if current:
                self._add_bucket(current, stage)
        self._compressed_stages = compressed_stages
        self.attach_compressor(compressor)
        # Every parameter, bucketed or synchronised elsewhere, gets its gradient placement aligned.
        self._all = [p for params in params_by_stage.values() for p in params if p.requires_grad]
        # A hook runs once per parameter and micro-batch, a Python call each (host time a short-kernel step waits
        # for: benchmarks/parallel/pp_host_time.py), so only where it has work: launching buckets (dp > 1) and
        # slicing a DTensor gradient to its placement as soon as it exists. Not on fused weights: their op reports
        # each accumulation, and autograd still runs their (empty) hooks. ``finish`` aligns every parameter anyway.
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._all
                       if id(p) not in self._fused and (dp_size > 1 or isinstance(p, DTensor))]

    def attach_compressor(self, compressor: DataParallelPowerSGD | None) -> None:
        """Route the buckets of the compressed stages through ``compressor`` (SC) from now on."""
        self.compressor = compressor
        for b in self.buckets:
            b.compressed = compressor is not None and b.stage in self._compressed_stages
        compressed = [i for i, b in enumerate(self.buckets) if b.compressed]
        self._last_compressed = compressed[-1] if compressed else -1

    def _kind(self, p: nn.Parameter) -> tuple[torch.dtype, bool]:
        """Buckets hold one dtype, and either only fused weights or none."""
        return local(p).dtype, id(p) in self._fused

    def _add_bucket(self, params: list[nn.Parameter], stage: int | None) -> None:
        bucket = Bucket(params, stage, numel=sum(local(p).numel() for p in params))
        self.buckets.append(bucket)
        for p in params:
            self._bucket_of[id(p)] = bucket
        if id(params[0]) in self._fused:
            padded = -(-bucket.numel // self._pad_to) * self._pad_to
            bucket.buffer = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
            offset = 0
            for p in params:
                register_slot(p, bucket.buffer[offset : offset + p.numel()].view_as(p), self._on_fused_accumulated)
                offset += p.numel()

    # ----- step protocol ---------------------------------------------------------------------------------
    def begin(self, sync: bool) -> None:
        """Start a backward phase; ``sync`` is False while accumulating gradients over several batches."""
        self._syncing = sync and self.dp_size > 1
        self._fused_accumulations = 0
        self._armed.clear()
        self._next_launch = 0
        for b in self.buckets:
            b.ready.clear()
            b.flat, b.work, b.shard = None, None, None

    def arm(self, stage: int | None) -> None:
        """The coming backward of ``stage`` is its last this step: its gradients become final during it."""
        self._armed.add(stage)

    def finish(self) -> None:
        """Launch what is left (in order), wait for all buckets and write the averages back."""
        if self._fused and self._fused_accumulations == 0:
            raise RuntimeError(
                "No fused nn.Linear weight received a gradient in this backward: the compiler dropped the fused"
                " accumulation (lightning_3d::accumulate_weight_grad), or this stage's linear layers were not used."
                " Pass gradient_accumulation_fusion=False to Compressed3DStrategy and report the torch version."
            )
        for p in self._all:
            align_grad_placement(p, allow_communication=True)
        if not self._syncing:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for b in self.buckets:
            b.work.wait()
            if b.shard is not None:  # reduce-scattered: the sharded optimizer takes b.shard (take_shards)
                b.flat, b.work = None, None
                continue
            if b.compressed:  # the hook wrote the averaged, decompressed gradients into the flat buffer
                b.flat = b.work.value()
                self.compressor.finished(self.buckets.index(b), b.flat)
            if b.buffer is not None:  # the weights' .grad are views of the buffer, averaged in place
                if b.flat.data_ptr() != b.buffer.data_ptr():
                    b.buffer[: b.numel].copy_(b.flat)
                b.flat, b.work = None, None
                continue
            offset = 0
            for p in b.params:
                n = local(p).numel()
                reduced = b.flat[offset : offset + n].view_as(local(p))
                if p.grad is None:
                    p.grad = _like_param(p, reduced.clone())
                else:
                    local(p.grad).copy_(reduced)
                offset += n
            b.flat, b.work = None, None
        self._syncing = False

    # ----- internals ---------------------------------------------------------------------------------------
    def _on_fused_accumulated(self, param: nn.Parameter) -> None:
        """The fused op's report, once per layer and micro-batch: counted, and only a step that synchronises has more
        to do (fused weights are plain tensors, so there is no placement to align; their buckets launch from here)."""
        self._fused_accumulations += 1
        if self._syncing:
            self._on_grad_ready(param)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is None and id(param) not in self._fused:
            # A split backward's B (pipeline/weight_grad.py): autograd runs the hook of a weight whose gradient the
            # layer deferred to W; the hook runs again when W accumulates it. (A fused weight reports after writing.)
            return
        bucket = self._bucket_of.get(id(param))
        if bucket is not None and bucket.work is not None:
            # Only a fused weight can get here (autograd sums a parameter's uses before its hook fires; the fused op
            # reports each use): the layer ran twice in one forward and its bucket already left with half its gradient.
            raise RuntimeError(
                f"A weight of shape {tuple(param.shape)} received gradient after its data-parallel bucket was sent: its"
                " nn.Linear is called more than once per forward, which gradient-accumulation fusion cannot follow."
                " Pass gradient_accumulation_fusion=False to Compressed3DStrategy."
            )
        final = bucket is not None and bucket.stage in self._armed
        align_grad_placement(param, allow_communication=final)
        if not (self._syncing and final):
            return
        bucket.ready.add(id(param))
        while self._next_launch < len(self.buckets):
            nxt = self.buckets[self._next_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        scatter = not bucket.compressed and bucket.key in self.scatter
        if bucket.buffer is not None:
            grads = [self._grad_in_slot(p) for p in bucket.params]
            # already laid out as the bucket: no copy in, none back (the padding only travels when reduce-scattered)
            flat = bucket.buffer if scatter else bucket.buffer[: bucket.numel]
        else:
            grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in bucket.params]
            pad = -(-bucket.numel // self.dp_size) * self.dp_size - bucket.numel if scatter else 0
            flat = torch.cat([g.reshape(-1) for g in grads] + ([grads[0].new_zeros(pad)] if pad else []))
        bucket.flat = flat
        if scatter:
            # Sharded optimizer state: each replica receives the average of its own range only (docs/sharded_optimizer.md).
            if self.stats is not None:
                self.stats.add("dp_gradients", flat.numel() * flat.element_size())
            flat.div_(self.dp_size)
            bucket.shard = flat.new_empty(flat.numel() // self.dp_size)
            bucket.work = dist.reduce_scatter_tensor(bucket.shard, flat, group=self.dp_group, async_op=True)
            return
        if bucket.compressed:
            index = self.buckets.index(bucket)
            shapes = [g.shape for g in grads]
            bucket.work = self.compressor.launch(index, flat, shapes, is_last=index == self._last_compressed)
            return
        if self.stats is not None:
            self.stats.add("dp_gradients", flat.numel() * flat.element_size())
        flat.div_(self.dp_size)  # gloo has no AVG; dividing first also keeps bf16 sums in range
        bucket.work = dist.all_reduce(flat, group=self.dp_group, async_op=True)

    def take_shards(self) -> dict[tuple[int, ...], Tensor]:
        """The reduce-scattered ranges of this step, by bucket key (handed over once: the buckets forget them)."""
        shards = {b.key: b.shard for b in self.buckets if b.shard is not None}
        for b in self.buckets:
            b.shard = None
        return shards

    @staticmethod
    def _grad_in_slot(p: nn.Parameter) -> Tensor:
        """A fused weight's gradient, made to live in its slot (zero if it got none this step)."""
        slot = p._fused_grad_owner.grad_slot
        if p.grad is None:
            slot.zero_()
        elif p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
        p.grad = slot
        return slot

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for b in self.buckets:
            if b.buffer is not None:
                for p in b.params:
                    unregister_slot(p)


def align_grad_placement(param: nn.Parameter, allow_communication: bool) -> None:
    """Give a DTensor gradient its parameter's placements.

    DTensor autograd can produce a gradient laid out differently from its parameter: the vocab-parallel
    embedding's comes back ``Replicate`` (full size) for a ``Shard(0)`` weight, sequence-parallel norms'
    come back ``Partial``. Slicing a replicated gradient is local and done at once; reducing a partial one
    is a tensor-parallel collective, done once, after the last accumulation.
    """
    grad = param.grad
    if not isinstance(grad, DTensor) or grad.placements == param.placements:
        return
    if any(pl.is_partial() for pl in grad.placements) and not allow_communication:
        return
    param.grad = grad.redistribute(param.device_mesh, param.placements)


def _nbytes(p: Tensor) -> int:
    t = local(p)
    return t.numel() * t.element_size()


def _like_param(param: nn.Parameter, local_grad: Tensor) -> Tensor:
    if isinstance(param, DTensor):
        return DTensor.from_local(local_grad, param.device_mesh, param.placements, run_check=False)
    return local_grad


def sync_tied_gradients(
    tied: Sequence[nn.Parameter], group: dist.ProcessGroup | None, divide_by: int = 1, stats: CommunicationStats | None = None
) -> None:
    """Sum the gradient of a tied weight held by two stages on different ranks (first and last stage).

    Baseline: ``group`` is {first, last} of one replica and the data-parallel average already happened.
    Fused (FE): ``group`` is {first, last} x all replicas of one tensor-parallel rank, the weight was left out
    of the data-parallel all-reduce, and ``divide_by`` = dp turns the sum into the same average-then-sum.
    """
    if group is None:
        return
    for p in tied:
        grad = local(p.grad) if p.grad is not None else torch.zeros_like(local(p))
        if stats is not None:
            stats.add("embedding_sync", grad.numel() * grad.element_size())
        dist.all_reduce(grad, group=group)
        if divide_by != 1:
            grad.div_(divide_by)
        if p.grad is None:
            p.grad = _like_param(p, grad)


def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float,
    model_parallel_group: dist.ProcessGroup | None,
    tp_rank: int,
    device: torch.device,
    skip: set[int] = frozenset(),
) -> Tensor:
    """Clip by the global L2 norm over all pipeline stages and tensor-parallel shards.

    A replica's gradients are spread over its pipeline and tensor ranks: sharded DTensor gradients add up
    across tensor ranks; replicated ones (plain tensors, ``Replicate`` DTensors) are counted on tensor rank 0
    only, and tied copies (``skip``) once. Same formula as ``torch.nn.utils.clip_grad_norm_``, no host sync.
    """
    params = [p for p in params if p.grad is not None]
    # Every rank joins the all-reduce below, even one without gradients, or the others would hang.
    total = torch.zeros((), device=device, dtype=torch.float32)
    for p in params:
        g = p.grad
        if id(p) in skip:
            continue
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            raise RuntimeError(f"A gradient has partial placements {g.placements}; it must be reduced before clipping.")
        sharded = isinstance(g, DTensor) and any(not isinstance(pl, Replicate) for pl in g.placements)
        if sharded or tp_rank == 0:
            total += local(g).float().pow(2).sum()
    if model_parallel_group is not None:
        dist.all_reduce(total, group=model_parallel_group)
    total_norm = total.sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:  # tied copies are scaled too; they are only left out of the norm
        local(p.grad).mul_(coef.to(local(p.grad).dtype))
    return total_norm

