"""Every private torch and Lightning API lightning_3d touches, in one place.

Each name here is underscore-private upstream and may change in any release. ``tests/test_compat.py`` checks the
signature and behaviour we rely on, so an upgrade that breaks one fails there, naming it, instead of deep inside a
distributed run. Code elsewhere in the package imports these wrappers, never the private names themselves.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _set_num_threads_if_needed,
    _sync_ddp_if_available,
)
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.distributed.checkpoint.planner_helpers import _create_read_items
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

# Lightning's own helpers for the default process group, used as its DDP strategy uses them (environment variables,
# backend per device type, the all-reduce behind ``Strategy.reduce``).
distributed_is_initialized = _distributed_is_initialized
default_process_group_backend = _get_default_process_group_backend_for_device
init_dist_connection = _init_dist_connection
sync_ddp_if_available = _sync_ddp_if_available
# Lightning's share of the CPU for each of n local processes: without OMP_NUM_THREADS set, torch.set_num_threads and
# OMP_NUM_THREADS become the available cores // n (at least 1); with it set, nothing changes.
set_num_threads_if_needed = _set_num_threads_if_needed

# The launcher Lightning's DDP strategy uses for script runs (one process per device, the script started again).
SubprocessScriptLauncher = _SubprocessScriptLauncher

# DCP's read items for one state-dict entry: our resharding load planner builds its plan from them per entry.
create_read_items = _create_read_items


def run_post_accumulate_grad_hooks(param: torch.Tensor) -> None:
    """Call ``param``'s post-accumulate-grad hooks, as autograd does after accumulating into ``param.grad``. For a
    gradient accumulated elsewhere on the parameter's behalf (tensor parallelism's local leaves, see
    lightning_3d/tensor_parallel/layers.py): torch has no public way to fire them."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    for hook in (hooks or {}).values():
        hook(param)


def dtensor_local_tensor(tensor: DTensor) -> torch.Tensor:
    """A DTensor's local tensor, the one ``to_local`` returns with grad mode off, without the ``no_grad`` context and
    the method call: tensor parallelism checks its parameters' local leaves once per layer call on the host."""
    return tensor._local_tensor


def dtensor_spec(mesh: Any, placements: tuple, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> Any:
    """The metadata ``DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)`` gives a DTensor of
    ``dtype``, made once for :func:`dtensor_with_spec`."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, tuple(stride), dtype))


def dtensor_with_spec(local: torch.Tensor, spec: Any) -> DTensor:
    """``DTensor.from_local(local, ..., run_check=False, shape=, stride=)`` of a tensor that needs no gradient, with
    the metadata made beforehand (:func:`dtensor_spec`): ``from_local`` runs an autograd function and normalises
    the placements on every call, an order of magnitude more host time, once per parameter and step for the
    gradients that tensor parallelism's local leaves hand over."""
    return DTensor(local, spec, requires_grad=False)


# torch's functional collectives (out of place, traced by torch.compile as graph ops). Compiled tensor-parallel blocks
# use them instead of the in-place c10d calls: torch 2.11's compile of an in-place all-gather / reduce-scatter in a
# custom backward lost its result (zero gradients under sequence parallelism, lightning_3d/tensor_parallel/mappings.py).
# The ops themselves, not the ``_functional_collectives`` wrappers: traced, a wrapper puts the collective's wait right
# after its launch, and the column-parallel backward must place the wait after the weight-gradient GEMM to overlap
# the two. Each ``*_start`` returns the collective's output in flight; ``functional_wait`` returns it valid.
# Dimension 0, the sum, as the c10d calls they replace.
def functional_all_reduce_start(x: torch.Tensor, group: Any) -> torch.Tensor:
    return torch.ops._c10d_functional.all_reduce(x, "sum", group.group_name)


def functional_all_gather_start(x: torch.Tensor, group: Any) -> torch.Tensor:
    return torch.ops._c10d_functional.all_gather_into_tensor(x, torch.distributed.get_world_size(group),
                                                            group.group_name)


def functional_reduce_scatter_start(x: torch.Tensor, group: Any) -> torch.Tensor:
    return torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", torch.distributed.get_world_size(group),
                                                           group.group_name)


def functional_wait(x: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(x)


# Async tensor parallelism (torchtitan's ``maybe_enable_async_tp``): inductor's micro-pipeline TP pass rewrites a
# compiled graph's all-gather -> mm into ``symm_mem.fused_all_gather_matmul`` and mm -> reduce-scatter into
# ``symm_mem.fused_matmul_reduce_scatter`` (the GEMM cut into chunks, each computed while the next chunk's transfer
# runs), for groups with symmetric memory enabled. Both switches are private; the pass is global to the process.
def enable_async_tensor_parallel(group: Any) -> None:
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group.group_name)


def micro_pipeline_tp_matches(graph: torch.fx.Graph) -> list[tuple[str, int, int]]:
    """What the micro-pipeline TP pass would fuse in a post-grad graph, found by its own pattern matchers: one
    ("all_gather", gather dim, matmuls consuming it) or ("reduce_scatter", scatter dim, 1 if a matmul produces its
    input else 0) per collective it recognises. (Its fusion itself also needs NCCL and symmetric memory.)"""
    from torch._inductor.fx_passes import micro_pipeline_tp as pass_

    found: list[tuple[str, int, int]] = [
        ("all_gather", m.gather_dim, len(pass_._find_consumer_matmuls(m.res_node)))
        for m in pass_.find_all_gather_patterns(graph)]
    found += [("reduce_scatter", m.scatter_dim, int(pass_._find_producer_matmul(m.input_node) is not None))
              for m in pass_.find_reduce_scatter_patterns(graph)]
    return found


def flex_attention_trains_on(device: torch.device) -> str | None:
    """None where torch's FlexAttention can run its backward on ``device``, else torch's reason. Asks torch's own
    device check (private) with an input that needs gradients, so a check made before the step agrees with the one
    the first forward would meet. The check reads only the device and ``requires_grad``: the probe has no elements,
    so asking allocates nothing on the device (the check runs before every training step)."""
    from torch.nn.attention import flex_attention as torch_flex

    probe = torch.empty(0, device=device, requires_grad=True)
    try:
        torch_flex._validate_device(probe, probe, probe)
    except (NotImplementedError, ValueError) as err:
        return str(err)
    return None


def set_compiled_call(module: torch.nn.Module, call: Any) -> None:
    """Make ``call`` what ``module(...)`` runs, as ``Module.compile`` does with its ``torch.compile`` of
    ``module._call_impl`` (the attribute it sets); names, state dicts and hooks stay the module's. For a compiled
    block that needs an eager step before each call (lightning_3d/tensor_parallel/layers.py)."""
    if not hasattr(module, "_compiled_call_impl"):
        raise RuntimeError("torch.nn.Module has no _compiled_call_impl any more (torch changed Module.compile): update"
                           " lightning_3d/utils/compat.py:set_compiled_call.")
    module._compiled_call_impl = call


# The protocol GradScaler uses with optimizers that skip a step on the device (torch/amp/grad_scaler.py): an optimizer
# with ``_step_supports_amp_scaling`` reads ``optimizer.found_inf`` (and ``grad_scale``) in ``step``; torch's fused
# Adam/AdamW kernels then leave parameters and moments untouched where ``found_inf == 1`` and subtract it from the step
# counts they incremented, SGD's fused kernel leaves parameters and momentum buffers untouched. The non-finite check
# hands its verdict over this way instead of reading it on the host (docs/architecture.md, One training step).
# Only where the skip is exact: found_inf must be exactly 1.0 (the kernels compare with 1; the step counts subtract
# it), and SGD's fused path fills a momentum buffer it creates on a skipped first step with ``empty_like``, so SGD
# with momentum is left out.
_FOUND_INF_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def skips_on_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` with :func:`set_found_inf` of 1.0 leaves parameters and optimizer state as they
    were (bit for bit; Adam's state of a parameter's first step exists afterwards, zero, with step 0): torch's own
    Adam, AdamW or momentum-free SGD (not a subclass, whose ``step`` may differ) with ``fused=True`` in every param
    group, and neither attribute set by someone else (a GradScaler inside its ``step``)."""
    if type(optimizer) not in _FOUND_INF_OPTIMIZERS or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if getattr(optimizer, "found_inf", None) is not None or getattr(optimizer, "grad_scale", None) is not None:
        return False
    groups = optimizer.param_groups
    if not all(g.get("fused") for g in groups):
        return False
    return type(optimizer) is not torch.optim.SGD or all(g["momentum"] == 0 for g in groups)


def set_found_inf(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """The next ``optimizer.step()`` skips on the device where ``flag`` (float32, 0-dim, on the parameters' device)
    is 1.0 and steps as usual where it is 0.0; :func:`clear_found_inf` after that step."""
    optimizer.found_inf = flag


def clear_found_inf(optimizer: torch.optim.Optimizer) -> None:
    optimizer.__dict__.pop("found_inf", None)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions. They hold the device meshes they were computed on, and meshes
    compare equal by shape and names alone, so after the strategy destroys one run's groups and builds an equal mesh
    on new ones, a cache hit would hand the next run an output spec on the old mesh, whose collectives then name a
    destroyed group."""
    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()


def set_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """Make ``module.device_mesh`` return ``mesh`` (the property reads a private attribute that only Lightning's
    ModelParallelStrategy sets; ``configure_model`` of a user's module may read it)."""
    module._device_mesh = mesh


def logger_connector(trainer: pl.Trainer) -> Any:
    """The trainer's logger connector (``should_update_logs``, ``log_metrics``): how Lightning's own
    ThroughputMonitor logs at the trainer's logging cadence."""
    return trainer._logger_connector


def fit_train_dataloaders(trainer: pl.Trainer) -> Any:
    """What ``Trainer.fit(train_dataloaders=...)`` was given (a loader or a collection of them), readable from
    ``configure_model`` before Lightning wraps it; None when the training data comes from a data module or the
    LightningModule's own ``train_dataloader`` (or outside ``fit``)."""
    instance = trainer.fit_loop._data_source.instance
    return None if isinstance(instance, (pl.LightningModule, pl.LightningDataModule)) else instance


# ----- context parallelism: torch's ring attention (lightning_3d/context/ring_attention.py, docs/context_parallel.md) -----
# torch's public ``context_parallel`` reaches its ring through DTensor dispatch of the CUDA SDPA kernels only (CPU SDPA
# runs another op), and its options are module globals; we call the ring loops themselves, with the block kernel of
# the device, and set the options for the duration of each call. Imported on first use: a torch release that moves it
# breaks context parallelism only, not the package.


def torch_ring_module() -> Any:
    """torch's context-parallel attention module (``_templated_ring_attention``, ``_cp_options``, ``_RotateMethod``)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


@contextlib.contextmanager
def _ring_options(load_balance: bool):
    """torch's ring options for one call: ``load_balance`` (the zigzag layout under causal masking), K/V passed to the
    next rank by a point-to-point permutation (memory of one chunk, unlike the default all-gather of all of them),
    partial results merged in fp32."""
    ring = torch_ring_module()
    options = ring._cp_options
    saved = (options.enable_load_balance, options.rotate_method, options.convert_to_f32)
    options.enable_load_balance = load_balance
    options.rotate_method = ring._RotateMethod.ALL_TO_ALL
    options.convert_to_f32 = True
    try:
        yield
    finally:
        options.enable_load_balance, options.rotate_method, options.convert_to_f32 = saved


def ring_attention_forward(group, op, query, key, value, is_causal: bool, load_balance: bool, **kwargs):
    """torch's ring attention forward over ``group`` (sequence dim 2): returns ``(out, logsumexp, *rest of op)``."""
    with _ring_options(load_balance):
        return torch_ring_module()._templated_ring_attention(group, 2, op, query, key, value, is_causal=is_causal, **kwargs)


def ring_attention_backward(group, op, grad_out, grad_out_name: str, query, key, value, out, logsumexp,
                            is_causal: bool, load_balance: bool, **kwargs):
    """torch's ring attention backward (K/V and their gradients travel around the ring): ``(dq, dk, dv, *rest)``."""
    with _ring_options(load_balance):
        return torch_ring_module()._templated_ring_attention_backward(
            group, 2, op, grad_out, grad_out_name, query, key, value, out, logsumexp, is_causal=is_causal, **kwargs)


def attention_block_ops(device_type: str, dtype) -> tuple[Any, Any, str]:
    """The SDPA kernels one ring step runs on ``device_type``: ``(forward, backward, name of backward's gradient
    argument)``. Each returns the log-sum-exp the ring merges with."""
    aten = torch.ops.aten
    if device_type == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu.default,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default, "grad_out")
    if dtype in (torch.float16, torch.bfloat16):
        return (aten._scaled_dot_product_flash_attention.default,
                aten._scaled_dot_product_flash_attention_backward.default, "grad_out")
    return (aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_efficient_attention_backward.default, "grad_out_")


_CYCLES_PER_SECOND: dict[int, float] = {}


def device_busy_for(seconds: float, device: torch.device) -> None:
    """Queue a kernel that keeps ``device``'s current stream busy for about ``seconds`` (``torch.cuda._sleep``, a
    spin of a given number of GPU clock cycles, calibrated once per device). The profiler queues one before a timed
    span so that the host has issued the whole span's kernels before the GPU reaches them: the span's CUDA events then
    time the kernels alone, not the GPU waiting for a host-bound layer's launches (docs/planner.md, "Device and host
    times").

    The spin counts SM clock cycles, so its length in seconds follows the clock: calibrated on an idle GPU that has
    not yet raised its clock, the rate would be low and every later spin (at the top clock) shorter than asked. The
    calibration therefore spins first to raise the clock and keeps the fastest of three probes: a spin then lasts at
    least ``seconds`` at any clock. The profiler also checks that the lead held (``planner.timing``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    rate = _CYCLES_PER_SECOND.get(index)
    if rate is None:
        with torch.cuda.device(index):
            probe = 10_000_000
            torch.cuda._sleep(20 * probe)  # module load and the clock's ramp, not timed
            rates = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(probe)
                end.record()
                end.synchronize()
                rates.append(probe / max(start.elapsed_time(end) / 1e3, 1e-6))
            rate = _CYCLES_PER_SECOND[index] = max(rates)
    with torch.cuda.device(index):
        torch.cuda._sleep(int(rate * seconds))


def after_gradient_hooks(precision_plugin: Any, judge: Any) -> None:
    """Call ``judge(optimizer)`` right after Lightning's ``Precision._after_closure`` (the ``on_before_optimizer_step``
    hooks of callbacks and module, then gradient clipping), i.e. on the gradients the optimizer's update will read.
    Lightning offers no public hook after clipping and before the update; its precision plugins (also the scaler
    path of ``MixedPrecision``) all call ``_after_closure`` there. Idempotent: a second call replaces the judge."""
    original = getattr(precision_plugin, "_l3d_after_closure", None) or precision_plugin._after_closure

    def after_closure(model: Any, optimizer: Any) -> None:
        original(model, optimizer)
        judge(optimizer)

    precision_plugin._l3d_after_closure = original
    precision_plugin._after_closure = after_closure
