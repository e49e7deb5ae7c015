"""Compressed3DStrategy: data x pipeline x tensor parallel training inside Lightning's own loop.

One Lightning ``ParallelStrategy`` that validates its options, prepares the model and keeps Lightning's hook
methods, delegating the work to components with declared interfaces, one file each: ``ProcessGroups`` (the mesh,
extra groups, pipeline channels and their lifetime), ``PipelineEngine`` (what each step hook does),
``CompressionState`` (CB/SC/FE decisions and state) and ``ShardedCheckpointIO`` (checkpoint directories). See
docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator, Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from lightning_3d.compression.backprop import CompressedBackprop
from lightning_3d.compression.config import CompressionConfig
from lightning_3d.compression.selective import DataParallelPowerSGD
from lightning_3d.context import context_parallel_config
from lightning_3d.pipeline.microbatch import MicroBatches
from lightning_3d.pipeline.runtime import PipelineRuntime
from lightning_3d.strategies import checkpoint as ckpt
from lightning_3d.strategies.comm_metrics import log_job_communication
from lightning_3d.strategies.cb_link import restore_cb_record
from lightning_3d.strategies.compression_state import CompressionState
from lightning_3d.strategies.fit_check import check_fit, check_memory_option, read_workload
from lightning_3d.strategies.gc_control import GarbageCollection
from lightning_3d.strategies.notebook import interactive_launcher, is_interactive
from lightning_3d.strategies.options import resolve_options
from lightning_3d.strategies.parallel_dims import ParallelDims, resolve_sizes
from lightning_3d.strategies.pipeline_engine import PipelineEngine, check_optimizers
from lightning_3d.strategies.process_groups import (
    ProcessGroups, claim_live_groups, destroy_all_groups, destroy_live_groups, live_groups_of, register_exit_hook,
)
from lightning_3d.strategies.rng import seed_parallel_rng
from lightning_3d.strategies.sharded_io import ShardedCheckpointIO
from lightning_3d.utils.comm_stats import CommunicationStats
from lightning_3d.utils.compat import (
    SubprocessScriptLauncher, default_process_group_backend, distributed_is_initialized, init_dist_connection,
    set_device_mesh, sync_ddp_if_available,
)

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


class Compressed3DStrategy(ParallelStrategy):
    """Train with data, pipeline and tensor parallelism at once; ``Compressed3DStrategy()`` is plain data parallel.

    Args:
        data_parallel_size: replicas; ``"auto"`` takes what pipeline and tensor parallelism leave of the world.
        pipeline_parallel_size: pipeline ranks; the model is cut into ``pp * virtual_stages`` stages.
        tensor_parallel_size: Megatron-style sharding of every layer (DTensor), innermost in the mesh.
        num_microbatches: micro-batches each per-replica batch is split into (a ``MicroBatches`` batch
            overrides it for one step). ``None`` (the default) derives it: 1 with pipeline_parallel_size=1, else
            pipeline_parallel_size, the smallest count every registered schedule accepts (1F1B needs at least pp,
            interleaved 1F1B a multiple of pp). The resolved value is the attribute ``num_microbatches``.
        schedule: a registered schedule name: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, or one added with
            ``lightning_3d.pipeline.register_schedule`` (docs/extending.md).
        virtual_stages: stages per pipeline rank for interleaved schedules (at least 2 there, default 2; else 1).
        sequence_parallel: shard the residual stream over the sequence between tensor-parallel regions.
        pipeline_layer_split: layers per stage, overriding the even split.
        stage_activation_checkpointing: one bool per pipeline stage (``pp * virtual_stages`` entries, in stage
            order): whether that stage recomputes its blocks' activations in the backward instead of keeping them.
            Handed to the model in each ``StageLayout``; ``None`` (the default) leaves the model's own setting.
        bucket_size_mb: size of the data-parallel all-reduce buckets of uncompressed stages (a stage under SC is
            synchronised as one bucket: its cost is per matrix shape, not per byte).
        gradient_accumulation_fusion: accumulate the weight gradients of ``nn.Linear`` layers inside the backward's
            GEMM, in fp32 buffers that double as the all-reduce buckets (Megatron-LM's option of the same name), for
            modules that implement the pipeline protocol (the recipes), with tensor_parallel_size=1; it applies to
            plain fp32 weights used once per forward and not tied to another module (see ``wgrad_fusion``).
            ``True``: every such layer; ``False``: none; ``"auto"`` (the default): only those whose weight has at
            least ``wgrad_fusion.FUSION_MIN_ELEMENTS`` (2**23) elements, below which the op's host time exceeds the
            memory traffic it saves (docs/speed.md).
        on_nonfinite: what a step whose loss or gradients hold NaN or inf does: ``"skip"`` (the default) leaves the
            parameters, the optimizer state and the compression state as they were, on every rank alike, and warns;
            ``"raise"`` stops training with an error on every rank; ``"ignore"`` applies the step (no check, no
            host synchronisation). A skipped step still counts as a step for ``global_step`` and LR schedulers.
            With torch's fused Adam/AdamW/momentum-free SGD and no GradScaler ("16-mixed" has one) the step is
            skipped on the device and the verdict reaches the host a step later: the warning and ``"raise"`` come
            from the next step (before its update), the end of fit or a checkpoint save, naming the bad step; the
            parameters are then still those from before it (docs/speed.md).
        max_consecutive_nonfinite: with ``"skip"``, one more non-finite step in a row than this raises (the run is
            diverging).
        timeout: of every process group the strategy creates (the default group, the device mesh, the pipeline
            channels, the tied-embedding and model-parallel groups): a rank that stops answering fails the others
            after this long.
        context_parallel_size: ranks sharing every sequence, each holding a slice of it (mesh ("dp", "pp", "cp",
            "tp"); a module with ``enable_context_parallel``, e.g. the GPT recipe). ``context_parallel_layout``:
            ``"zigzag"`` (balanced causal work) or ``"contiguous"``; ``context_parallel_attention``: ``"ring"`` or
            ``"ulysses"``. See docs/context_parallel.md.
        shard_optimizer_state: each data-parallel replica keeps and updates only its 1/dp of the optimizer state (and
            of the fp32 master weights under bf16-true): gradients are reduce-scattered instead of all-reduced and the
            parameters all-gathered after the step (ZeRO-1, Megatron-LM's distributed optimizer). For one element-wise
            torch optimizer (AdamW, Adam, SGD); does nothing with data_parallel_size=1. docs/sharded_optimizer.md.
        memory_check: before any collective of a fit, every rank estimates the peak memory per GPU of this layout for a
            model the memory model knows (the GPT and T5 recipes) and compares it with its card: ``"error"`` (the
            default) stops with the estimate per component and the changes that would fit when it exceeds the usable
            memory by more than the model's error margin (and warns below that); ``"warn"`` only warns; ``"off"``
            skips it. ``$LIGHTNING_3D_DEVICE_MEMORY_GIB`` replaces the card's memory (CPU runs have none).
            docs/context_parallel.md, "Will it fit?".
        gc_interval: Python's automatic garbage collection is off from ``setup`` to ``teardown`` (restored then, also
            when the run raises) and every rank runs a full collection before the first batch of every
            ``gc_interval``-th optimizer step, all at the same step (and before every ``gc_interval``-th batch of an
            evaluation loop), as Megatron-LM's ``--manual-gc``: an automatic collection pauses one rank at a random
            point and every collective waits for it. ``None`` leaves Python's collector alone. docs/speed.md,
            "Garbage collection".
        gc_freeze: after the first of those collections in a fit (and the first after each validation), move what
            survived it (compiled graphs, the model, the optimizer) to Python's permanent generation
            (``gc.freeze()``), so later full collections walk only what was allocated since; cyclic garbage still
            reachable at that moment is never collected. Undone at ``teardown``.
        cuda_graphs: capture each stage's training forward and backward as CUDA graphs on its first micro-batch and
            replay them for every later micro-batch of the same shapes (one launch instead of one per kernel: for
            steps the host's kernel launches slow down, e.g. T5 or small GPTs). Needs CUDA devices,
            pipeline_parallel_size=1, tensor_parallel_size=1, context_parallel_size=1 and fixed micro-batch shapes
            (a micro-batch of other shapes runs eagerly, with a warning); gradient_accumulation_fusion="auto" then
            fuses nothing. Results equal the eager step's up to kernel choice. docs/speed.md, "CUDA graphs".
        checkpoint_io: must stay None: checkpoints are sharded ``torch.distributed.checkpoint`` directories the
            strategy writes itself.
    """

    strategy_name = "compressed_3d"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        num_microbatches: int | None = None,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        sequence_parallel: bool = False,
        pipeline_layer_split: Sequence[int] | None = None,
        bucket_size_mb: float = 25.0,
        gradient_accumulation_fusion: bool | Literal["auto"] = "auto",
        compression: bool = True,
        compressed_backprop: bool | Literal["auto"] = "auto",
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
        stage_activation_checkpointing: Sequence[bool] | None = None,
        context_parallel_size: int = 1,
        context_parallel_layout: Literal["zigzag", "contiguous"] = "zigzag",
        context_parallel_attention: Literal["ring", "ulysses"] = "ring",
        shard_optimizer_state: bool = False,
        memory_check: Literal["error", "warn", "off"] = "error",
        gc_interval: int | None = 50,
        gc_freeze: bool = True,
        cuda_graphs: bool = False,
        cb_max_link_gbps: float = 100.0,
    ) -> None:
        # Every check here runs on every rank before any process group exists.
        options = resolve_options(
            pipeline_parallel_size=pipeline_parallel_size, tensor_parallel_size=tensor_parallel_size,
            num_microbatches=num_microbatches, schedule=schedule, virtual_stages=virtual_stages,
            sequence_parallel=sequence_parallel, pipeline_layer_split=pipeline_layer_split,
            stage_activation_checkpointing=stage_activation_checkpointing, bucket_size_mb=bucket_size_mb,
            gradient_accumulation_fusion=gradient_accumulation_fusion, on_nonfinite=on_nonfinite,
            max_consecutive_nonfinite=max_consecutive_nonfinite, checkpoint_io=checkpoint_io,
            context_parallel=context_parallel_config(context_parallel_size, context_parallel_layout, context_parallel_attention),
            shard_optimizer_state=shard_optimizer_state, cuda_graphs=cuda_graphs,
        )
        check_memory_option(memory_check)
        self.garbage_collection = GarbageCollection(gc_interval, gc_freeze)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.compression = CompressionConfig(
            compression, compressed_backprop, cb_rank, cb_epilogue_only, cb_min_compression_ratio, cb_lazy_error_propagation, sc_rank,
            sc_warmup, sc_min_compression_ratio, sc_matmul_precision, sc_max_link_gbps,
            list(compressed_stages) if compressed_stages is not None else None,
            fused_embedding_sync, compression_seed, cb_max_link_gbps,
        )
        self.compression.validate(pipeline_parallel_size)
        self.options = options
        self.num_microbatches, self.schedule, self.virtual_stages = options.num_microbatches, schedule, options.virtual_stages
        self.stage_activation_checkpointing = options.stage_activation_checkpointing
        self.sequence_parallel, self.on_nonfinite = sequence_parallel, on_nonfinite
        self.pipeline_layer_split = list(pipeline_layer_split) if pipeline_layer_split is not None else None
        self._sizes = (data_parallel_size, pipeline_parallel_size, tensor_parallel_size, context_parallel_size)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self.dims: ParallelDims | None = None
        self.cp_rank = 0
        # The components (module docstring): built once; `groups` per run, the engine bound to one module at a time.
        self.comm_stats = CommunicationStats()
        self.groups: ProcessGroups | None = None
        self.compression_state = CompressionState(self.compression, self.comm_stats, guard_nonfinite=on_nonfinite != "ignore")
        self.engine = PipelineEngine(options, self.compression_state, self.comm_stats)
        self.checkpoints = ShardedCheckpointIO(self.broadcast, self.compression_state)
        self._prepared_module = None
        self.memory_check = memory_check
        #: the fit check's estimate of this run (``fit_check.FitReport``), None where it was skipped
        self.memory_estimate = None

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

    @property
    def device_mesh(self):
        """The ("dp", "pp", "tp") device mesh of the current run (None before ``setup_environment``)."""
        return self.groups.device_mesh if self.groups is not None else None

    def _configure_launcher(self) -> None:
        if self.cluster_environment.creates_processes_externally:
            return
        if is_interactive():  # a notebook has no script to start again: no launcher, or fork (see notebook.py)
            self._launcher = interactive_launcher(self, release=destroy_all_groups)
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
        self._check_fit(precision, dp, pp, tp)
        backend = self._process_group_backend or default_process_group_backend(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        init_dist_connection(self.cluster_environment, backend, **kwargs)
        register_exit_hook()
        if live_groups_of(self) is not None and self._prepared_module is self.lightning_module:
            # The module this strategy prepared runs again (validate or test after fit, fit on with the same trainer):
            # its stages, channels and tensor-parallel parameters are bound to the groups it was prepared on.
            set_device_mesh(self.lightning_module, self.device_mesh)
            return
        # A new module: whatever the last run left (its model state, its groups, on this or another strategy) goes
        # first, and the groups are created afresh, each with this strategy's timeout. The counters and the link
        # measurement start over too, as on a fresh strategy (they stay readable after fit until then).
        destroy_live_groups()
        self._release_model()
        self.comm_stats = self.engine.stats = CommunicationStats()
        self.compression_state.start_over(self.comm_stats)
        self.dims = ParallelDims(dp, pp, tp, world_size, cp=self._sizes[3])
        self.groups = claim_live_groups(self._release_model, self.dims, self.global_rank, self.root_device,
                                        self.virtual_stages, self._timeout)
        self.dp_rank, self.pp_rank, self.tp_rank = self.groups.dp_rank, self.groups.pp_rank, self.groups.tp_rank
        self.cp_rank = self.groups.cp_rank
        set_device_mesh(self.lightning_module, self.device_mesh)

    def _check_fit(self, precision: str, dp: int, pp: int, tp: int) -> None:
        """The fit check (fit_check.py), on every rank before the first collective."""
        self.memory_estimate = None
        module = self.lightning_module
        try:
            trainer = module.trainer
        except RuntimeError:  # a module not attached to a Trainer
            return
        if trainer.state.fn != TrainerFn.FITTING:  # the estimate is training's (gradients, optimizer state)
            return
        datamodule = trainer.datamodule  # None when the loaders were passed directly
        self.memory_estimate = check_fit(
            self.memory_check, lambda: read_workload(module, datamodule, dp=dp, pp=pp, tp=tp, cp=self._sizes[3],
                                                     precision=precision, options=self.options),
            self.root_device, rank_zero_warn)

    def set_world_ranks(self) -> None:
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ----- model setup ----------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.PREDICTING and self.dims.pp > 1:
            # Here, on every rank, before the predict loop builds its data loaders (a recipe's loader fails first
            # otherwise, with an error about samplers) and before any collective.
            raise RuntimeError(
                f"trainer.predict is not available with pipeline_parallel_size={self.dims.pp} (outputs live on the last"
                " stage only); predict with pipeline_parallel_size=1 (a checkpoint loads into any layout)."
            )
        if trainer.state.fn == TrainerFn.PREDICTING and self.dims.cp > 1:
            raise RuntimeError(f"trainer.predict is not available with context_parallel_size={self.dims.cp} (it runs the"
                               " module's own forward on whole sequences); predict with context_parallel_size=1.")
        self.accelerator.setup(trainer)
        # Dropout's streams: one per (dp, pp) rank, the same on its tp ranks, plus each tp rank's own (see rng.py).
        # Context-parallel ranks hold different tokens: their own streams (dp_rank * cp + cp_rank is dp_rank at cp 1).
        seed_parallel_rng(self.dp_rank * self.dims.cp + self.cp_rank, self.pp_rank, self.tp_rank, self.root_device)
        module = self.lightning_module
        if self._prepared_module is not module:
            self.engine.prepare(module, self.groups, self.root_device, self.precision_plugin)
            self._prepared_module = module
        elif self.engine.grad_sync is None:  # the same module runs again after teardown released the synchronizer
            self.engine.build_grad_sync()
        self.model = module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers)
            self.engine.shard_optimizer_state(self.optimizers, module)
            self.engine.setup_selective_compression(trainer)
        self.setup_precision_plugin()
        self.garbage_collection.start(trainer.state.fn)  # stopped in teardown, which Lightning runs on errors too
        # Lightning's clipping calls the precision plugin; route norm clipping to the 3D-aware version.
        self.precision_plugin.clip_grad_by_norm = self.engine.clip_grad_by_norm

    def model_to_device(self) -> None:
        self.lightning_module.to(self.root_device)

    # ----- public accessors (what callbacks read) --------------------------------------------------------------
    @property
    def pipeline_runtime(self) -> PipelineRuntime | None:
        """This rank's pipeline executor (None for plain data parallelism); callbacks attach observers to it."""
        return self.engine.runtime

    @property
    def compressed_backprop(self) -> CompressedBackprop | None:
        """The activation-gradient codec (CB + LEP) of this rank, if compressed backpropagation is active."""
        codec = self.engine.runtime.codec if self.engine.runtime is not None else None
        return codec if isinstance(codec, CompressedBackprop) else None

    @property
    def selective_compression(self) -> DataParallelPowerSGD | None:
        """The PowerSGD state of this rank's data-parallel gradients (SC), if it compresses them."""
        return self.compression_state.sc

    def communication_stats(self, which: Literal["total", "last_step"] = "total") -> dict[str, dict[str, int]]:
        """Bytes this rank put on the wire per kind, before and after compression (see ``lightning_3d.utils.comm_stats``)."""
        return self.comm_stats.as_dict(which)

    @property
    def data_parallel_link_gbps(self) -> float | None:
        """Bus bandwidth (GB/s) of the data-parallel all-reduce measured at setup, the slowest replica group's, which
        turned SC on or off by default (``sc_max_link_gbps``); None where nothing was measured (dp = 1, compression
        off, or ``compressed_stages`` given)."""
        return self.compression_state.link_gbps

    @property
    def compresses_data_parallel_anywhere(self) -> bool:
        """Whether SC runs on some pipeline rank of this job (the same answer on every rank, once set up)."""
        return self.compression_state.compresses_anywhere(self.dims)

    # ----- step hooks: delegated to the engine (plain modules fall through to Lightning's own) -------------------
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        self.engine.sync_blocked = True
        try:
            yield
        finally:
            self.engine.sync_blocked = False

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Lightning's transfer rebuilds a ``MicroBatches`` list from its items; keep its explicit ``orders``."""
        moved = super().batch_to_device(batch, device, dataloader_idx)
        if isinstance(batch, MicroBatches) and isinstance(moved, MicroBatches):
            moved.orders = batch.orders
        return moved

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.garbage_collection.before_train_batch(self.lightning_module.trainer.global_step)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        log_job_communication(self.lightning_module, self.comm_stats, self.groups, self.root_device, self.world_size)
        if self.engine.runtime is None:
            return super().training_step(*args, **kwargs)
        return self.engine.train_step(self.lightning_module, args[0], args[1])

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        scaled = getattr(self.precision_plugin, "scaler", None) is not None  # "16-mixed": GradScaler owns found_inf
        closure = functools.partial(self.engine.step_closure, optimizer, closure, self.lightning_module.trainer, scaled)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.engine.after_optimizer_step()
        self.comm_stats.end_step()  # "last_step" = everything one optimizer step (all its batches) sent
        return output

    def on_train_end(self) -> None:
        """A lazy non-finite verdict of the last step is acted on here (a bad last step still warns or raises)."""
        super().on_train_end()
        self.engine.flush_verdict()

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self.engine.runtime is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.engine.hand_back_gradients()
        return self.precision_plugin.post_backward(closure_loss, module)

    def pre_backward(self, closure_loss: Tensor) -> None:
        self.engine.begin_backward()

    def post_backward(self, closure_loss: Tensor) -> None:
        self.engine.end_backward()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.garbage_collection.before_eval_batch()
        if self.engine.runtime is None:
            return super().validation_step(*args, **kwargs)
        return self.engine.eval_step(self.lightning_module, args[0], "val")

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self.garbage_collection.before_eval_batch()
        if self.engine.runtime is None:
            return super().test_step(*args, **kwargs)
        return self.engine.eval_step(self.lightning_module, args[0], "test")

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self.garbage_collection.before_eval_batch()
        if self.engine.runtime is not None and self.dims.pp > 1:
            raise RuntimeError(
                "trainer.predict is not available with pipeline_parallel_size > 1 (outputs live on the last stage"
                " only); predict with pipeline_parallel_size=1."
            )
        return super().predict_step(*args, **kwargs)

    # ----- checkpoints: delegated to ShardedCheckpointIO and CompressionState -------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return ckpt.model_state(self.lightning_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return ckpt.optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("Compressed3DStrategy writes sharded checkpoints itself and takes no storage_options.")
        # A pending lazy verdict first: with on_nonfinite="raise" no checkpoint is written after a bad step, as with
        # the synchronous verdict (every rank saves and holds the same verdict, so all raise alike).
        self.engine.flush_verdict()
        self.checkpoints.save(checkpoint, filepath, self.global_rank, self._layout_key(), self.dims, self.compressed_backprop)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """``weights_only`` changes nothing: loading never unpickles code, whatever it says."""
        return self.checkpoints.load(checkpoint_path, self.lightning_module, self.optimizers, self.global_rank,
                                     self.is_global_zero, self._layout_key(), self.root_device,
                                     self.restore_compression_record, lambda: self.compressed_backprop)

    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoints.remove(filepath, self.is_global_zero)

    def _layout_key(self) -> tuple:
        key = (self.dims.dp, self.dims.pp, self.dims.tp, self.virtual_stages, self.schedule)
        return key + (self.dims.cp,) if self.dims.cp > 1 else key

    def compression_record(self) -> dict[str, Any]:
        """What decided SC in this run, as plain Python values for the checkpoint (``checkpoint["compressed_3d"]``)."""
        return self.compression_state.record(self.dims)

    def restore_compression_record(self, record: dict[str, Any] | None) -> None:
        """Resume with the link measurement the checkpointed run decided by, not this run's own (load happens after
        setup, so the gradient synchronizer and SC, or CB's codec, built from this run's measurement are rebuilt if it
        differs)."""
        if restore_cb_record(self.compression_state, self.dims, record):
            self.engine.install_codec()  # before the checkpoint's per-rank CB state is loaded into it
        if not self.compression_state.restore_record(self.dims, record):
            return
        self.engine.build_grad_sync()
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self.engine.setup_selective_compression(trainer)

    def rank_states(self) -> dict[str, Any]:
        """This rank's stateful compression objects (``state_dict``/``load_state_dict``), by name."""
        return self.compression_state.rank_states(self.compressed_backprop)

    def rank_state_dict(self) -> dict[str, Any]:
        """The compression state of this rank (LEP errors, warm-start factors, PowerSGD memories, counters)."""
        return self.compression_state.rank_state_dict(self.compressed_backprop)

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        self.compression_state.load_rank_state_dict(state, self.compressed_backprop)

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
        self.garbage_collection.stop()  # first: whatever fails below, the process gets its collector back
        self.engine.teardown()  # the synchronizer's hooks would keep this run's parameters alive (see the engine)
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
        if module is not None and self.groups is not None and module.device_mesh is self.groups.device_mesh:
            set_device_mesh(module, None)
        self.groups = None
        self.engine.release()
        self.compression_state.sc = None
        self._prepared_module = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Data x pipeline x tensor parallelism with compressed communication"
        )
