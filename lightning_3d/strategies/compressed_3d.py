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
from collections.abc import Generator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_3d.compression.config import CompressionConfig
from lightning_3d.distributed.parallel_dims import ParallelDims, resolve_sizes
from lightning_3d.distributed.process_groups import (
    ProcessGroups,
    claim_live_groups,
    destroy_all_groups,
    destroy_live_groups,
    live_groups_of,
    register_exit_hook,
)
from lightning_3d.distributed.rng import seed_parallel_rng
from lightning_3d.pipeline.microbatch import MicroBatches
from lightning_3d.strategies.accessors import StrategyAccessors
from lightning_3d.strategies.checkpoint_hooks import CheckpointHooks
from lightning_3d.strategies.comm_metrics import log_job_communication
from lightning_3d.strategies.compression_state import CompressionState
from lightning_3d.strategies.config import ParallelismConfig, PipelineConfig, RuntimeConfig, build_config, group_flat_options
from lightning_3d.strategies.fit_check import check_fit, read_workload
from lightning_3d.strategies.gc_control import GarbageCollection
from lightning_3d.strategies.notebook import interactive_launcher, is_interactive
from lightning_3d.strategies.optimizer_sharding import check_optimizers
from lightning_3d.strategies.options import options_from_configs
from lightning_3d.strategies.pipeline_engine import PipelineEngine
from lightning_3d.strategies.run_checks import check_run
from lightning_3d.strategies.run_output import quiet_lightning_notices, use_parallel_defaults
from lightning_3d.strategies.sharded_io import ShardedCheckpointIO
from lightning_3d.utils.comm_stats import CommunicationStats
from lightning_3d.utils.compat import (
    SubprocessScriptLauncher,
    after_gradient_hooks,
    default_process_group_backend,
    distributed_is_initialized,
    init_dist_connection,
    set_device_mesh,
    set_num_threads_if_needed,
    sync_ddp_if_available,
)
from lightning_3d.utils.orphans import exit_with_launcher, mark_launcher


class Compressed3DStrategy(StrategyAccessors, CheckpointHooks, ParallelStrategy):
    """Train with data, pipeline and tensor parallelism at once; ``Compressed3DStrategy()`` is plain data parallel.

    Args:
        parallelism: the mesh's sizes, context and sequence parallelism (``ParallelismConfig``).
        pipeline: micro-batches, schedule, stage split and per-stage activation checkpointing (``PipelineConfig``).
        compression: CB, SC and FE (``CompressionConfig``; ``CompressionConfig(enabled=False)`` trains exactly).
        runtime: gradient buckets and fusion, ZeRO-1, CUDA graphs, non-finite steps, process groups' timeout and
            backend, the memory check and garbage collection (``RuntimeConfig``).
        accelerator, parallel_devices, cluster_environment, precision_plugin: Lightning's, set by the Trainer.
        checkpoint_io: must stay None: checkpoints are sharded ``torch.distributed.checkpoint`` directories the
            strategy writes itself.
        **flat_options: the flat keywords of earlier releases (``pipeline_parallel_size=2``, ``cb_rank=8``, ...),
            each mapped to its config field with a ``FutureWarning`` (``strategies/config.py``, ``FLAT_OPTIONS``).

    Each config is a frozen dataclass whose fields are documented one by one (``help(ParallelismConfig)``,
    ``lightning-3d fit --trainer.strategy.help Compressed3DStrategy``); a dict of fields is accepted too. Every check
    runs on every rank before any process group exists.
    """

    strategy_name = "compressed_3d"

    def __init__(
        self,
        parallelism: ParallelismConfig = ParallelismConfig(),
        pipeline: PipelineConfig = PipelineConfig(),
        compression: CompressionConfig = CompressionConfig(),
        runtime: RuntimeConfig = RuntimeConfig(),
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        **flat_options: Any,
    ) -> None:
        # Every check here runs on every rank before any process group exists.
        if isinstance(compression, bool):  # the flat switch of earlier releases: compression.enabled
            flat_options = {"compression": compression, **flat_options}
            compression = CompressionConfig()
        flat = group_flat_options(flat_options)
        self.parallelism: ParallelismConfig = build_config("parallelism", parallelism, flat.get("parallelism"))
        self.pipeline: PipelineConfig = build_config("pipeline", pipeline, flat.get("pipeline"))
        self.compression: CompressionConfig = build_config("compression", compression, flat.get("compression"))
        self.runtime: RuntimeConfig = build_config("runtime", runtime, flat.get("runtime"))
        #: what the engine reads: the configs' fields with the derived values resolved (``options.PipelineOptions``)
        self.options = options_from_configs(self.parallelism, self.pipeline, self.runtime, checkpoint_io)
        self.compression.validate(self.parallelism.pipeline_parallel_size)
        self.garbage_collection = GarbageCollection(self.runtime.gc_interval, self.runtime.gc_freeze)
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.num_nodes = 1
        self.dims: ParallelDims | None = None
        self.cp_rank = 0
        # The components (module docstring): built once; `groups` per run, the engine bound to one module at a time.
        self.comm_stats = CommunicationStats()
        self.groups: ProcessGroups | None = None
        self.compression_state = CompressionState(self.compression, self.comm_stats,
                                                  guard_nonfinite=self.runtime.on_nonfinite != "ignore")
        self.engine = PipelineEngine(self.options, self.compression_state, self.comm_stats)
        self.checkpoints = ShardedCheckpointIO(self.broadcast, self.compression_state)
        self._prepared_module = None
        #: the fit check's estimate of this run (``fit_check.FitReport``), None where it was skipped
        self.memory_estimate = None

    # ----- environment --------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Only data-parallel replicas get distinct samples; pipeline and tensor ranks of a replica share them."""
        return {"num_replicas": self.dims.dp, "rank": self.dp_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    def device_mesh(self):
        """The ("dp", "pp", "tp") device mesh of the current run (None before ``setup_environment``)."""
        return self.groups.device_mesh if self.groups is not None else None

    @override
    def _configure_launcher(self) -> None:
        quiet_lightning_notices()  # the Trainer taking the strategy, before its logger notices (run_output.py)
        if self.cluster_environment.creates_processes_externally:
            return
        if is_interactive():  # a notebook has no script to start again: no launcher, or fork (see notebook.py)
            self._launcher = interactive_launcher(self, release=destroy_all_groups)
        else:
            mark_launcher()  # its children exit as soon as it dies (utils/orphans.py)
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # Everything that can be wrong with the configuration is checked before the first collective.
        exit_with_launcher()  # a rank Lightning's launcher started: end with it, not at the next collective's timeout
        # Each local rank takes its share of the cores (Lightning's rule). Lightning's launcher sets it only in the rank
        # that launches, after starting the others, and this strategy gives the started ranks no launcher: without this
        # they run torch's default, every core each, and the ranks' spinning intra-op threads oversubscribe the CPU
        # (README.md, Guarantees). One process keeps torch's own default, as it would without the strategy.
        if self.num_processes > 1:
            set_num_threads_if_needed(num_processes=self.num_processes)
        precision = getattr(self.precision_plugin, "precision", "32-true")
        check_run(self.lightning_module, precision, self.runtime.process_group_backend, self.root_device)
        world_size = self.num_nodes * self.num_processes
        par = self.parallelism
        dp, pp, tp = resolve_sizes(world_size, par.data_parallel_size, par.pipeline_parallel_size,
                                   par.tensor_parallel_size, par.context_parallel_size)
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._check_fit(precision, dp, pp, tp)
        backend = self.runtime.process_group_backend or default_process_group_backend(self.root_device)
        kwargs: dict[str, Any] = {"timeout": self.runtime.timeout}
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
        self.dims = ParallelDims(dp, pp, tp, world_size, cp=par.context_parallel_size)
        self.groups = claim_live_groups(self._release_model, self.dims, self.global_rank, self.root_device,
                                        self.virtual_stages, self.runtime.timeout)
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
            self.memory_check, lambda: read_workload(module, datamodule, dp=dp, pp=pp, tp=tp,
                                                     cp=self.parallelism.context_parallel_size,
                                                     precision=precision, options=self.options),
            self.root_device, rank_zero_warn)

    def set_world_ranks(self) -> None:
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ----- model setup ----------------------------------------------------------------------------------------
    @override
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
        use_parallel_defaults(trainer)  # whole-model summary, "Epoch N" bar in place of Lightning's (run_output.py)
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
        after_gradient_hooks(self.precision_plugin, self.engine.after_gradient_hooks)  # the non-finite guard's place
        self.compression_state.watch_gradient_hooks(trainer)

    @override
    def model_to_device(self) -> None:
        self.lightning_module.to(self.root_device)

    # ----- step hooks: delegated to the engine (plain modules fall through to Lightning's own) -------------------
    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        self.engine.sync_blocked = True
        try:
            yield
        finally:
            self.engine.sync_blocked = False

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Lightning's transfer rebuilds a ``MicroBatches`` list from its items; keep its explicit ``orders``."""
        moved = super().batch_to_device(batch, device, dataloader_idx)
        if isinstance(batch, MicroBatches) and isinstance(moved, MicroBatches):
            moved.orders = batch.orders
        return moved

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.garbage_collection.before_train_batch(self.lightning_module.trainer.global_step)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        log_job_communication(self.lightning_module, self.comm_stats, self.groups, self.root_device, self.world_size)
        if self.engine.runtime is None:
            return super().training_step(*args, **kwargs)
        return self.engine.train_step(self.lightning_module, args[0], args[1])

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        scaled = getattr(self.precision_plugin, "scaler", None) is not None  # "16-mixed": GradScaler owns found_inf
        closure = functools.partial(self.engine.step_closure, optimizer, closure, self.lightning_module.trainer, scaled)
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.engine.after_optimizer_step()
        self.comm_stats.end_step()  # "last_step" = everything one optimizer step (all its batches) sent
        return output

    @override
    def on_train_end(self) -> None:
        """A lazy non-finite verdict of the last step is acted on here (a bad last step still warns or raises)."""
        super().on_train_end()
        self.engine.flush_verdict()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self.engine.runtime is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.engine.hand_back_gradients()
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        self.engine.begin_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        self.engine.end_backward()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self.garbage_collection.before_eval_batch()
        if self.engine.runtime is None:
            return super().validation_step(*args, **kwargs)
        return self.engine.eval_step(self.lightning_module, args[0], "val")

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self.garbage_collection.before_eval_batch()
        if self.engine.runtime is None:
            return super().test_step(*args, **kwargs)
        return self.engine.eval_step(self.lightning_module, args[0], "test")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self.garbage_collection.before_eval_batch()
        if self.engine.runtime is not None and self.dims.pp > 1:
            raise RuntimeError(
                "trainer.predict is not available with pipeline_parallel_size > 1 (outputs live on the last stage"
                " only); predict with pipeline_parallel_size=1."
            )
        return super().predict_step(*args, **kwargs)

    # ----- collectives Lightning asks for -----------------------------------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        if not distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Mean over all ranks equals the mean over replicas: pipeline and tensor ranks hold equal values."""
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ----- teardown ----------------------------------------------------------------------------------------------
    @override
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
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Data x pipeline x tensor parallelism with compressed communication"
        )
