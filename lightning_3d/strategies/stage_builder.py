"""Turn a protocol LightningModule into this rank's pipeline stages: split, shard, materialise, initialise."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module

from lightning_3d.strategies.protocol import StageLayout, missing_protocol_methods, split_layers
from lightning_3d.utils.tensors import local, materialize_


@dataclass
class PipelinePlan:
    """Which layers every stage holds and which stages this pipeline rank runs."""

    layouts: list[StageLayout]
    local_stages: list[int]

    @property
    def num_stages(self) -> int:
        return len(self.layouts)


def check_protocol(module: nn.Module, pp: int, tp: int) -> None:
    missing = missing_protocol_methods(module)
    if missing and (pp > 1 or tp > 1):
        raise TypeError(
            f"{type(module).__name__} cannot be split for pipeline_parallel_size={pp},"
            f" tensor_parallel_size={tp}: it does not implement {', '.join(missing)}. Implement the"
            f" `lightning_3d.Parallel3DModule` protocol (see the GPT recipe and the README), or train it with"
            f" pipeline_parallel_size=1 and tensor_parallel_size=1 (pure data parallelism)."
        )


def plan_pipeline(
    module: nn.Module,
    pp: int,
    pp_rank: int,
    virtual_stages: int,
    schedule: str,
    layer_split: Sequence[int] | None,
    activation_checkpointing: Sequence[bool] | None = None,
) -> PipelinePlan:
    """Which layers each of the ``pp * virtual_stages`` stages holds (and its per-stage settings), and which stages
    this pipeline rank runs."""
    num_layers = module.num_pipeline_layers()
    num_stages = pp * virtual_stages
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} x virtual_stages={virtual_stages} = {num_stages} stages, but the model has"
            f" only {num_layers} layers: every stage needs at least one layer. Use fewer stages."
        )
    if virtual_stages > 1 and layer_split is None and num_layers % num_stages != 0:
        raise ValueError(
            f"The interleaved schedule splits the {num_layers} layers into pipeline_parallel_size x virtual_stages ="
            f" {num_stages} equal stages, which does not divide evenly. Choose virtual_stages so that"
            f" {num_layers} is a multiple of {pp} x virtual_stages, or give pipeline_layer_split."
        )
    ranges = split_layers(num_layers, num_stages, layer_split)
    checkpointing = list(activation_checkpointing) if activation_checkpointing is not None else [None] * num_stages
    layouts = [StageLayout(i, num_stages, r, checkpointing[i]) for i, r in enumerate(ranges)]
    return PipelinePlan(layouts, [s for s in range(num_stages) if s % pp == pp_rank])


def check_tensor_parallel_shapes(module: nn.Module, tp: int) -> None:
    """Heads and hidden sizes must split evenly over tp (checked when the module exposes a GPT-like config)."""
    config = getattr(module, "config", None)
    if tp == 1 or config is None:
        return
    for field in ("num_heads", "hidden_size", "ffn_size"):
        value = getattr(config, field, None)
        if value is not None and value % tp != 0:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's {field}={value}; every tensor-parallel rank"
                f" must hold the same number of heads and columns. Choose a tensor_parallel_size that divides it."
            )


def build_stages(
    module: nn.Module,
    plan: PipelinePlan,
    tp_mesh: DeviceMesh | None,
    sequence_parallel: bool,
    device: torch.device,
    convert_module,
) -> tuple[dict[int, nn.Module], bool]:
    """Prune to this rank's stages, cast, shard over tp and materialise. Returns (stages, was_initialised)."""
    stage_modules = module.build_pipeline_stages([plan.layouts[s] for s in plan.local_stages])
    if len(stage_modules) != len(plan.local_stages):
        raise RuntimeError(
            f"{type(module).__name__}.build_pipeline_stages returned {len(stage_modules)} modules for"
            f" {len(plan.local_stages)} stages."
        )
    convert_module(module)
    on_meta = any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))
    if not on_meta:
        module.to(device)
    if tp_mesh is not None and tp_mesh.size() > 1:
        for stage in stage_modules:
            module.parallelize_stage(stage, tp_mesh, sequence_parallel)
            replicate_plain_parameters(stage, tp_mesh)
    if on_meta:
        materialize_(module, device)
        module.init_weights()
    return dict(zip(plan.local_stages, stage_modules)), on_meta


def replicate_plain_parameters(stage: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Make parameters the tensor-parallel plan left alone (norms, position embeddings) ``Replicate`` DTensors.

    Optimizers' foreach/fused kernels refuse a parameter group that mixes DTensors and plain tensors, and one
    kind of parameter keeps clipping and checkpointing uniform. The owning module gets DTensor inputs and
    hands back local tensors, so the code around it is unchanged.
    """
    for sub in list(stage.modules()):
        if any(p is not None and not isinstance(p, DTensor) for _, p in sub.named_parameters(recurse=False)):
            distribute_module(sub, tp_mesh, None, _replicated_inputs, _local_outputs)


def _replicated_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, Tensor) and not isinstance(x, DTensor) else x
        for x in inputs
    )


def _local_outputs(module: nn.Module, outputs, mesh: DeviceMesh):
    if isinstance(outputs, DTensor):
        return outputs.to_local()
    if isinstance(outputs, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
    return outputs


@torch.no_grad()
def broadcast_parameters(module: nn.Module, group: dist.ProcessGroup | None, src: int) -> None:
    """Make data-parallel replicas start equal (as DDP does): copy parameters and buffers from ``src``."""
    if group is None or dist.get_world_size(group) == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(local(t), src=src, group=group)


def check_tied_names(module: nn.Module) -> None:
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


def check_still_tied(module: nn.Module) -> None:
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


def tied_copies(module: nn.Module, pp_rank: int, pp: int) -> list[nn.Parameter]:
    """This pipeline rank's copies of the tied weights: the first-stage names on rank 0, the last-stage names on the
    last rank (the names were checked against the whole model before pruning by ``check_tied_names``)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    tied = []
    for first_name, last_name in module.pipeline_tied_parameters().items():
        name = first_name if pp_rank == 0 else last_name if pp_rank == pp - 1 else None
        if name is not None:
            tied.append(named[name])
    return tied
