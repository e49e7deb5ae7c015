"""Tensor-parallel operators and layers on local tensors (world 2, gloo) against their mathematical definition.

The communication operators' forward and backward are compared exactly with what they must compute from every
rank's inputs (each rank draws all ranks' tensors from shared seeds; a sum of two fp32 numbers is the same in either
order). The fused q/k/v projection and a column -> row MLP are compared with the same layers unsharded in this
process, within the summation-order tolerance of tests/tolerance.py, forward and backward, with and without sequence
parallelism; gradients must land in the DTensor parameters' ``.grad`` with the parameters' placements (``Partial``
for replicated parameters that saw only this rank's tokens). A two-block GPT stage under the local layers equals it
under torch's DTensor plan, and ``L3D_TP_IMPLEMENTATION`` selects the plan.
"""

from __future__ import annotations

import copy
import gc
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_3d.tensor_parallel import (
    TensorParallel,
    column_parallel,
    copy_to_region,
    fused_column_parallel,
    gather_sequence,
    reduce_from_region,
    reduce_scatter_sequence,
    replicated,
    row_parallel,
    split_sequence,
)
from lightning_3d.utils.compat import clear_dtensor_caches
from tests.scenarios import t5_tensor_parallel
from tests.scenarios.common import parse_args, write_report
from tests.tolerance import chain_tolerance, scaled_error

B, S, H = 2, 6, 8


def per_rank(seed: int, shape: tuple[int, ...], world: int) -> list[torch.Tensor]:
    """Every rank's tensor of one role (the same list on every rank)."""
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100 + r)) for r in range(world)]


def check_mappings(rank: int, world: int) -> dict[str, bool]:
    group = dist.group.WORLD
    full, chunk = (B, S, H), (B, S // world, H)
    cases = {
        # name: (op, inputs, upstream grads, expected output, expected input grad)
        "copy_to_region": (copy_to_region, per_rank(1, full, world), per_rank(2, full, world),
                           lambda xs, r: xs[r], lambda gs, r: sum(gs)),
        "reduce_from_region": (reduce_from_region, per_rank(3, full, world), per_rank(4, full, world),
                               lambda xs, r: sum(xs), lambda gs, r: gs[r]),
        "gather_sequence": (gather_sequence, per_rank(5, chunk, world), per_rank(6, full, world),
                            lambda xs, r: torch.cat(xs, 1), lambda gs, r: sum(gs).chunk(world, 1)[r]),
        "reduce_scatter_sequence": (reduce_scatter_sequence, per_rank(7, full, world), per_rank(8, chunk, world),
                                    lambda xs, r: sum(xs).chunk(world, 1)[r], lambda gs, r: torch.cat(gs, 1)),
        "split_sequence": (split_sequence, [per_rank(9, full, 1)[0]] * world, per_rank(10, chunk, world),
                           lambda xs, r: xs[r].chunk(world, 1)[r], lambda gs, r: torch.cat(gs, 1)),
    }
    results = {}
    for name, (op, xs, gs, want_out, want_grad) in cases.items():
        x = xs[rank].clone().requires_grad_()
        out = op(x, group)
        out.backward(gs[rank])
        results[name] = torch.equal(out, want_out(xs, rank)) and torch.equal(x.grad, want_grad(gs, rank))
    return results


class QKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H, bias=False), nn.Linear(H, H)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(self.norm(x))))


def rows(t: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(world, dim)[rank]


def check_layers(rank: int, world: int, sequence_parallel: bool) -> dict[str, float | bool]:
    torch.manual_seed(0)  # the same full layers and data on every rank
    mesh = init_device_mesh("cpu", (world,))
    tp = TensorParallel(mesh, sequence_parallel)
    x_full, g_full = torch.randn(B, S, H), torch.randn(B, S, 3 * H)
    local_in = (lambda t: rows(t, rank, world, 1)) if sequence_parallel else (lambda t: t)

    ref = QKV()
    for p in ref.parameters():
        p.data.normal_()
    sharded = copy.deepcopy(ref)
    memo: dict = {}
    for proj in (sharded.q, sharded.k, sharded.v):
        column_parallel(proj, tp, memo)
    x_ref = x_full.clone().requires_grad_()
    outs_ref = [ref.q(x_ref), ref.k(x_ref), ref.v(x_ref)]
    torch.cat(outs_ref, -1).backward(g_full)
    x = local_in(x_full).clone().requires_grad_()
    outs = fused_column_parallel(x, (sharded.q, sharded.k, sharded.v), tp)
    # This rank's columns of each projection, and the upstream gradient of those columns.
    torch.cat(outs, -1).backward(torch.cat([rows(g, rank, world, -1) for g in g_full.chunk(3, -1)], -1))
    tol = chain_tolerance(1, H)  # one dot product of H terms (a second order of the same sum)
    result: dict[str, float | bool] = {"tolerance": tol}
    result["qkv_out"] = max(scaled_error(o, rows(r, rank, world, -1)) for o, r in zip(outs, outs_ref))
    result["qkv_input_grad"] = scaled_error(x.grad, local_in(x_ref.grad))
    result["qkv_weight_grads"] = max(
        scaled_error(getattr(sharded, n).weight.grad.to_local(), rows(getattr(ref, n).weight.grad, rank, world))
        for n in "qkv")
    result["qkv_grads_are_shard0_dtensors"] = all(
        isinstance(getattr(sharded, n).weight.grad, DTensor) and getattr(sharded, n).weight.grad.placements == (Shard(0),)
        for n in "qkv") and sharded.k.bias is None

    ref_mlp = MLP()
    for p in ref_mlp.parameters():
        p.data.normal_()
    mlp = copy.deepcopy(ref_mlp)
    memo = {}
    replicated(mlp.norm, tp, memo)
    column_parallel(mlp.fc, tp, memo)
    row_parallel(mlp.proj, tp, memo)
    x_ref = x_full.clone().requires_grad_()
    out_ref = ref_mlp(x_ref)
    out_ref.backward(g_full[..., :H])
    x = local_in(x_full).clone().requires_grad_()
    out = mlp(x)
    out.backward(local_in(g_full[..., :H]))
    result["mlp_tolerance"] = chain_tolerance(3, 4 * H)
    result["mlp_out"] = scaled_error(out, local_in(out_ref))
    result["mlp_input_grad"] = scaled_error(x.grad, local_in(x_ref.grad))
    norm_grad = mlp.norm.weight.grad
    want = Partial() if sequence_parallel else Replicate()
    result["norm_grad_placement"] = isinstance(norm_grad, DTensor) and norm_grad.placements == (want,)
    grads = {
        "fc.weight": (mlp.fc.weight.grad.full_tensor(), ref_mlp.fc.weight.grad),
        "proj.weight": (mlp.proj.weight.grad.full_tensor(), ref_mlp.proj.weight.grad),
        "proj.bias": (mlp.proj.bias.grad.full_tensor(), ref_mlp.proj.bias.grad),  # a Partial one sums here
        "norm.weight": (norm_grad.full_tensor(), ref_mlp.norm.weight.grad),
    }
    result["mlp_param_grads"] = max(scaled_error(a, b) for a, b in grads.values())
    result["weights_placements"] = (mlp.fc.weight.placements, mlp.proj.weight.placements) == ((Shard(0),), (Shard(1),))
    return result


def check_autocast_and_optimizer(rank: int, world: int) -> dict[str, bool]:
    """Under autocast the column-parallel input's collectives carry the autocast dtype (bf16), not the LayerNorm's
    fp32; an element-wise optimizer steps the local shards (plain tensors) exactly as it steps the DTensors, and its
    checkpoint state is the unsharded optimizer's, key for key and value for value."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from lightning_3d.distributed.sharded_optimizer import local_optimizer, sharding_of
    from lightning_3d.tensor_parallel import mappings

    mesh = init_device_mesh("cpu", (world,))
    result: dict[str, bool] = {}
    for sp in (False, True):
        torch.manual_seed(0)
        mlp, tp, memo = MLP(), TensorParallel(mesh, sp), {}
        column_parallel(mlp.fc, tp, memo)
        row_parallel(mlp.proj, tp, memo)
        replicated(mlp.norm, tp, memo)
        seen: list[torch.dtype] = []
        real = (dist.all_reduce, mappings._all_gather_single, mappings._reduce_scatter_single)

        def spy(fn):
            def call(*args, **kwargs):
                seen.append(next(a for a in args if isinstance(a, torch.Tensor)).dtype)
                return fn(*args, **kwargs)
            return call

        dist.all_reduce = spy(real[0])
        mappings._all_gather_single, mappings._reduce_scatter_single = spy(real[1]), spy(real[2])
        try:
            x = torch.randn(B, S // world if sp else S, H).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = mlp(x)
            y.float().sum().backward()
        finally:
            dist.all_reduce, mappings._all_gather_single, mappings._reduce_scatter_single = real
        result[f"sp{sp}_collectives_bf16"] = bool(seen) and all(d == torch.bfloat16 for d in seen)
        result[f"sp{sp}_input_grad_fp32"] = x.grad.dtype == torch.float32

    def sharded_mlp() -> MLP:
        torch.manual_seed(1)
        mlp, tp, memo = MLP(), TensorParallel(mesh, False), {}
        column_parallel(mlp.fc, tp, memo)
        row_parallel(mlp.proj, tp, memo)
        replicated(mlp.norm, tp, memo)
        return mlp

    mlp, twin = sharded_mlp(), sharded_mlp()
    fqns = {id(p): n for n, p in mlp.named_parameters()}
    opt, ref = torch.optim.AdamW(mlp.parameters(), lr=0.1), torch.optim.AdamW(twin.parameters(), lr=0.1)
    pieces = local_optimizer(opt, fqns, rank)
    result["optimizer_steps_plain_tensors"] = (
        pieces is not None and sharding_of(opt) is pieces
        and all(type(p) is torch.Tensor for g in opt.param_groups for p in g["params"]))
    for step in range(2):
        for module in (mlp, twin):
            torch.manual_seed(10 + step)
            module(torch.randn(B, S, H)).pow(2).sum().backward()
        pieces.collect_grads({})
        opt.step()
        ref.step()
        pieces.release_grads()  # as the engine does after every step (the pieces' zero_grad cannot reach them)
        opt.zero_grad()
        ref.zero_grad()
    result["same_parameters_as_dtensor_step"] = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(mlp.parameters(), twin.parameters()))
    # Gradients through the local leaves (layers.local_view): accumulated over micro-batches like autograd's, with the
    # parameter's hooks run per accumulation, and nothing left behind when .grad is cleared between forward and backward.
    fc, ref_fc = sharded_mlp().fc, MLP().fc
    torch.manual_seed(1)
    ref_fc.load_state_dict(MLP().fc.state_dict())
    calls: list[int] = []
    fc.weight.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    inputs = [torch.randn(B, S, H, generator=torch.Generator().manual_seed(20 + i)) for i in range(3)]
    bound = chain_tolerance(2, 2 * B * S)  # the weight gradient's reduction over two micro-batches' tokens
    for x in inputs[:2]:
        fc(x).pow(2).sum().backward()
        ref_fc(x).pow(2).sum().backward()
    result["leaf_grads_accumulate"] = (
        "_l3d_local_leaf" in fc.weight.__dict__ and len(calls) == 2
        and scaled_error(fc.weight.grad.to_local(), rows(ref_fc.weight.grad, rank, world)) <= bound)
    # The leaf wraps the first micro-batch's gradient with metadata made once (compat.dtensor_with_spec): the same
    # DTensor as DTensor.from_local would make of it.
    grad = fc.weight.grad
    made = DTensor.from_local(grad.to_local(), mesh, (Shard(0),), run_check=False, shape=fc.weight.shape,
                              stride=fc.weight.stride())
    def meta(t: DTensor) -> tuple:
        return t.placements, t.shape, t.stride(), t.dtype, t.device_mesh, t.requires_grad, t.to_local().stride()

    result["leaf_grad_as_from_local"] = meta(grad) == meta(made) and torch.equal(grad.to_local(), made.to_local())
    y, y_ref = fc(inputs[2]).pow(2).sum(), ref_fc(inputs[2]).pow(2).sum()
    fc.weight.grad = fc.bias.grad = None  # as Lightning's zero_grad runs between the training step and backward
    ref_fc.zero_grad()
    y.backward()
    y_ref.backward()
    result["leaf_grads_after_zero_grad"] = scaled_error(
        fc.weight.grad.to_local(), rows(ref_fc.weight.grad, rank, world)) <= bound
    mine = pieces.flat_state_dict()
    want = get_optimizer_state_dict(twin, ref, options=StateDictOptions(flatten_optimizer_state_dict=True))
    result["checkpoint_state_as_unsharded"] = mine.keys() == want.keys() and all(
        torch.equal(torch.as_tensor(mine[k].to_local() if isinstance(mine[k], DTensor) else mine[k]),
                    torch.as_tensor(want[k].to_local() if isinstance(want[k], DTensor) else want[k]))
        if isinstance(want[k], torch.Tensor) else mine[k] == want[k] for k in want)
    shaped = getattr(torch.optim, "Adafactor", None)
    result["shape_aware_optimizer_left_alone"] = shaped is None or local_optimizer(
        shaped(sharded_mlp().parameters()), {}, rank) is None
    return result


def check_overlap(rank: int, world: int) -> dict[str, bool | int | str]:
    """The column-parallel entry fused with its GEMM (``column_parallel_linear``, ``L3D_TP_OVERLAP``): the same
    outputs and gradients as the synchronous path (the same operations in another order, so equal to the bit), with
    and without sequence parallelism and autocast, for a ``ColumnParallelLinear`` and the fused q/k/v; the backward
    launches the input gradient's collective between the dgrad and the wgrad GEMM and waits for it after the wgrad
    (under SP with ``regather`` the input's all-gather is launched before the dgrad GEMM and waited for before the
    wgrad one); under SP it saves the gathered input, as the synchronous path, or with ``regather`` this rank's
    sequence chunk of it (exact bytes). ``L3D_TP_SP_REGATHER``: default off, 1 on, anything else refused."""
    import os

    from torch.autograd.graph import saved_tensors_hooks
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_3d.tensor_parallel import mappings

    mesh = init_device_mesh("cpu", (world,))
    result: dict[str, bool | int | str] = {}
    events: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("mm", "sum"):
                events.append(name)
            return func(*args, **(kwargs or {}))

    class Waited:
        def __init__(self, work, name: str) -> None:
            self.work, self.name = work, name

        def wait(self):
            events.append("wait:" + self.name)
            return self.work.wait()

    def spy(fn, name: str):
        def call(*args, **kwargs):
            events.append("launch:" + name)
            work = fn(*args, **kwargs)
            return Waited(work, name) if kwargs.get("async_op") else work
        return call

    def run(overlap: bool, sp: bool, autocast: bool, fused: bool, regather: bool = False):
        torch.manual_seed(0)  # the same layers, inputs and upstream gradients on every call
        tp = TensorParallel(mesh, sp, overlap=overlap, regather=regather)
        module, memo = (QKV() if fused else MLP()), {}
        linears = (module.q, module.k, module.v) if fused else (module.fc,)
        for linear in linears:
            column_parallel(linear, tp, memo)
        x = torch.randn(B, S // world if sp else S, H).requires_grad_()
        packed = [0]

        def pack(t):
            packed[0] += t.numel() * t.element_size()
            return t

        with saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = torch.cat(fused_column_parallel(x, linears, tp), -1) if fused else linears[0](x)
        grad = torch.randn(out.shape, dtype=out.dtype)
        real = (dist.all_reduce, mappings._all_gather_single, mappings._reduce_scatter_single)
        events.clear()
        dist.all_reduce = spy(real[0], "all_reduce")
        mappings._all_gather_single = spy(real[1], "all_gather")
        mappings._reduce_scatter_single = spy(real[2], "reduce_scatter")
        try:
            with Ops():
                out.backward(grad)
        finally:
            dist.all_reduce, mappings._all_gather_single, mappings._reduce_scatter_single = real
        grads = [x.grad] + [p.grad.to_local() for linear in linears for p in linear.parameters()]
        return out.detach(), grads, list(events), packed[0]

    for sp, regather in ((False, False), (True, False), (True, True)):
        for autocast in (False, True):
            for fused in (False, True):
                key = f"sp{sp}{'_regather' if regather else ''}_autocast{autocast}_{'qkv' if fused else 'fc'}"
                out_on, grads_on, events_on, bytes_on = run(True, sp, autocast, fused, regather)
                out_off, grads_off, events_off, bytes_off = run(False, sp, autocast, fused)
                result[f"{key}_equal"] = torch.equal(out_on, out_off) and len(grads_on) == len(grads_off) and all(
                    torch.equal(a, b) for a, b in zip(grads_on, grads_off))
                # The backward's own work (the gathered input's all-gather under SP, the dgrad mm, the input
                # gradient's collective, the wgrad mm and the bias sum); both layers have a bias (fused: q's and v's).
                collective = "reduce_scatter" if sp else "all_reduce"
                want = ["mm", f"launch:{collective}", "mm", "sum", f"wait:{collective}"]
                if regather:
                    want = ["launch:all_gather", "mm", f"launch:{collective}", "wait:all_gather", "mm", "sum",
                            f"wait:{collective}"]
                result[f"{key}_overlap_order"] = events_on == want
                result[f"{key}_events"] = " ".join(events_on)
                # The synchronous path: the collective only after both GEMMs of the layer's backward.
                last_mm = max(i for i, e in enumerate(events_off) if e == "mm")
                result[f"{key}_sync_order"] = events_off.index(f"launch:{collective}") > last_mm
                # Saved: the input (this rank's chunk with regather under SP; the gathered input otherwise) and the
                # weight, in the GEMM's dtype; nothing else.
                elem = 2 if autocast else 4
                out_features = (3 * H if fused else 4 * H) // world  # this rank's rows of q, k, v (or of fc)
                weight_bytes = out_features * H * elem
                local_tokens = B * (S // world if regather else S)
                result[f"{key}_saved_bytes"] = bytes_on == (local_tokens * H * elem + weight_bytes)
                result[f"{key}_saved_bytes_sync"] = bytes_off == (B * S * H * elem + weight_bytes)
                result[f"{key}_saved_bytes_saving"] = bytes_off - bytes_on
    result.update(_compiled_overlap_order(mesh, world))
    # The switch: default on, 0 off, anything else refused naming the value and the fix.
    saved = os.environ.pop(mappings.OVERLAP_VARIABLE, None)
    try:
        result["default_on"] = TensorParallel(mesh).overlap is True
        os.environ[mappings.OVERLAP_VARIABLE] = "0"
        result["zero_off"] = TensorParallel(mesh).overlap is False
        os.environ[mappings.OVERLAP_VARIABLE] = "yes"
        try:
            TensorParallel(mesh)
            result["bad_value_error"] = ""
        except ValueError as e:
            result["bad_value_error"] = str(e)
    finally:
        os.environ.pop(mappings.OVERLAP_VARIABLE, None)
        if saved is not None:
            os.environ[mappings.OVERLAP_VARIABLE] = saved
    saved = os.environ.pop(mappings.REGATHER_VARIABLE, None)
    try:
        result["regather_default_off"] = TensorParallel(mesh, True).regather is False
        os.environ[mappings.REGATHER_VARIABLE] = "1"
        result["regather_one_on"] = TensorParallel(mesh, True).regather is True
        os.environ[mappings.REGATHER_VARIABLE] = "chunk"
        try:
            TensorParallel(mesh, True)
            result["regather_bad_value_error"] = ""
        except ValueError as e:
            result["regather_bad_value_error"] = str(e)
    finally:
        os.environ.pop(mappings.REGATHER_VARIABLE, None)
        if saved is not None:
            os.environ[mappings.REGATHER_VARIABLE] = saved
    return result


def _compiled_overlap_order(mesh, world: int) -> dict[str, bool | str]:
    """Compiled, ``column_parallel_linear``'s backward graph keeps the eager order with explicit waits: the dgrad
    GEMM, the collective's launch, the wgrad GEMM, then the wait (under SP the input's all-gather launched before the
    dgrad GEMM, its wait before the wgrad GEMM, with ``regather``); and the compiled layer equals the eager one to
    the bit (aot_eager: the same kernels, the same collectives)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from lightning_3d.tensor_parallel import column_parallel_linear

    names = {"mm": "mm", "all_reduce": "launch:all_reduce", "all_gather_into_tensor": "launch:all_gather",
             "reduce_scatter_tensor": "launch:reduce_scatter", "wait_tensor": "wait"}
    result: dict[str, bool | str] = {}
    for sp, regather in ((False, False), (True, False), (True, True)):
        tp = TensorParallel(mesh, sp, overlap=True, regather=regather)
        graphs: list = []

        def keep(gm, _inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward)

        torch._dynamo.reset()
        compiled = torch.compile(lambda x, w, b: column_parallel_linear(x, w, b, tp),
                                 backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
        torch.manual_seed(3)
        x, w, b = torch.randn(B, S // world if sp else S, H), torch.randn(2 * H, H), torch.randn(2 * H)
        grad = torch.randn(B, S, 2 * H)
        runs = []
        for fn in (compiled, lambda x, w, b: column_parallel_linear(x, w, b, tp)):
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            out = fn(*leaves)
            out.backward(grad if not sp else grad)
            runs.append([out.detach()] + [t.grad for t in leaves])
        backward = graphs[-1]
        events = [names[n.target._opname] for n in backward.graph.nodes
                  if n.op == "call_function" and getattr(n.target, "_opname", None) in names]
        collective = "reduce_scatter" if sp else "all_reduce"
        want = ["mm", f"launch:{collective}", "mm", "wait"]
        if regather:
            want = ["launch:all_gather", "mm", f"launch:{collective}", "wait", "mm", "wait"]
        key = f"compiled_sp{sp}{'_regather' if regather else ''}"
        result[f"{key}_order"] = events == want
        result[f"{key}_events"] = " ".join(events)
        result[f"{key}_equal"] = all(torch.equal(a, b) for a, b in zip(*runs))
    torch._dynamo.reset()
    return result


def gpt_stage(implementation: str | None, mesh, sequence_parallel: bool, compile_first: bool = False):
    """A tiny GPT stage (embedding, 2 blocks, head) under the tensor-parallel plan. ``compile_first``: its blocks
    compiled by the recipes' ``compile_blocks`` before the plan, the order of the recipes (build_pipeline_stages
    compiles, the strategy's parallelize_stage swaps the layers in afterwards)."""
    from lightning_3d.recipes.gpt.config import preset
    from lightning_3d.recipes.gpt.model import GPTModel, copy_full_into
    from lightning_3d.recipes.gpt.parallelize import GPTStage, parallelize_gpt
    from lightning_3d.strategies.stage_builder import replicate_plain_parameters
    from lightning_3d.utils.tensors import materialize_

    # No key bias (the default): its exact gradient is zero, so both plans would only compare rounding noise.
    config = preset("tiny", vocab_size=50, seq_length=8, num_layers=2, hidden_size=16, num_heads=4, dropout=0.0)
    with torch.device("meta"):
        model = GPTModel(config, config.padded_vocab_size(mesh.size()))
    stage = GPTStage(model, range(2), first=True, last=True)
    if compile_first:
        from lightning_3d.recipes.training import compile_blocks

        compile_blocks(stage.layers.values(), True)
    parallelize_gpt(stage, mesh, sequence_parallel, implementation=implementation)
    replicate_plain_parameters(stage, mesh)
    materialize_(model, torch.device("cpu"))
    model.init_weights(7)
    mask = torch.zeros(model.head.out_features)
    mask[config.vocab_size:] = float("-inf")
    copy_full_into(model.head.padding_mask, mask)
    return config, stage


def check_gpt_plans(world: int) -> dict[str, float | bool | str]:
    """The GPT stage under the local layers equals it under torch's DTensor plan (loss and every gradient)."""
    import os

    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_3d.recipes.training import summed_token_cross_entropy
    from lightning_3d.tensor_parallel import ColumnParallelLinear
    from tests.tolerance import gpt_tolerance

    mesh = init_device_mesh("cpu", (world,))
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    microbatch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    # Two summation orders of the forward chain (gpt_tolerance) and, for the gradients, of the backward chain through
    # the same reductions again: twice as many; the widest reduction is the MLP's 64 (and the padded vocabulary's 64).
    result: dict[str, float | bool | str] = {"tolerance": 2 * gpt_tolerance(2, 64)}
    for sp in (False, True):
        runs = {}
        for implementation in ("local", "dtensor"):
            os.environ["L3D_TP_IMPLEMENTATION"] = implementation  # the environment's choice, with no argument
            _, stage = gpt_stage(None, mesh, sp)
            with loss_parallel():
                loss = summed_token_cross_entropy(stage(microbatch=microbatch), microbatch["labels"])
                loss.backward()
            grads = {}
            for name, p in stage.named_parameters():
                g = p.grad.redistribute(p.device_mesh, p.placements)  # Partial (norms under SP) -> Replicate
                grads[name] = g.full_tensor()
            runs[implementation] = (loss.detach(), grads, isinstance(stage.layers["0"].attn.q, ColumnParallelLinear))
        (loss_l, grads_l, local_l), (loss_d, grads_d, local_d) = runs["local"], runs["dtensor"]
        result[f"sp{sp}_loss"] = abs(loss_l - loss_d).item() / abs(loss_d).item()
        errors = {n: scaled_error(grads_l[n], grads_d[n]) for n in grads_d}
        result[f"sp{sp}_grads"] = max(errors.values())
        result[f"sp{sp}_worst"] = max(errors, key=errors.get)
        result[f"sp{sp}_selected"] = local_l and not local_d
    os.environ["L3D_TP_IMPLEMENTATION"] = "fast"
    try:
        gpt_stage(None, mesh, False)
        result["bad_value_error"] = ""
    except ValueError as e:
        result["bad_value_error"] = str(e)
    del os.environ["L3D_TP_IMPLEMENTATION"]
    return result


def check_compiled_stage(world: int) -> dict[str, float | bool | int]:
    """The GPT stage with its blocks compiled as the recipe compiles them (``compile_blocks``; backend aot_eager: the
    same graph capture and autograd tracing as inductor without C++ kernels) equals the eager stage over two
    accumulated micro-batches, with and without sequence parallelism; every block is one graph with no break, one
    graph serves all blocks, and the graphs compute on the local leaves (each gradient is handed to its DTensor
    parameter by the leaf, as eagerly, not accumulated as a DTensor)."""
    from torch._dynamo.utils import counters
    from torch.distributed.tensor.parallel import loss_parallel

    import lightning_3d.recipes.training as training
    from lightning_3d.recipes.training import summed_token_cross_entropy
    from lightning_3d.tensor_parallel import layers as tp_layers
    from tests.tolerance import gpt_tolerance

    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 50, (2, 9), generator=generator) for _ in range(2)]
    handed = [0]
    hand_over = tp_layers._LocalLeaf._hand_over

    def counting(self, tensor):
        handed[0] += 1
        return hand_over(self, tensor)

    tp_layers._LocalLeaf._hand_over = counting
    backend, training.COMPILE_BACKEND = training.COMPILE_BACKEND, "aot_eager"
    # As check_gpt_plans: two summation orders of the forward and backward chains at most (aot_eager runs the same
    # kernels, so the two agree to the bit in practice; the bound is what the test may rely on).
    result: dict[str, float | bool | int] = {"tolerance": 2 * gpt_tolerance(2, 64)}
    try:
        for sp in (False, True):
            runs = {}
            for compiled in (False, True):
                torch._dynamo.reset()
                counters.clear()
                handed[0] = 0
                _, stage = gpt_stage("local", mesh, sp, compile_first=compiled)  # compiled in the recipes' order
                losses = []
                for tokens in batches:
                    microbatch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
                    with loss_parallel():
                        loss = summed_token_cross_entropy(stage(microbatch=microbatch), microbatch["labels"])
                        loss.backward()
                    losses.append(loss.detach())
                grads = {n: p.grad.redistribute(p.device_mesh, p.placements).full_tensor()
                         for n, p in stage.named_parameters()}
                runs[compiled] = (torch.stack(losses), grads, handed[0])
                if compiled:
                    result[f"sp{sp}_graphs"] = int(counters["stats"]["unique_graphs"])
                    result[f"sp{sp}_graph_breaks"] = int(sum(counters["graph_break"].values()))
            # What the graph takes as inputs (a backend that records them): the staged local leaves, no DTensor
            # parameter (one would be guarded and unwrapped on every call), and each staged tensor is the leaf.
            inputs: list = []

            def recording(gm, example_inputs):
                inputs.extend(example_inputs)
                return gm.forward

            # And its guards (torch's guards log): none on a parameter other than one that is None (k has no bias).
            guard_lines: list[str] = []

            class Guards(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    guard_lines.extend(record.getMessage().splitlines())

            guards_logger, handler = logging.getLogger("torch._dynamo.guards.__guards"), Guards()
            guards_logger.addHandler(handler)
            torch._logging.set_logs(guards=True)
            torch._dynamo.reset()
            training.COMPILE_BACKEND = recording
            try:
                _, stage = gpt_stage("local", mesh, sp, compile_first=True)
                microbatch = {"input_ids": batches[0][:, :-1], "labels": batches[0][:, 1:]}
                with loss_parallel():
                    summed_token_cross_entropy(stage(microbatch=microbatch), microbatch["labels"]).backward()
            finally:
                training.COMPILE_BACKEND = "aot_eager"
                torch._logging.set_logs()
                guards_logger.removeHandler(handler)
            result[f"sp{sp}_guard_lines"] = len(guard_lines)
            result[f"sp{sp}_parameter_guards"] = [
                line.strip()[:160] for line in guard_lines
                if "_parameters[" in line and "NONE_MATCH" not in line and "NoneType" not in line]
            staged = []
            for layer in stage.layers["0"].modules():
                if isinstance(layer, tp_layers._LocalTensorLayer):
                    for name, _ in layer._local_params():
                        param = getattr(layer, name)
                        tensor = layer.__dict__[tp_layers._STAGED_PREFIX + name]
                        staged.append((tensor, None if param is None else param.__dict__["_l3d_local_leaf"].tensor))
            result[f"sp{sp}_dtensor_graph_inputs"] = sum(isinstance(x, DTensor) for x in inputs)
            result[f"sp{sp}_staged_are_leaves"] = len(staged) > 0 and all(t is leaf for t, leaf in staged)
            result[f"sp{sp}_staged_are_graph_inputs"] = all(
                t is None or any(x is t for x in inputs) for t, _ in staged)
            (loss_e, grads_e, handed_e), (loss_c, grads_c, handed_c) = runs[False], runs[True]
            result[f"sp{sp}_loss"] = ((loss_c - loss_e).abs() / loss_e.abs()).max().item()
            result[f"sp{sp}_grads"] = max(scaled_error(grads_c[n], grads_e[n]) for n in grads_e)
            result[f"sp{sp}_handed_eager"], result[f"sp{sp}_handed_compiled"] = handed_e, handed_c
    finally:
        tp_layers._LocalLeaf._hand_over = hand_over
        training.COMPILE_BACKEND = backend
        torch._dynamo.reset()
    return result


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"mappings": check_mappings(rank, world),
              "layers": {str(sp): check_layers(rank, world, sp) for sp in (False, True)},
              "gpt": check_gpt_plans(world),
              "compiled": check_compiled_stage(world),
              "t5": t5_tensor_parallel.check_t5_plans(world),
              "t5_compiled": t5_tensor_parallel.check_t5_compiled(world),
              "autocast_and_optimizer": check_autocast_and_optimizer(rank, world),
              "overlap": check_overlap(rank, world)}
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    write_report(args.report, {"ranks": gathered})
    # The meshes and DTensors made here hold torch's sharding caches; released before the group, or the process can
    # abort at interpreter exit ("terminate called without an active exception") after a successful run.
    clear_dtensor_caches()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
