"""Compressed3DStrategy: data x pipeline x tensor parallel training inside Lightning's own loop.

This file holds the options, the process groups and the model set-up. The rest of the class lives beside it, one
concern per file: ``pipeline_steps`` (Lightning's step hooks), ``compression_setup`` (CB, SC and FE state, the link
test, byte accounting) and ``checkpoint_hooks`` (sharded checkpoints).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_3d.compression.config import CompressionConfig
from lightning_3d.compression.link import allreduce_bus_gbps
from lightning_3d.compression.selective import DataParallelPowerSGD
from lightning_3d.utils.comm_stats import CommunicationStats
from lightning_3d.pipeline.p2p import PipelineChannels
from lightning_3d.pipeline.runtime import PipelineRuntime
from lightning_3d.strategies.checkpoint_hooks import CheckpointHooksMixin
from lightning_3d.strategies.compression_setup import CompressionMixin
from lightning_3d.strategies.grad_sync import GradientSynchronizer
from lightning_3d.strategies.notebook import interactive_launcher, is_interactive
from lightning_3d.strategies.parallel_dims import ParallelDims, new_subgroups, resolve_schedule_options, resolve_sizes
from lightning_3d.strategies.pipeline_steps import PipelineStepsMixin
from lightning_3d.strategies.protocol import missing_protocol_methods
from lightning_3d.strategies.rng import seed_parallel_rng
from lightning_3d.strategies.stage_builder import (
    broadcast_parameters,
    build_stages,
    check_protocol,
    check_tensor_parallel_shapes,
    plan_pipeline,
)
from lightning_3d.strategies.wgrad_fusion import fusable_linears, fuse_gradient_accumulation, unfuse_gradient_accumulation
from lightning_3d.utils.compat import (
    SubprocessScriptLauncher,
    clear_dtensor_caches,
    default_process_group_backend,
    distributed_is_initialized,
    init_dist_connection,
    set_device_mesh,
    sync_ddp_if_available,
)

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")

# The sub-groups (device mesh, pipeline channels, tied and model-parallel groups) of the last run of any
# Compressed3DStrategy in this process, and the strategy they belong to. They outlive that run's teardown because a
# prepared module is bound to them (its stages hold the channels, tensor-parallel parameters the mesh): validate, test
# or fit again on the same strategy and module reuse them. The next run that needs new groups destroys these first,
# so a process holds one set of groups, with their threads and sockets, however many models it trains.
_live_owner: weakref.ref | None = None
_live_groups: list[dist.ProcessGroup] = []
_exit_hook: list[bool] = []  # whether _shutdown_at_exit is registered


def _destroy_live_groups() -> None:
    """Release the last run's model state on its strategy and destroy its groups (local: no collective)."""
    global _live_owner
    owner = _live_owner() if _live_owner is not None else None
    _live_owner = None
    if owner is not None:
        owner._release_model()
    groups = list(_live_groups)
    _live_groups.clear()
    for group in reversed(groups):
        try:
            dist.destroy_process_group(group)
        except ValueError:  # already gone: the user destroyed the world, which destroys every group with it
            pass
    if groups:
        clear_dtensor_caches()  # cached sharding decisions hold meshes on the destroyed groups
        # A destroyed group's C++ object (with its threads) lives until its last reference goes, and the released
        # model usually holds it in reference cycles (module <-> trainer). Collected here, while the process runs
        # normally; left to the collector, it could be finalised during interpreter shutdown (see _shutdown_at_exit).
        gc.collect()


def _shutdown_at_exit() -> None:
    """Release the last run and destroy every process group while the interpreter still runs normally. Left to
    interpreter shutdown, gloo's group destructors occasionally abort the process ("terminate called without an
    active exception", exit code -6) after all the work is done, which fails a torchrun or SLURM job that succeeded.
    Destroying is local to this process (no collective), so a rank that exits early does not wait for the others."""
    _destroy_live_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


class Compressed3DStrategy(PipelineStepsMixin, CompressionMixin, CheckpointHooksMixin, ParallelStrategy):
    """Train with data, pipeline and tensor parallelism at once; ``Compressed3DStrategy()`` is plain data parallel.

    Args:
        data_parallel_size: replicas; ``"auto"`` takes what pipeline and tensor parallelism leave of the world.
        pipeline_parallel_size: pipeline ranks; the model is cut into ``pp * virtual_stages`` stages.
        tensor_parallel_size: Megatron-style sharding of every layer (DTensor), innermost in the mesh.
        num_microbatches: micro-batches each per-replica batch is split into (a ``MicroBatches`` batch
            overrides it for one step).
        schedule: a registered schedule name: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, or one added with
            ``lightning_3d.pipeline.register_schedule`` (docs/extending.md).
        virtual_stages: stages per pipeline rank for interleaved schedules (at least 2 there, default 2; else 1).
        sequence_parallel: shard the residual stream over the sequence between tensor-parallel regions.
        pipeline_layer_split: layers per stage, overriding the even split.
        bucket_size_mb: size of the data-parallel all-reduce buckets of uncompressed stages (a stage under SC is
            synchronised as one bucket: its cost is per matrix shape, not per byte).
        gradient_accumulation_fusion: accumulate the weight gradients of ``nn.Linear`` layers inside the backward's
            GEMM, in fp32 buffers that double as the all-reduce buckets (Megatron-LM's option of the same name), for
            modules that implement the pipeline protocol (the recipes), with tensor_parallel_size=1; it applies to
            plain fp32 weights used once per forward and not tied to another module (see ``wgrad_fusion``).
        on_nonfinite: what a step whose loss or gradients hold NaN or inf does: ``"skip"`` (the default) leaves the
            parameters, the optimizer state and the compression state as they were, on every rank alike, and warns;
            ``"raise"`` stops training with an error on every rank; ``"ignore"`` applies the step (no check, no
            host synchronisation). A skipped step still counts as a step for ``global_step`` and LR schedulers.
        max_consecutive_nonfinite: with ``"skip"``, one more non-finite step in a row than this raises (the run is
            diverging).
        timeout: of every process group the strategy creates (the default group, the device mesh, the pipeline
            channels, the tied-embedding and model-parallel groups): a rank that stops answering fails the others
            after this long.
        checkpoint_io: must stay None: checkpoints are sharded ``torch.distributed.checkpoint`` directories the
            strategy writes itself.
    """

    strategy_name = "compressed_3d"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        num_microbatches: int = 1,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        sequence_parallel: bool = False,
        pipeline_layer_split: Sequence[int] | None = None,
        bucket_size_mb: float = 25.0,
        gradient_accumulation_fusion: bool = True,
        compression: bool = True,
        compressed_backprop: bool = True,
        cb_rank: int = 16,
        cb_epilogue_only: bool = True,
        cb_min_compression_ratio: float = 2.0,
        cb_lazy_error_propagation: bool = False,
        sc_rank: int = 128,
        sc_warmup: int | float = 0.1,
        sc_min_compression_ratio: float = 2.0,
        sc_matmul_precision: Literal["tf32", "fp32"] = "tf32",
        sc_max_link_gbps: float = 50.0,
        compressed_stages: Sequence[int] | None = None,
        fused_embedding_sync: bool = True,
        compression_seed: int = 0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        on_nonfinite: Literal["skip", "raise", "ignore"] = "skip",
        max_consecutive_nonfinite: int = 10,
    ) -> None:
        # Every check here runs on every rank before any process group exists.
        if checkpoint_io is not None:
            raise ValueError(
                f"Compressed3DStrategy does not take checkpoint_io={type(checkpoint_io).__name__}(...): its checkpoints are"
                " sharded torch.distributed.checkpoint directories that the strategy writes itself. Leave checkpoint_io"
                " unset."
            )
        if sequence_parallel and tensor_parallel_size == 1:
            raise ValueError(
                "sequence_parallel=True shards the sequence over tensor-parallel ranks, but tensor_parallel_size=1: it"
                " would do nothing. Pass tensor_parallel_size > 1, or drop sequence_parallel."
            )
        if on_nonfinite not in ("skip", "raise", "ignore"):
            raise ValueError(f"`on_nonfinite={on_nonfinite!r}` must be 'skip', 'raise' or 'ignore'.")
        if isinstance(max_consecutive_nonfinite, bool) or not isinstance(max_consecutive_nonfinite, int) or max_consecutive_nonfinite < 1:
            raise ValueError(f"`max_consecutive_nonfinite={max_consecutive_nonfinite!r}` must be a positive integer.")
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        virtual_stages = resolve_schedule_options(schedule, pipeline_parallel_size, virtual_stages, num_microbatches)
        self.compression = CompressionConfig(
            compression, compressed_backprop, cb_rank, cb_epilogue_only, cb_min_compression_ratio, cb_lazy_error_propagation, sc_rank,
            sc_warmup, sc_min_compression_ratio, sc_matmul_precision, sc_max_link_gbps,
            list(compressed_stages) if compressed_stages is not None else None,
            fused_embedding_sync, compression_seed,
        )
        self.compression.validate(pipeline_parallel_size)
        self.comm_stats = CommunicationStats()
        self._sizes = (data_parallel_size, pipeline_parallel_size, tensor_parallel_size)
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.sequence_parallel = sequence_parallel
        self.pipeline_layer_split = list(pipeline_layer_split) if pipeline_layer_split is not None else None
        self.bucket_size_mb = bucket_size_mb
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self._fused_weights: list[torch.nn.Parameter] = []
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self.dims: ParallelDims | None = None
        self._runtime: PipelineRuntime | None = None
        self._grad_sync: GradientSynchronizer | None = None
        self._stage_params: dict[int | None, list[torch.nn.Parameter]] = {}
        self._prepared_module = None
        self._sync_blocked = False
        self._stashed_grads: list[tuple[torch.nn.Parameter, Tensor | None]] | None = None
        self._tied: list[torch.nn.Parameter] = []
        self._fused_tied = False
        self._sc: DataParallelPowerSGD | None = None
        self._dp_link_gbps: float | None = None
        self._warned_unused = False
        self.on_nonfinite = on_nonfinite
        self.max_consecutive_nonfinite = max_consecutive_nonfinite
        self._nonfinite_streak = 0
        # Test seam: measures the data-parallel link (GB/s) at setup; a collective over the group it is given.
        self._link_probe = allreduce_bus_gbps

    # ----- environment --------------------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Only data-parallel replicas get distinct samples; pipeline and tensor ranks of a replica share them."""
        return {"num_replicas": self.dims.dp, "rank": self.dp_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def _configure_launcher(self) -> None:
        if self.cluster_environment.creates_processes_externally:
            return
        if is_interactive():  # a notebook has no script to start again: no launcher, or fork (see notebook.py)
            self._launcher = interactive_launcher(self, release=_shutdown_at_exit)
        else:
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        # Everything that can be wrong with the configuration is checked before the first collective.
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"Compressed3DStrategy does not support precision={precision!r}; use one of {', '.join(SUPPORTED_PRECISION)}."
            )
        world_size = self.num_nodes * self.num_processes
        dp, pp, tp = resolve_sizes(world_size, *self._sizes)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or default_process_group_backend(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        init_dist_connection(self.cluster_environment, backend, **kwargs)
        if not _exit_hook:
            atexit.register(_shutdown_at_exit)
            _exit_hook.append(True)
        global _live_owner
        if _live_owner is not None and _live_owner() is self and self._prepared_module is self.lightning_module:
            # The module this strategy prepared runs again (validate or test after fit, fit on with the same trainer):
            # its stages, channels and tensor-parallel parameters are bound to the groups it was prepared on.
            set_device_mesh(self.lightning_module, self.device_mesh)
            return
        # A new module: whatever the last run left (its model state, its groups, on this or another strategy) goes
        # first, and the groups are created afresh, each with this strategy's timeout. The counters and the link
        # measurement start over too, as on a fresh strategy (they stay readable after fit until then).
        _destroy_live_groups()
        self._release_model()
        self.comm_stats = CommunicationStats()
        self._dp_link_gbps = None
        self._warned_unused = False
        self.dims = ParallelDims(dp, pp, tp, world_size)
        self.device_mesh = self.dims.build_mesh(self.root_device.type, self._timeout, _live_groups)
        _live_owner = weakref.ref(self)
        self.dp_rank, self.pp_rank, self.tp_rank = self.dims.coordinates(self.global_rank)
        self._create_groups()
        set_device_mesh(self.lightning_module, self.device_mesh)

    def set_world_ranks(self) -> None:
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _create_groups(self) -> None:
        d, rank = self.dims, self.global_rank
        self.dp_group = self.device_mesh.get_group("dp")
        self.tp_mesh = self.device_mesh["tp"]
        # All pipeline and tensor ranks of one replica: the group a global gradient norm is summed over.
        made, timeout = _live_groups, self._timeout
        self.model_parallel_group = new_subgroups(
            [[d.rank_of(dp, p, t) for p in range(d.pp) for t in range(d.tp)] for dp in range(d.dp)], rank,
            timeout=timeout, created=made,
        )
        # First and last pipeline rank of each (dp, tp) pipeline: where tied embedding gradients meet.
        tied_pairs = [[d.rank_of(dp, 0, t), d.rank_of(dp, d.pp - 1, t)] for dp in range(d.dp) for t in range(d.tp)]
        self.tied_group = new_subgroups(tied_pairs, rank, timeout=timeout, created=made) if d.pp > 1 else None
        # Fused embedding sync: first and last stage of every replica, one group per tensor-parallel rank
        # (a group spanning tensor ranks would add up different vocabulary shards).
        fused = [[d.rank_of(dp, p, t) for dp in range(d.dp) for p in (0, d.pp - 1)] for t in range(d.tp)]
        self.fused_tied_group = new_subgroups(fused, rank, timeout=timeout, created=made) if d.pp > 1 else None
        pipelines = [d.pipeline_ranks(dp, t) for dp in range(d.dp) for t in range(d.tp)]
        self.channels = PipelineChannels(pipelines, rank, self.virtual_stages, self.root_device, timeout)
        made.extend(self.channels.groups)

    # ----- model setup ----------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.PREDICTING and self.dims.pp > 1:
            # Here, on every rank, before the predict loop builds its data loaders (a recipe's loader fails first
            # otherwise, with an error about samplers) and before any collective.
            raise RuntimeError(
                f"trainer.predict is not available with pipeline_parallel_size={self.dims.pp} (outputs live on the last"
                " stage only); predict with pipeline_parallel_size=1 (a checkpoint loads into any layout)."
            )
        self.accelerator.setup(trainer)
        # Dropout's streams: one per (dp, pp) rank, the same on its tp ranks, plus each tp rank's own (see rng.py).
        seed_parallel_rng(self.dp_rank, self.pp_rank, self.tp_rank, self.root_device)
        module = self.lightning_module
        if self._prepared_module is not module:
            self._prepare(module)
            self._prepared_module = module
        elif self._grad_sync is None:  # the same module runs again after teardown released the synchronizer
            self._build_grad_sync()
        self.model = module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._check_optimizers()
            self._setup_selective_compression(trainer)
        self.setup_precision_plugin()
        # Lightning's clipping calls the precision plugin; route norm clipping to the 3D-aware version.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

    def _prepare(self, module: pl.LightningModule) -> None:
        dims = self.dims
        check_protocol(module, dims.pp, dims.tp)
        uses_pipeline = not missing_protocol_methods(module)
        if not uses_pipeline and self.num_microbatches > 1:
            raise TypeError(
                f"num_microbatches={self.num_microbatches} needs the `lightning_3d.Parallel3DModule` protocol, which"
                f" {type(module).__name__} does not implement; use accumulate_grad_batches for plain modules."
            )
        if not uses_pipeline:
            if self.gradient_accumulation_fusion:
                rank_zero_info("Compressed3DStrategy: gradient_accumulation_fusion applies to modules with the pipeline"
                               f" protocol (the recipes); {type(module).__name__}'s gradients accumulate as autograd's.")
            module.to(self.root_device)
            self.precision_plugin.convert_module(module)
            broadcast_parameters(module, self.dp_group, src=dist.get_global_rank(self.dp_group, 0))
            self._stage_params = {None: list(module.parameters())}
            self._build_grad_sync()
            self._warn_unused(tied=False)
            return
        check_tensor_parallel_shapes(module, dims.tp)
        self._check_tied_names(module)
        plan = plan_pipeline(module, dims.pp, self.pp_rank, self.virtual_stages, self.schedule, self.pipeline_layer_split)
        stages, initialised = build_stages(
            module, plan, self.tp_mesh, self.sequence_parallel, self.root_device, self.precision_plugin.convert_module
        )
        if dims.pp == 1:
            self._check_still_tied(module)
        if not initialised:
            broadcast_parameters(module, self.dp_group, src=dist.get_global_rank(self.dp_group, 0))
        self.channels.warmup()
        self._tied = self._tied_copies(module) if dims.pp > 1 else []
        self._fused_tied = bool(self._tied) and self.compression.fused_embedding_sync
        self._stage_params = {index: list(stage.parameters()) for index, stage in stages.items()}
        self._fuse_gradient_accumulation(stages)
        self._build_grad_sync()
        self._warn_unused(tied=bool(module.pipeline_tied_parameters()))
        self._runtime = PipelineRuntime(
            stages=stages,
            num_stages=plan.num_stages,
            pp_rank=self.pp_rank,
            pp_size=dims.pp,
            schedule=self.schedule,
            channels=self.channels,
            device=self.root_device,
            loss_fn=module.pipeline_loss,
            loss_terms_fn=module.pipeline_loss_terms,
            forward_context=self.precision_plugin.forward_context,
            loss_context=loss_parallel if dims.tp > 1 else contextlib.nullcontext,
            before_last_backward=self._grad_sync.arm,
            stats=self.comm_stats,
            dp_group=self.dp_group if dims.dp > 1 else None,
        )
        codec = self._build_codec()
        if codec is not None:
            self._runtime.codec = codec

    def _build_grad_sync(self) -> None:
        """(Re)create the data-parallel gradient synchronizer of this rank's stages (it registers gradient hooks)."""
        # SC's default depends on the link; measured here, after every configuration check, before the buckets exist.
        self._measure_data_parallel_link()
        self._grad_sync = GradientSynchronizer(
            self._stage_params, self.dp_group, self.dims.dp, self.bucket_size_mb,
            exclude={id(p) for p in self._tied} if self._fused_tied else set(),
            compressed_stages=set(self._stage_params) if self._compresses_dp() else set(), stats=self.comm_stats,
            fused=self._fused_weights,
        )
        if self._sc is not None:
            self._grad_sync.attach_compressor(self._sc)
        if self._runtime is not None:
            self._runtime.before_last_backward = self._grad_sync.arm

    def _fuse_gradient_accumulation(self, stages: dict[int, torch.nn.Module]) -> None:
        if not self.gradient_accumulation_fusion:
            return
        if self.dims.tp > 1:
            rank_zero_info("Compressed3DStrategy: gradient_accumulation_fusion does not apply with tensor_parallel_size > 1"
                           " (the weights are DTensors); their gradients accumulate as autograd's.")
            return
        linears = [m for stage in stages.values() for m in fusable_linears(stage, exclude={id(p) for p in self._tied})]
        self._fused_weights = fuse_gradient_accumulation(linears)
        rank_zero_info(f"Compressed3DStrategy: gradient_accumulation_fusion on {len(linears)} nn.Linear weights of this"
                       " rank's stages.")

    @property
    def pipeline_runtime(self) -> PipelineRuntime | None:
        """This rank's pipeline executor (None for plain data parallelism); callbacks attach observers to it."""
        return self._runtime

    def _tied_copies(self, module: pl.LightningModule) -> list[torch.nn.Parameter]:
        # The names were checked against the whole model before pruning (_check_tied_names): each one is here.
        named = dict(module.named_parameters(remove_duplicate=False))
        tied = []
        for first_name, last_name in module.pipeline_tied_parameters().items():
            name = first_name if self.pp_rank == 0 else last_name if self.pp_rank == self.dims.pp - 1 else None
            if name is not None:
                tied.append(named[name])
        return tied

    @staticmethod
    def _check_tied_names(module: pl.LightningModule) -> None:
        """Every name of ``pipeline_tied_parameters`` is a parameter of the whole model (still unpruned, identical on
        every rank, so every rank raises alike): a name missing on one stage would leave its partner alone in the
        tied-gradient all-reduce, a hang."""
        tied = module.pipeline_tied_parameters()
        names = {name for name, _ in module.named_parameters(remove_duplicate=False)}
        bad = [(role, name) for first, last in tied.items()
               for role, name in (("first-stage name", first), ("last-stage name", last)) if name not in names]
        if bad:
            leaves = {name.rsplit(".", 1)[-1] for _, name in bad}
            similar = sorted(n for n in names if n.rsplit(".", 1)[-1] in leaves)[:6]
            raise ValueError(
                f"{type(module).__name__}.pipeline_tied_parameters() = {tied} names no parameter of the model: "
                + ", ".join(f"{role} {name!r}" for role, name in bad)
                + ". Use the names module.named_parameters() gives" + (f" (similar: {similar})." if similar else ".")
            )

    @staticmethod
    def _check_still_tied(module: pl.LightningModule) -> None:
        """With one stage, tied weights must stay one Parameter: a ``parallelize_stage`` that shards the two uses
        apart would train two weights where the model declares one, silently."""
        named = dict(module.named_parameters(remove_duplicate=False))
        untied = [(first, last) for first, last in module.pipeline_tied_parameters().items() if named[first] is not named[last]]
        if untied:
            raise ValueError(
                f"{type(module).__name__}.pipeline_tied_parameters() declares {untied} tied, but after"
                " parallelize_stage they are different Parameters: tensor parallelism untied them, and they would train"
                " as two weights. Make parallelize_stage keep one Parameter for both uses (shard the module that owns it"
                " and assign the same Parameter to the other), or stop declaring them tied."
            )

    def model_to_device(self) -> None:
        self.lightning_module.to(self.root_device)

    # ----- collectives Lightning asks for -----------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if not distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Mean over all ranks equals the mean over replicas: pipeline and tensor ranks hold equal values."""
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ----- teardown ----------------------------------------------------------------------------------------------
    def teardown(self) -> None:
        # The synchronizer's gradient hooks are held by autograd's C++ state, out of the garbage collector's sight:
        # parameter -> hook -> synchronizer -> parameter would be a cycle never freed, keeping every trained model's
        # parameters, gradients and compression state alive for the life of the process. The next setup rebuilds it.
        if self._grad_sync is not None:
            self._grad_sync.remove_hooks()
            self._grad_sync = None
        self._stashed_grads = None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    def _release_model(self) -> None:
        """Forget the prepared module: undo what ``_prepare`` did to it and drop the state built for it, so that the
        next module is prepared as by a fresh strategy. Its groups are destroyed by the caller. Idempotent.

        A destroyed gloo group keeps its sockets and threads until its last Python reference goes, so every reference
        this strategy and the module's ``device_mesh`` hold is dropped here (the synchronizer, the SC state, the
        runtime and its codec hold groups too); tensor-parallel parameters of a module the user keeps still hold theirs.
        """
        module = self._prepared_module
        if module is not None and module.device_mesh is getattr(self, "device_mesh", None):
            set_device_mesh(module, None)
        self.device_mesh = self.tp_mesh = self.channels = None
        self.dp_group = self.model_parallel_group = self.tied_group = self.fused_tied_group = None
        if self._grad_sync is not None:
            self._grad_sync.remove_hooks()
            self._grad_sync = None
        unfuse_gradient_accumulation(self._fused_weights)
        self._fused_weights = []
        self._prepared_module = None
        self._runtime = None
        self._sc = None
        self._stage_params = {}
        self._tied = []
        self._fused_tied = False
        self._stashed_grads = None
        self._sync_blocked = False

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Data x pipeline x tensor parallelism with compressed communication"
        )
