"""Compressed3DStrategy: data x pipeline x tensor parallel training inside Lightning's own loop."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer

from lightning_3d.compression.backprop import CompressedBackprop, CompressedBackpropConfig
from lightning_3d.compression.config import CompressionConfig
from lightning_3d.compression.link import allreduce_bus_gbps
from lightning_3d.compression.selective import DataParallelPowerSGD
from lightning_3d.compression.stats import CommunicationStats
from lightning_3d.pipeline.microbatch import split_batch
from lightning_3d.pipeline.p2p import PipelineChannels
from lightning_3d.pipeline.runtime import PipelineRuntime
from lightning_3d.strategies import checkpoint as ckpt
from lightning_3d.strategies.grad_sync import GradientSynchronizer, clip_grad_norm_, sync_tied_gradients
from lightning_3d.strategies.parallel_dims import SCHEDULES, ParallelDims, new_subgroups, resolve_sizes
from lightning_3d.strategies.protocol import missing_protocol_methods
from lightning_3d.strategies.stage_builder import (
    broadcast_parameters,
    build_stages,
    check_protocol,
    check_tensor_parallel_shapes,
    plan_pipeline,
)
from lightning_3d.strategies.wgrad_fusion import fusable_linears, fuse_gradient_accumulation

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


class Compressed3DStrategy(ParallelStrategy):
    """Train with data, pipeline and tensor parallelism at once; ``Compressed3DStrategy()`` is plain data parallel.

    Args:
        data_parallel_size: replicas; ``"auto"`` takes what pipeline and tensor parallelism leave of the world.
        pipeline_parallel_size: pipeline ranks; the model is cut into ``pp * virtual_stages`` stages.
        tensor_parallel_size: Megatron-style sharding of every layer (DTensor), innermost in the mesh.
        num_microbatches: micro-batches each per-replica batch is split into (a ``MicroBatches`` batch
            overrides it for one step).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        virtual_stages: stages per pipeline rank for the interleaved schedule (at least 2 there, else 1).
        sequence_parallel: shard the residual stream over the sequence between tensor-parallel regions.
        pipeline_layer_split: layers per stage, overriding the even split.
        bucket_size_mb: size of the data-parallel all-reduce buckets of uncompressed stages (a stage under SC is
            synchronised as one bucket: its cost is per matrix shape, not per byte).
        gradient_accumulation_fusion: accumulate the weight gradients of ``nn.Linear`` layers inside the backward's
            GEMM, in fp32 buffers that double as the all-reduce buckets (Megatron-LM's option of the same name), for
            modules that implement the pipeline protocol (the recipes), with tensor_parallel_size=1; it applies to
            plain fp32 weights used once per forward and not tied to another module (see ``wgrad_fusion``).
    """

    strategy_name = "compressed_3d"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        num_microbatches: int = 1,
        schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b",
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
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        if schedule not in SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")
        for name, value in (("num_microbatches", num_microbatches), ("pipeline_parallel_size", pipeline_parallel_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}={value!r}` must be a positive integer.")
        if virtual_stages is None:
            virtual_stages = 2 if schedule == "interleaved_1f1b" else 1
        if schedule == "interleaved_1f1b":
            if pipeline_parallel_size < 2 or virtual_stages < 2:
                raise ValueError(
                    f"The interleaved schedule needs pipeline_parallel_size >= 2 and virtual_stages >= 2 (got"
                    f" {pipeline_parallel_size} and {virtual_stages}); use schedule='1f1b' otherwise."
                )
            if num_microbatches % pipeline_parallel_size != 0:
                raise ValueError(
                    f"The interleaved schedule needs num_microbatches ({num_microbatches}) to be a multiple of"
                    f" pipeline_parallel_size ({pipeline_parallel_size})."
                )
        elif virtual_stages != 1:
            raise ValueError(f"virtual_stages={virtual_stages} only applies to schedule='interleaved_1f1b'.")
        if schedule == "1f1b" and num_microbatches < pipeline_parallel_size:
            raise ValueError(
                f"The 1F1B schedule with num_microbatches={num_microbatches} < pipeline_parallel_size="
                f"{pipeline_parallel_size} leaves stages idle most of the step; use at least"
                f" {pipeline_parallel_size} micro-batches (or schedule='gpipe')."
            )
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
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

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
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self.dims = ParallelDims(dp, pp, tp, world_size)
        self.device_mesh = self.dims.build_mesh(self.root_device.type)
        self.dp_rank, self.pp_rank, self.tp_rank = self.dims.coordinates(self.global_rank)
        self._create_groups()
        self.lightning_module._device_mesh = self.device_mesh

    def set_world_ranks(self) -> None:
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _create_groups(self) -> None:
        d, rank = self.dims, self.global_rank
        self.dp_group = self.device_mesh.get_group("dp")
        self.tp_mesh = self.device_mesh["tp"]
        # All pipeline and tensor ranks of one replica: the group a global gradient norm is summed over.
        self.model_parallel_group = new_subgroups(
            [[d.rank_of(dp, p, t) for p in range(d.pp) for t in range(d.tp)] for dp in range(d.dp)], rank
        )
        # First and last pipeline rank of each (dp, tp) pipeline: where tied embedding gradients meet.
        tied_pairs = [[d.rank_of(dp, 0, t), d.rank_of(dp, d.pp - 1, t)] for dp in range(d.dp) for t in range(d.tp)]
        self.tied_group = new_subgroups(tied_pairs, rank) if d.pp > 1 else None
        # Fused embedding sync: first and last stage of every replica, one group per tensor-parallel rank
        # (a group spanning tensor ranks would add up different vocabulary shards).
        fused = [[d.rank_of(dp, p, t) for dp in range(d.dp) for p in (0, d.pp - 1)] for t in range(d.tp)]
        self.fused_tied_group = new_subgroups(fused, rank) if d.pp > 1 else None
        pipelines = [d.pipeline_ranks(dp, t) for dp in range(d.dp) for t in range(d.tp)]
        self.channels = PipelineChannels(pipelines, rank, self.virtual_stages, self.root_device)

    # ----- model setup ----------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._prepared_module is not module:
            self._prepare(module)
            self._prepared_module = module
        elif self._grad_sync is None:  # the same module runs again after teardown released the synchronizer
            self._build_grad_sync()
        self.model = module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._check_optimizers_for_compression()
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
        plan = plan_pipeline(module, dims.pp, self.pp_rank, self.virtual_stages, self.schedule, self.pipeline_layer_split)
        stages, initialised = build_stages(
            module, plan, self.tp_mesh, self.sequence_parallel, self.root_device, self.precision_plugin.convert_module
        )
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
        )
        if self.compression.enabled and self.compression.compressed_backprop and dims.pp > 1:
            cfg = self.compression
            self._runtime.codec = CompressedBackprop(
                CompressedBackpropConfig(cfg.cb_rank, cfg.cb_epilogue_only, cfg.cb_min_compression_ratio,
                                         cfg.cb_lazy_error_propagation, cfg.seed),
                tp_group=self.tp_mesh.get_group() if dims.tp > 1 else None,
                split_over_tp=dims.tp > 1 and not self.sequence_parallel,
            )

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

    def _warn_unused(self, tied: bool) -> None:
        notes = self.compression.unused_options(self.dims.dp, self.dims.pp, tied)
        if notes and not self._warned_unused:
            rank_zero_warn("Compressed3DStrategy: " + "; ".join(notes) + ".")
        self._warned_unused = True

    @property
    def pipeline_runtime(self) -> PipelineRuntime | None:
        """This rank's pipeline executor (None for plain data parallelism); callbacks attach observers to it."""
        return self._runtime

    @property
    def compressed_backprop(self) -> CompressedBackprop | None:
        """The activation-gradient codec (CB + LEP) of this rank, if compressed backpropagation is active."""
        codec = self._runtime.codec if self._runtime is not None else None
        return codec if isinstance(codec, CompressedBackprop) else None

    @property
    def selective_compression(self) -> DataParallelPowerSGD | None:
        """The PowerSGD state of this rank's data-parallel gradients (SC), if it compresses them."""
        return self._sc

    def communication_stats(self, which: Literal["total", "last_step"] = "total") -> dict[str, dict[str, int]]:
        """Bytes this rank put on the wire per kind, before and after compression (see ``compression.stats``)."""
        return self.comm_stats.as_dict(which)

    @property
    def data_parallel_link_gbps(self) -> float | None:
        """Bus bandwidth (GB/s) of the data-parallel all-reduce measured at setup, the slowest replica group's, which
        turned SC on or off by default (``sc_max_link_gbps``); None where nothing was measured (dp = 1, compression
        off, or ``compressed_stages`` given)."""
        return self._dp_link_gbps

    @property
    def compresses_data_parallel_anywhere(self) -> bool:
        """Whether SC runs on some pipeline rank of this job (the same answer on every rank, once set up)."""
        cfg = self.compression
        return (cfg.enabled and self.dims.dp > 1 and bool(cfg.stages_to_compress(self.dims.pp))
                and cfg.compresses_on_link(self._dp_link_gbps))

    def _compresses_dp(self) -> bool:
        return self.compresses_data_parallel_anywhere and self.pp_rank in self.compression.stages_to_compress(self.dims.pp)

    def _measure_data_parallel_link(self) -> None:
        """Time one all-reduce on every data-parallel group at once, once; the slowest decides for every rank, so all
        replicas agree. Only where the answer matters: SC's default stages with dp > 1."""
        cfg = self.compression
        if self._dp_link_gbps is not None or not cfg.enabled or self.dims.dp == 1 or cfg.compressed_stages is not None:
            return
        measured = torch.tensor([allreduce_bus_gbps(self.dp_group, self.root_device)], device=self.root_device)
        dist.all_reduce(measured, op=dist.ReduceOp.MIN)
        self._dp_link_gbps = float(measured)
        verdict = ("on: slower than" if cfg.compresses_on_link(self._dp_link_gbps) else
                   "off: PowerSGD's compute would cost more than it saves at or above")
        rank_zero_info(
            f"Compressed3DStrategy: the data-parallel all-reduce runs at {self._dp_link_gbps:.1f} GB/s (bus bandwidth);"
            f" selective stage compression is {verdict} sc_max_link_gbps={cfg.sc_max_link_gbps:g}. Pass"
            f" compressed_stages=[...] to choose the compressed stages yourself."
        )

    def _setup_selective_compression(self, trainer: pl.Trainer) -> None:
        if not self._compresses_dp() or self._sc is not None:
            return
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self._sc = DataParallelPowerSGD(
            self.dp_group, self.compression.sc_rank, self.compression.warmup_steps(int(total)),
            self.compression.sc_min_compression_ratio, self.compression.seed, self.comm_stats,
            self.compression.sc_matmul_precision,
        )
        self._grad_sync.attach_compressor(self._sc)

    def _check_optimizers_for_compression(self) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        sharded = [o for o in self.optimizers if isinstance(getattr(o, "_optimizer", o), ZeroRedundancyOptimizer)]
        if sharded and self._compresses_dp():
            raise TypeError(
                "Selective stage compression averages full gradients with PowerSGD, which a sharded optimizer"
                " (ZeroRedundancyOptimizer) cannot consume. Use a regular optimizer, or pass compression=False"
                " (or compressed_stages=[] to keep compressed backpropagation only)."
            )

    def _tied_copies(self, module: pl.LightningModule) -> list[torch.nn.Parameter]:
        named = dict(module.named_parameters())
        tied = []
        for first_name, last_name in module.pipeline_tied_parameters().items():
            name = first_name if self.pp_rank == 0 else last_name if self.pp_rank == self.dims.pp - 1 else None
            if name is not None and name in named:
                tied.append(named[name])
        return tied

    def model_to_device(self) -> None:
        self.lightning_module.to(self.root_device)

    # ----- steps ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        self._sync_blocked = True
        try:
            yield
        finally:
            self._sync_blocked = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is None:
            self._log_communication()
            return super().training_step(*args, **kwargs)
        batch, batch_idx = args[0], args[1]
        module = self.lightning_module
        self._log_communication()
        if batch_idx % self.lightning_module.trainer.accumulate_grad_batches == 0:
            module.zero_grad(set_to_none=True)  # what Lightning's zero_grad would do, before our backward runs
        microbatches = split_batch(batch, self.num_microbatches)
        self._grad_sync.begin(sync=not self._sync_blocked)
        loss = self._runtime.train_step(microbatches, loss_scale=1.0 / module.trainer.accumulate_grad_batches)
        self._grad_sync.finish()
        if not self._sync_blocked:
            if self._fused_tied:
                sync_tied_gradients(self._tied, self.fused_tied_group, divide_by=self.dims.dp, stats=self.comm_stats)
            else:
                sync_tied_gradients(self._tied, self.tied_group, stats=self.comm_stats)
        # Lightning zeroes gradients between training_step and backward; keep ours out of its reach.
        self._stashed_grads = [(p, p.grad) for p in module.parameters()]
        for p in module.parameters():
            p.grad = None
        return self._report_loss(loss, "train")

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.comm_stats.end_step()  # "last_step" = everything one optimizer step (all its batches) sent
        return output

    def _log_communication(self) -> None:
        """Log the byte counters of the previous optimizer step (host-side numbers, no synchronisation)."""
        last = self.comm_stats.as_dict("last_step")
        before = sum(v["bytes_before"] for v in last.values())
        after = sum(v["bytes_after"] for v in last.values())
        if before:
            self.lightning_module.log_dict(
                {"comm/bytes_sent": float(after), "comm/compression_ratio": before / max(after, 1)},
                on_step=True, on_epoch=False, sync_dist=False,
            )

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._runtime is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self._stashed_grads or []:  # the pipeline already ran the backward in training_step
            p.grad = grad
        self._stashed_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    def pre_backward(self, closure_loss: Tensor) -> None:
        self._grad_sync.begin(sync=not self._sync_blocked)
        self._grad_sync.arm(None)

    def post_backward(self, closure_loss: Tensor) -> None:
        self._grad_sync.finish()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("val", args, kwargs) if self._runtime else super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test", args, kwargs) if self._runtime else super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is not None and self.dims.pp > 1:
            raise RuntimeError(
                "trainer.predict is not available with pipeline_parallel_size > 1 (outputs live on the last stage"
                " only); predict with pipeline_parallel_size=1."
            )
        return super().predict_step(*args, **kwargs)

    def _eval_step(self, stage: str, args: tuple, kwargs: dict) -> Tensor:
        loss = self._runtime.eval_step(split_batch(args[0], self.num_microbatches, uneven=True))
        return self._report_loss(loss, stage)

    def _report_loss(self, loss: Tensor | None, stage: str) -> Tensor:
        """Average the last stage's loss over replicas and give it to every rank, then log it."""
        contributes = loss is not None and self.tp_rank == 0
        value = loss.detach().float() / self.dims.dp if contributes else torch.zeros((), device=self.root_device)
        dist.all_reduce(value)
        module = self.lightning_module
        if callable(getattr(module, "log_pipeline_loss", None)):
            module.log_pipeline_loss(value, stage)
        else:
            module.log(f"{stage}_loss", value, prog_bar=True, sync_dist=False)
        return value

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        skip = {id(p) for p in self._tied} if self.pp_rank == self.dims.pp - 1 else set()
        clip_grad_norm_(params, clip_val, self.model_parallel_group, self.tp_rank, self.root_device, skip)

    # ----- collectives Lightning asks for -----------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Mean over all ranks equals the mean over replicas: pipeline and tensor ranks hold equal values."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ----- checkpoints -----------------------------------------------------------------------------------------
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
        path = Path(self.broadcast(str(filepath)))
        ckpt.save(checkpoint, path, {}, self.global_rank)
        ckpt.save_rank_state(path, self.global_rank, self._layout_key(), self.rank_state_dict())

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        module = self.lightning_module
        padded = module.padded_parameters() if callable(getattr(module, "padded_parameters", None)) else []
        tied = module.pipeline_tied_parameters() if callable(getattr(module, "pipeline_tied_parameters", None)) else {}
        aliases = {**{last: first for first, last in tied.items()}, **tied}
        meta = ckpt.load(path, module, optimizers, {}, strict=module.strict_loading, padded=padded, aliases=aliases)
        states = ckpt.load_rank_state(path, self.global_rank, self._layout_key(), self.root_device)
        if states is not None:
            self.load_rank_state_dict(states)
        elif self.rank_state_dict():
            rank_zero_warn(
                f"{path} holds no compression state for this layout {self._layout_key()}; error-feedback buffers"
                " and warm-start factors start afresh."
            )
        return meta

    def _layout_key(self) -> tuple:
        return (self.dims.dp, self.dims.pp, self.dims.tp, self.virtual_stages, self.schedule)

    def rank_states(self) -> dict[str, Any]:
        """This rank's stateful compression objects (``state_dict``/``load_state_dict``), by name."""
        states = {"communication": self.comm_stats}
        if self.compressed_backprop is not None:
            states["compressed_backprop"] = self.compressed_backprop
        if self._sc is not None:
            states["selective_compression"] = self._sc
        return states

    def rank_state_dict(self) -> dict[str, Any]:
        """The compression state of this rank (LEP errors, warm-start factors, PowerSGD memories, counters)."""
        states = self.rank_states()
        if len(states) == 1:  # counters only: nothing that changes training
            return {}
        return {name: obj.state_dict() for name, obj in states.items()}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        states = self.rank_states()
        if "selective_compression" in state and "selective_compression" not in states:
            link = self._dp_link_gbps
            why = (f"its data-parallel link measured {link:.1f} GB/s, at or above sc_max_link_gbps" if link is not None
                   else "compression is off or compressed_stages leaves this stage out")
            rank_zero_warn(
                "Compressed3DStrategy: the checkpoint holds selective-compression state (PowerSGD error feedback) but"
                f" this run does not compress data-parallel gradients on this rank ({why}); that state is dropped."
                " Pass compressed_stages=[...] to keep compressing."
            )
        for name, obj in states.items():
            if name in state:
                obj.load_state_dict(state[name])

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            ckpt.remove(Path(filepath))

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

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Data x pipeline x tensor parallelism with compressed communication"
        )
