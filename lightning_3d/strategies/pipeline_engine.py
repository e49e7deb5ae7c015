"""PipelineEngine: what one training or evaluation step of ``Compressed3DStrategy`` does, hook by hook.

With the pipeline protocol the whole forward and backward of a batch run in ``train_step`` (the schedule interleaves
them per micro-batch): it splits and checks the batch, runs the ``PipelineRuntime``, lets the gradient synchronizer
finish the data-parallel all-reduce, sums the tied embedding gradients (FE: with the replicas in one all-reduce),
stashes the gradients out of reach of Lightning's ``zero_grad`` until ``hand_back_gradients`` (Lightning's
``backward``), and reports the step's global mean loss on every rank. For every module, pipelined or plain, it
guards the optimizer step against non-finite losses and gradients (one verdict for the world) and clips by the
global norm over all stages, shards and replicas; with ``shard_optimizer_state`` the optimizer steps on this replica's
pieces (``ShardedOptimizer``, docs/sharded_optimizer.md). It also prepares the module for that: ``prepare_pipeline``
turns a protocol module into this rank's stages (``stage_builder``), fuses their ``nn.Linear`` gradient accumulation,
builds the ``PipelineRuntime`` (with CB's codec from ``CompressionState``) and the data-parallel
``GradientSynchronizer``; ``prepare_plain`` does the data-parallel part for a plain module. It is built once per strategy (the non-finite
streak spans its runs) and ``release`` forgets the module. See docs/architecture.md (One training step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer

from lightning_3d.distributed import wgrad_fusion
from lightning_3d.distributed.grad_sync import GradientSynchronizer, clip_grad_norm_, sync_tied_gradients
from lightning_3d.distributed.process_groups import ProcessGroups
from lightning_3d.distributed.sharded_optimizer import ShardedOptimizer, sharding_of
from lightning_3d.distributed.wgrad_fusion import choose_fused, fusable_linears, fuse_gradient_accumulation, unfuse_gradient_accumulation
from lightning_3d.dynamic.consistency import check_same_plan
from lightning_3d.pipeline.codec import IdentityCodec
from lightning_3d.pipeline.graphs import StageGraphs
from lightning_3d.pipeline.microbatch import split_batch
from lightning_3d.pipeline.runtime import PipelineRuntime
from lightning_3d.pipeline.schedules import schedule_spec
from lightning_3d.pipeline.weight_grad import split_linears, splittable_linears, unsplit_linears
from lightning_3d.strategies.cb_link import measure_pipeline_link
from lightning_3d.strategies.compression_state import CompressionState
from lightning_3d.strategies.context_parallel import check_context_module, enable_context_parallel, sequence_keys, shard_microbatches
from lightning_3d.strategies.nonfinite import NonFiniteGuard
from lightning_3d.strategies.optimizer_sharding import shard_optimizers
from lightning_3d.strategies.options import PipelineOptions
from lightning_3d.strategies.protocol import missing_protocol_methods, one_host_read
from lightning_3d.strategies.stage_builder import (
    broadcast_parameters,
    build_stages,
    check_protocol,
    check_still_tied,
    check_tensor_parallel_shapes,
    check_tied_names,
    plan_pipeline,
    tied_copies,
)
from lightning_3d.utils.comm_stats import CommunicationStats


class PipelineEngine:
    """The step hooks' work (see the module docstring). Public attributes are its interface to the strategy:
    ``runtime`` (None for a plain module), ``grad_sync``, ``sync_blocked`` (Lightning's ``block_backward_sync``),
    ``tied`` (this rank's copies of tied weights), ``stage_params``, ``fused_weights`` and ``stats``."""

    def __init__(self, options: PipelineOptions, compression: CompressionState, stats: CommunicationStats) -> None:
        self.options = options
        self.num_microbatches = options.num_microbatches
        self.compression = compression
        self.stats = stats
        self.runtime: PipelineRuntime | None = None
        self.grad_sync: GradientSynchronizer | None = None
        self.groups: ProcessGroups | None = None
        self.device: torch.device | None = None
        self.stage_params: dict[int | None, list[nn.Parameter]] = {}
        self.fused_weights: list[nn.Parameter] = []
        self.split_layers: list[nn.Linear] = []  # zero-bubble schedules: layers whose W computes their weight gradient
        self.tied: list[nn.Parameter] = []
        self.fused_tied = False
        self.sync_blocked = False
        self._stashed_grads: list[tuple[nn.Parameter, Tensor | None]] | None = None
        # The non-finite verdict of every step (strategies/nonfinite.py); its device is set with the engine's.
        self.guard = NonFiniteGuard(options.on_nonfinite, options.max_consecutive_nonfinite, compression)
        self.sharded: ShardedOptimizer | None = None  # shard_optimizer_state, once the optimizer is sharded
        self.local_pieces: list[ShardedOptimizer] = []  # tensor parallelism's optimizers on local shards

    # ----- preparing a module -------------------------------------------------------------------------------------
    def prepare(self, module: pl.LightningModule, groups: ProcessGroups, device: torch.device, precision) -> None:
        """Prepare ``module`` for this rank: its pipeline stages if it implements the protocol, else data parallelism
        only; ``precision`` is the strategy's precision plugin (``convert_module``, ``forward_context``)."""
        check_protocol(module, groups.dims.pp, groups.dims.tp)
        check_context_module(module, self.options.context_parallel, protocol=not missing_protocol_methods(module))
        if missing_protocol_methods(module):
            self.prepare_plain(module, groups, device, precision.convert_module)
        else:
            self.prepare_pipeline(module, groups, device, precision)

    def prepare_plain(self, module: pl.LightningModule, groups: ProcessGroups, device: torch.device, convert_module) -> None:
        """A module without the pipeline protocol: data parallelism only, with Lightning's own steps."""
        o = self.options
        for option, value, fix in (
            ("num_microbatches", o.num_microbatches if o.num_microbatches > 1 else None,
             "use accumulate_grad_batches for plain modules"),
            ("stage_activation_checkpointing", list(o.stage_activation_checkpointing or []) or None,
             "leave it unset for plain modules"),
            ("cuda_graphs", True if o.cuda_graphs else None, "leave it False for plain modules"),
        ):
            if value is not None:
                raise TypeError(
                    f"{option}={value} needs the `lightning_3d.Parallel3DModule` protocol, which"
                    f" {type(module).__name__} does not implement; {fix}."
                )
        if o.gradient_accumulation_fusion is True:  # "auto", the default, says nothing about an option not chosen
            rank_zero_info("Compressed3DStrategy: gradient_accumulation_fusion applies to modules with the pipeline"
                           f" protocol (the recipes); {type(module).__name__}'s gradients accumulate as autograd's.")
        module.to(device)
        convert_module(module)
        broadcast_parameters(module, groups.dp_group, src=dist.get_global_rank(groups.dp_group, 0))
        self.groups, self.device = groups, device
        self.guard.device = device
        self.stage_params = {None: list(module.parameters())}
        self.build_grad_sync()
        self.compression.warn_unused(groups.dims, tied=False)

    def prepare_pipeline(self, module: pl.LightningModule, groups: ProcessGroups, device: torch.device, precision) -> None:
        """Cut a protocol module into this rank's stages and build the runtime and the synchronizer that run them."""
        o, dims, pp_rank = self.options, groups.dims, groups.pp_rank
        if o.cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True replays CUDA graphs, but this run trains on {device.type!r} devices."
                             " Train on GPUs (accelerator='gpu'), or set cuda_graphs=False.")
        check_tensor_parallel_shapes(module, dims.tp)
        check_tied_names(module)
        plan = plan_pipeline(module, dims.pp, pp_rank, o.virtual_stages, o.schedule, o.pipeline_layer_split,
                             o.stage_activation_checkpointing)
        stages, initialised = build_stages(module, plan, groups.tp_mesh, o.sequence_parallel, device, precision.convert_module)
        if dims.pp == 1:
            check_still_tied(module)
        if dims.cp > 1:
            enable_context_parallel(module, stages, groups.cp_group, o.context_parallel)
        if not initialised:
            broadcast_parameters(module, groups.dp_group, src=dist.get_global_rank(groups.dp_group, 0))
        groups.channels.warmup()
        self.groups, self.device = groups, device
        self.guard.device = device
        self.tied = tied_copies(module, pp_rank, dims.pp) if dims.pp > 1 else []
        self.fused_tied = bool(self.tied) and self.compression.config.fused_embedding_sync
        self.stage_params = {index: list(stage.parameters()) for index, stage in stages.items()}
        self.fuse_gradient_accumulation(stages, dims.tp)
        if dims.pp > 1 and schedule_spec(o.schedule).splits_backward:  # fused layers split themselves (weight_grad.py)
            self.split_layers = split_linears([m for stage in stages.values()
                                               for m in splittable_linears(stage, exclude={id(p) for p in self.tied})])
        self.runtime = PipelineRuntime(
            stages=stages, num_stages=plan.num_stages, pp_rank=pp_rank, pp_size=dims.pp, schedule=o.schedule,
            channels=groups.channels, device=device, loss_fn=module.pipeline_loss, loss_terms_fn=module.pipeline_loss_terms,
            forward_context=precision.forward_context,
            loss_context=loss_parallel if dims.tp > 1 else contextlib.nullcontext, stats=self.stats,
            dp_group=groups.dp_group if dims.replicas > 1 else None,  # dp x cp: every rank holding the parameters
        )
        self.build_grad_sync()
        self.compression.warn_unused(dims, tied=bool(module.pipeline_tied_parameters()))
        # CB's default depends on the pipeline link: measured here, on every rank, before the first step (cb_link.py).
        measure_pipeline_link(self.compression, dims, groups.device_mesh.get_group("pp"), device)
        self.install_codec()
        if o.cuda_graphs:
            self.runtime.graphs = StageGraphs()

    def install_codec(self) -> None:
        """The runtime's activation-gradient codec: CB's where the compression state says it runs, else exact."""
        dims = self.groups.dims
        codec = self.compression.build_codec(dims, self.groups.tp_mesh.get_group() if dims.tp > 1 else None,
                                             self.options.sequence_parallel)
        self.runtime.codec = codec if codec is not None else IdentityCodec()

    def fuse_gradient_accumulation(self, stages: dict[int, nn.Module], tp: int) -> None:
        if not self.options.gradient_accumulation_fusion:
            return
        mode = self.options.gradient_accumulation_fusion  # "auto" (the default) reports only what it fused
        if tp > 1 or self.options.cuda_graphs:  # True is refused with cuda_graphs; the weights are DTensors under tp
            if mode is True:
                rank_zero_info("Compressed3DStrategy: gradient_accumulation_fusion does not apply with"
                               " tensor_parallel_size > 1 (the weights are DTensors); gradients accumulate as autograd's.")
            return
        linears = [m for stage in stages.values() for m in fusable_linears(stage, exclude={id(p) for p in self.tied})]
        fused, small = choose_fused(linears, mode)
        self.fused_weights = fuse_gradient_accumulation(fused)
        if mode == "auto" and fused:
            rank_zero_info(f"Compressed3DStrategy: gradient_accumulation_fusion='auto' on {len(fused)} nn.Linear weights"
                           f" of this rank's stages; {len(small)} left unfused (fewer than"
                           f" {wgrad_fusion.FUSION_MIN_ELEMENTS} elements, where the fused op's host time exceeds what it"
                           " saves; True fuses them too).")
        elif mode is True:
            rank_zero_info(f"Compressed3DStrategy: gradient_accumulation_fusion on {len(fused)} nn.Linear weights of this"
                           " rank's stages.")

    def build_grad_sync(self) -> None:
        """(Re)create the data-parallel gradient synchronizer of this rank's stages (it registers gradient hooks)."""
        self._drop_grad_sync()  # the old one's hooks and fused-gradient slots go before the new one's come
        g, state = self.groups, self.compression
        # SC's default depends on the link; measured here, after every configuration check, before the buckets exist.
        state.measure_link(g.dims, g.dp_group, self.device)
        self.grad_sync = GradientSynchronizer(
            self.stage_params, g.dp_group, g.dims.replicas, self.options.bucket_size_mb,
            exclude={id(p) for p in self.tied} if self.fused_tied else set(),
            compressed_stages=set(self.stage_params) if state.compresses_rank(g.dims, g.pp_rank) else set(),
            stats=self.stats, fused=self.fused_weights,
            pad_to=g.dims.replicas if self.options.shard_optimizer_state else 1,
        )
        if self.sharded is not None:
            self.grad_sync.scatter = self.sharded.scatter_keys(full={id(p) for p in self.tied})
        if state.sc is not None:
            self.grad_sync.attach_compressor(state.sc)
        if self.runtime is not None:
            self.runtime.before_last_backward = self.grad_sync.arm

    def setup_selective_compression(self, trainer: pl.Trainer) -> None:
        """SC's PowerSGD state for this rank's buckets, where it compresses (fitting only; its warm-up is a fraction
        of the run's optimizer steps)."""
        def total_steps() -> int:
            return trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches

        g = self.groups
        params = [p for params in self.stage_params.values() for p in params]
        sc = self.compression.setup_selective(g.dims, g.pp_rank, g.dp_group, total_steps, params,
                                              warn_shapes=g.dp_rank == 0 and g.tp_rank == 0)
        if sc is not None:
            self.grad_sync.attach_compressor(sc)

    def _drop_grad_sync(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.remove_hooks()
            self.grad_sync = None

    def teardown(self) -> None:
        """End of a run: drop the synchronizer (its hooks would keep the parameters alive) and any stashed gradients.

        The synchronizer's gradient hooks are held by autograd's C++ state, out of the garbage collector's sight:
        parameter -> hook -> synchronizer -> parameter would be a cycle never freed, keeping every trained model's
        parameters, gradients and compression state alive for the life of the process. The next setup rebuilds it."""
        self._drop_grad_sync()
        self._stashed_grads = None
        self.drop_verdict()
        if self.runtime is not None and self.runtime.graphs is not None:
            self.runtime.graphs.release()  # the graphs' memory pool, and their references to the stages

    def release(self) -> None:
        """Forget the module: undo the gradient fusion, drop the runtime, groups, tied weights and every per-step
        state (the runtime and its codec hold groups). Idempotent."""
        self.teardown()
        unfuse_gradient_accumulation(self.fused_weights)
        unsplit_linears(self.split_layers)
        self.split_layers = []
        self.fused_weights, self.stage_params = [], {}
        self.runtime = self.groups = self.sharded = None
        self.local_pieces = []
        self.tied, self.fused_tied = [], False
        self.sync_blocked = False

    # ----- training ---------------------------------------------------------------------------------------------
    def train_step(self, module: pl.LightningModule, batch: Any, batch_idx: int) -> Tensor:
        """Forward and backward of one batch through the pipeline; returns the step's mean loss (every rank)."""
        accumulate = module.trainer.accumulate_grad_batches
        # One walk of the module tree per step (each parameters() call walks every submodule on the host).
        params = list(module.parameters())
        if batch_idx % accumulate == 0:
            for p in params:  # what Lightning's zero_grad would do (set_to_none), before our backward runs
                p.grad = None
        microbatches = self.context_slices(module, split_batch(batch, self.num_microbatches))
        check_batch(module, microbatches)
        self.check_same_plan(microbatches)
        self.grad_sync.begin(sync=not self.sync_blocked)
        loss = self.runtime.train_step(microbatches, loss_scale=1.0 / accumulate)
        self.grad_sync.finish()
        if not self.sync_blocked:
            g = self.groups
            if self.fused_tied:
                sync_tied_gradients(self.tied, g.fused_tied_group, divide_by=g.dims.replicas, stats=self.stats)
            else:
                sync_tied_gradients(self.tied, g.tied_group, stats=self.stats)
        # Lightning zeroes gradients between training_step and backward; keep ours out of its reach.
        self._stashed_grads = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None
        return self.report_loss(module, loss, "train")

    def hand_back_gradients(self) -> None:
        """Lightning's ``backward``: the pipeline already ran it in ``train_step``; restore its gradients."""
        for p, grad in self._stashed_grads or []:
            p.grad = grad
        self._stashed_grads = None

    def begin_backward(self) -> None:
        """A plain module's backward (Lightning's) is about to run: its gradients are final during it."""
        self.grad_sync.begin(sync=not self.sync_blocked)
        self.grad_sync.arm(None)

    def end_backward(self) -> None:
        self.grad_sync.finish()

    def eval_step(self, module: pl.LightningModule, batch: Any, stage: str) -> Tensor:
        microbatches = self.context_slices(module, split_batch(batch, self.num_microbatches, uneven=True))
        check_batch(module, microbatches)
        self.check_same_plan(microbatches)
        loss = self.runtime.eval_step(microbatches)
        return self.report_loss(module, loss, stage)

    def context_slices(self, module: pl.LightningModule, microbatches: Any) -> Any:
        """With context parallelism, this rank's slice of every sequence and its global positions (before any
        collective of the step; docs/context_parallel.md)."""
        g = self.groups
        tp = g.dims.tp if self.options.sequence_parallel else 1
        return shard_microbatches(microbatches, self.options.context_parallel, g.cp_rank, sequence_keys(module), tp)

    def check_same_plan(self, microbatches: Any) -> None:
        """With explicit per-step ``orders`` (dynamic micro-batching), the ranks of this replica's pipeline compare
        a digest of the schedule and micro-batch shapes before the first send (one all-reduce of two int64 over the
        model-parallel group; on CPU where the group is gloo): ranks that planned differently raise one clear error
        instead of hanging. Nothing runs for the named schedules. docs/dynamic.md (Determinism)."""
        orders = getattr(microbatches, "orders", None)
        if orders is None:
            return
        g = self.groups
        group = g.model_parallel_group
        device = torch.device("cpu") if dist.get_backend(group) == "gloo" else self.device
        check_same_plan(orders, microbatches, group, device, where=f"data-parallel replica {g.dp_rank}")

    def report_loss(self, module: pl.LightningModule, loss: Tensor | None, stage: str) -> Tensor:
        """Sum the last stage's per-replica shares of the step's mean loss (each replica's loss sum over the loss
        terms of all replicas, see ``PipelineRuntime.train_step``) and give the global mean to every rank, then log it."""
        contributes = loss is not None and self.groups.tp_rank == 0
        value = loss.detach().float() if contributes else torch.zeros((), device=self.device)
        if dist.get_world_size() > 1:  # one rank holds the sum already (a launch and its host time saved per step)
            dist.all_reduce(value)
        if callable(getattr(module, "log_pipeline_loss", None)):
            module.log_pipeline_loss(value, stage)
        else:
            module.log(f"{stage}_loss", value, prog_bar=True, sync_dist=False)
        return value

    # ----- the optimizer step -----------------------------------------------------------------------------------
    def shard_optimizer_state(self, optimizers: Sequence[Optimizer], module: pl.LightningModule) -> None:
        """ZeRO-1 where asked, tensor parallelism's local shards otherwise (strategies/optimizer_sharding.py)."""
        self.sharded, self.local_pieces = shard_optimizers(
            optimizers, module, self.groups, self.tied, self.grad_sync, self.options.shard_optimizer_state)

    def step_closure(self, optimizer: Optimizer, closure: Any, trainer: pl.Trainer, scaled: bool = False) -> Any:
        """Lightning's closure (forward, backward, gradient sync) and the sharded optimizer's gradients; the
        non-finite check (unless ``on_nonfinite="ignore"``) follows in ``after_gradient_hooks``, once the
        ``on_before_optimizer_step`` hooks and clipping have had the gradients. ``scaled``: a GradScaler steps it."""
        self.guard.before_closure()
        loss = closure()
        self._collect_grads(optimizer)
        self.guard.after_closure(loss, trainer, scaled)
        return loss

    def after_gradient_hooks(self, optimizer: Optimizer) -> None:
        """Lightning's hooks and clipping are done: the guard judges the gradients the update will read."""
        self.guard.judge_pending(optimizer)

    def _collect_grads(self, optimizer: Optimizer) -> None:
        """Hand the gradients to the pieces the optimizer steps (sharded, or tensor-parallel local shards)."""
        pieces = sharding_of(getattr(optimizer, "_optimizer", optimizer))
        if pieces is not None:
            pieces.collect_grads(self.grad_sync.take_shards() if pieces is self.sharded else {})

    def after_optimizer_step(self) -> None:
        """The lazy verdict's ``found_inf`` goes (it was this step's); sharded: every replica's updated range goes to
        every replica (the parameters are whole again)."""
        self.guard.after_step()
        if self.sharded is not None:
            self.sharded.gather_params()
        for pieces in self.local_pieces:  # also after a skipped step: no gradient may carry over into the next
            pieces.release_grads()

    # The guard's verdict, as the strategy and the tests reach it (strategies/nonfinite.py).
    def flush_verdict(self) -> None:
        self.guard.flush_verdict()

    def drop_verdict(self) -> None:
        self.guard.drop_verdict()

    def verdict_can_wait(self, optimizer: Optimizer, scaled: bool) -> bool:
        return self.guard.verdict_can_wait(optimizer, scaled)

    @property
    def lazy_verdict(self) -> bool:
        return self.guard.lazy_verdict

    @lazy_verdict.setter
    def lazy_verdict(self, value: bool) -> None:
        self.guard.lazy_verdict = value

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Lightning's norm clipping, by the global norm (tied copies counted once)."""
        g = self.groups
        pieces = sharding_of(getattr(optimizer, "_optimizer", optimizer))
        if pieces is not None:
            pieces.clip(clip_val, g.model_parallel_group, self.device)
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        skip = {id(p) for p in self.tied} if g.pp_rank == g.dims.pp - 1 else set()
        clip_grad_norm_(params, clip_val, g.model_parallel_group, g.tp_rank, self.device, skip)


def check_batch(module: pl.LightningModule, microbatches: list[Any]) -> None:
    """The module's ``check_pipeline_batch`` (optional) on every micro-batch, on every rank, before any collective.
    A batch that does not fit the model (an id outside the vocabulary, a sequence longer than its positions)
    would otherwise fail on the one stage that reads it, and the other ranks would only see a lost peer; every
    rank of a pipeline holds the same batch, so all of them raise the same message here. The values the checks
    read (``protocol.read_on_host``) reach the host in one copy for the whole step: each read of a device value
    waits for the GPU, which then idles until the host launches the next kernel (docs/speed.md)."""
    check = getattr(module, "check_pipeline_batch", None)
    if callable(check):
        with one_host_read():
            for microbatch in microbatches:
                check(microbatch)


# Optimizers that shard or synchronise their work across processes themselves (beside torch.distributed.optim).
