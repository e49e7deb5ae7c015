"""The private torch and Lightning APIs of ``lightning_3d.utils.compat``: what we rely on, checked on the installed
versions, so that an upgrade that changes one fails here by name. The package itself may import private names only
through that module (checked on the source below)."""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

from lightning_3d.utils import compat

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_3d"


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_lightning_distributed_helpers_keep_their_signatures() -> None:
    assert _params(compat.init_dist_connection)[:2] == ["cluster_environment", "torch_distributed_backend"]
    assert "timeout" not in _params(compat.init_dist_connection)  # passed through **kwargs to init_process_group
    assert _params(compat.sync_ddp_if_available) == ["result", "group", "reduce_op"]
    assert compat.default_process_group_backend(torch.device("cpu")) == "gloo"
    assert compat.distributed_is_initialized() is False


def test_set_num_threads_if_needed_shares_the_cores_unless_the_user_chose(monkeypatch) -> None:
    """Lightning's rule the strategy applies in every rank: cores // local processes when OMP_NUM_THREADS is unset
    (torch's intra-op threads and the variable, for processes started later), nothing when it is set."""
    import lightning.fabric.utilities.distributed as fabric_distributed

    before = torch.get_num_threads()
    monkeypatch.setattr(fabric_distributed, "_num_cpus_available", lambda: 8)
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        compat.set_num_threads_if_needed(num_processes=3)
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
        compat.set_num_threads_if_needed(num_processes=16)  # set now: the user's (or an earlier rank's) choice stays
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
        monkeypatch.delenv("OMP_NUM_THREADS")
        compat.set_num_threads_if_needed(num_processes=16)  # never below one thread
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_subprocess_launcher_takes_environment_processes_nodes() -> None:
    launcher = compat.SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    assert launcher.is_interactive_compatible is False and hasattr(launcher, "launch")


def test_device_mesh_and_logger_connector_reach_what_lightning_reads() -> None:
    module = pl.LightningModule()
    mesh = object()
    compat.set_device_mesh(module, mesh)
    assert module.device_mesh is mesh
    connector = compat.logger_connector(pl.Trainer(logger=False, enable_progress_bar=False,
                                                   enable_model_summary=False, enable_checkpointing=False))
    assert hasattr(connector, "should_update_logs") and _params(connector.log_metrics) == ["metrics", "step"]


def test_fit_train_dataloaders_is_the_loader_given_to_fit_as_configure_model_sees_it() -> None:
    """The loader passed as ``train_dataloaders`` (the same object, before Lightning wraps it); None with a data module
    or the module's own ``train_dataloader``."""
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    class Seen(BoringModel):
        def configure_model(self) -> None:
            self.seen.append(compat.fit_train_dataloaders(self.trainer))

    loader = BoringModel().train_dataloader()
    seen: list = []
    for data in ({"train_dataloaders": loader}, {"datamodule": BoringDataModule()}, {}):
        module = Seen()
        module.seen = seen
        pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=0).fit(module, **data)
    assert seen[0] is loader and seen[1:] == [None, None]


def test_dcp_read_items_cover_one_entry() -> None:
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4, 3]),
                               [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 3]))])
    items = compat.create_read_items("w", md, torch.zeros(4, 3))
    assert len(items) == 1 and items[0].dest_index.fqn == "w" and list(items[0].lengths) == [4, 3]


def test_private_names_are_imported_only_by_compat() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "lightning"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                private += [node.module] if any(part.startswith("_") for part in node.module.split(".")) else []
                if private:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.module} {private}")
    assert not offenders, "import these through lightning_3d.utils.compat:\n" + "\n".join(offenders)


def test_dtensor_sharding_caches_can_be_cleared() -> None:
    """The strategy clears DTensor's sharding caches when it destroys a run's groups (their entries hold meshes that
    compare equal to the next run's); the layouts scenario at world 4 fails without it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import _get_fast_path_sharding_prop_cache_stats

    propagator = DTensor._op_dispatcher.sharding_propagator
    compat.clear_dtensor_caches()
    assert propagator.propagate_op_sharding.cache_info().currsize == 0
    assert propagator._propagate_tensor_meta_cached.cache_info().currsize == 0
    assert len(_get_fast_path_sharding_prop_cache_stats()) == 2  # (hits, misses) of the C++ cache it also clears


def test_torch_ring_attention_loops_and_block_kernels_keep_their_interface() -> None:
    """lightning_3d/context/ring_attention.py calls torch's ring loops with the CPU block kernels and sets its options
    per call; the ring itself is checked against full attention in tests/test_context.py."""
    ring = compat.torch_ring_module()
    assert _params(ring._templated_ring_attention)[:7] == ["group", "seq_dim", "op", "query", "key", "value", "is_causal"]
    assert _params(ring._templated_ring_attention_backward)[:12] == [
        "group", "seq_dim", "op", "grad_out", "grad_out_name", "query", "key", "value", "out", "logsumexp", "is_causal",
        "kwargs"]
    options = ring._cp_options
    assert {"enable_load_balance", "rotate_method", "convert_to_f32"} <= set(vars(options))
    assert hasattr(ring._RotateMethod, "ALL_TO_ALL")
    forward, backward, grad_name = compat.attention_block_ops("cpu", torch.float32)
    q = torch.randn(1, 1, 4, 2)
    out, lse = forward(q, q, q, is_causal=True, dropout_p=0.0, scale=None)
    assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert lse.shape == (1, 1, 4)
    grads = backward(**{grad_name: out}, query=q, key=q, value=q, out=out, logsumexp=lse, dropout_p=0.0, is_causal=True)
    assert [g.shape for g in grads] == [q.shape] * 3


def test_post_accumulate_grad_hooks_run_as_autograd_runs_them() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    (2 * w).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((3,), 2.0))
    compat.run_post_accumulate_grad_hooks(w)  # the private dict torch keeps them in is still there and callable
    assert len(seen) == 2


def test_set_compiled_call_is_what_the_module_runs() -> None:
    """Module.compile's attribute: a module runs the call put there (hooks and names stay the module's)."""
    linear = torch.nn.Linear(2, 2)
    x = torch.randn(3, 2)
    calls = []
    compat.set_compiled_call(linear, lambda *args: calls.append(args) or linear._call_impl(*args))
    assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias)) and len(calls) == 1
    assert [n for n, _ in linear.named_parameters()] == ["weight", "bias"]


def test_functional_collectives_keep_their_signatures() -> None:
    """torch's functional collective ops as compiled tensor-parallel blocks call them: (tensor, op, group name),
    (tensor, group size, group name), (tensor, op, group size, group name), and the wait on a tensor."""
    ops = torch.ops._c10d_functional
    args = {name: [a.name for a in getattr(ops, name).default._schema.arguments]
            for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor")}
    assert args == {"all_reduce": ["input", "reduce_op", "group_name"],
                    "all_gather_into_tensor": ["input", "group_size", "group_name"],
                    "reduce_scatter_tensor": ["input", "reduce_op", "group_size", "group_name"],
                    "wait_tensor": ["tensor"]}, args


def test_flex_attention_device_check_answers_as_torch_would(monkeypatch) -> None:
    """torch's private FlexAttention device check: CPU has no backward (the reason is torch's text), and the probe is
    what the check reads (a tensor that needs gradients, on the device) with no elements (nothing allocated)."""
    from torch.nn.attention import flex_attention as torch_flex

    reason = compat.flex_attention_trains_on(torch.device("cpu"))
    assert reason is not None and "backward on CPU" in reason
    with torch.no_grad():  # the probe needs gradients whatever the caller's grad mode
        assert compat.flex_attention_trains_on(torch.device("cpu")) == reason
    # A device torch's check does not know: its ValueError's text, not an exception.
    assert "only supported on CUDA" in compat.flex_attention_trains_on(torch.device("meta"))
    seen = []
    monkeypatch.setattr(torch_flex, "_validate_device", lambda q, k, v: seen.append((q, k, v)))
    assert compat.flex_attention_trains_on(torch.device("meta")) is None  # torch's check passed: flex trains there
    ((q, k, v),) = seen
    assert q is k is v and q.numel() == 0 and q.requires_grad and q.device.type == "meta"


def test_dtensor_metadata_helpers_build_what_from_local_builds(tmp_path) -> None:
    """Tensor parallelism's local leaves hand their first gradient over as ``DTensor(local, spec)`` with a spec made
    once (``dtensor_spec`` / ``dtensor_with_spec``) and check leaves through ``_local_tensor``
    (``dtensor_local_tensor``): both must stay what ``DTensor.from_local`` / ``to_local`` give, or gradients would
    carry wrong metadata silently."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.randn(4, 3)
        for placements in ((Shard(0),), (Partial(),)):
            shape, stride = torch.Size((4, 3)), (3, 1)
            made = compat.dtensor_with_spec(local, compat.dtensor_spec(mesh, placements, shape, stride, local.dtype))
            reference = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
            assert made._spec == reference._spec and made.placements == reference.placements
            assert made.shape == reference.shape and made.stride() == reference.stride()
            assert made.dtype == reference.dtype and not made.requires_grad
            assert compat.dtensor_local_tensor(made) is local
            with torch.no_grad():
                assert compat.dtensor_local_tensor(reference) is reference.to_local()
    finally:
        if owned:
            dist.destroy_process_group()


def test_async_tp_patterns_are_what_inductor_fuses(tmp_path) -> None:
    """tests/scenarios/async_tp.py: in a compiled sequence-parallel GPT block, inductor's micro-pipeline TP matchers
    find every tensor-parallel collective next to its GEMM, along the sequence (dim 1): forward, the all-gathers
    feeding the fused q/k/v and MLP-up GEMMs and the attention-out and MLP-down GEMMs feeding the reduce-scatters;
    backward, the all-gathers of the output gradients feeding those two row-parallel layers' dgrad GEMMs and the two
    column-parallel dgrad GEMMs feeding the reduce-scatters. And async TP is refused without SP and on gloo, naming
    the fix."""
    from tests.launch import run_scenario

    report = run_scenario(2, "async_tp", [], tmp_path / "report.json", timeout=300)
    for rank, result in enumerate(report["ranks"]):
        fused = [["all_gather", 1, 1]] * 2 + [["reduce_scatter", 1, 1]] * 2
        assert result["patterns"] == [fused, fused], (rank, result["patterns"])  # one graph forward, one backward
        refused = result["refusals"]
        assert "sequence_parallel=False" in refused["no_sp"] and "set sequence_parallel=True" in refused["no_sp"]
        assert "'cpu' with 'gloo'" in refused["cpu"] and "unset L3D_TP_ASYNC" in refused["cpu"], refused
        assert "L3D_TP_ASYNC='on'" in refused["bad_value"] and "or 0" in refused["bad_value"], refused
        assert refused["default_off"] == "False", refused


def _optimizer_state(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"]]


def test_fused_optimizers_skip_a_step_exactly_on_found_inf() -> None:
    """The protocol the lazy non-finite verdict hands its flag over (PipelineEngine.guarded_closure): with found_inf
    1.0 the fused step leaves parameters and state (Adam's step counts included) bit for bit as they were, with 0.0
    it steps exactly as without the attribute, and clear_found_inf removes it."""
    cases = [(torch.optim.AdamW, {"weight_decay": 0.1}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.SGD, {})]
    for cls, kwargs in cases:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
        twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt, twin = cls(params, lr=0.1, fused=True, **kwargs), cls(twins, lr=0.1, fused=True, **kwargs)
        assert compat.skips_on_found_inf(opt), cls
        for step in range(3):
            grads = [torch.randn_like(p) for p in params]
            for p, t, g in zip(params, twins, grads):
                p.grad, t.grad = g.clone(), g.clone()
            if step == 1:  # a bad step: NaN gradients, skipped on the device
                params[0].grad[0, 0] = twins[0].grad[0, 0] = float("nan")
                before, state = [p.detach().clone() for p in params], _optimizer_state(opt)
                compat.set_found_inf(opt, torch.ones(()))
                opt.step()
                compat.clear_found_inf(opt)
                assert not hasattr(opt, "found_inf")
                assert all(torch.equal(a, b) for a, b in zip(before, params)), cls
                after = _optimizer_state(opt)
                assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                           for a, b in zip(state, after)), cls
                for t in twins:  # the twin does not step at all
                    t.grad = None
                continue
            compat.set_found_inf(opt, torch.zeros(()))
            opt.step()
            compat.clear_found_inf(opt)
            twin.step()
            assert all(torch.equal(p, t) for p, t in zip(params, twins)), (cls, step)
        if cls is not torch.optim.SGD:
            assert all(float(opt.state[p]["step"]) == 2 for p in params)  # the skipped step not counted


def test_only_exact_found_inf_skips_are_taken() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]

    class MyAdamW(torch.optim.AdamW):
        pass

    assert compat.skips_on_found_inf(torch.optim.AdamW(p, fused=True))
    assert compat.skips_on_found_inf(torch.optim.SGD(p, lr=0.1, fused=True))
    assert not compat.skips_on_found_inf(torch.optim.AdamW(p))  # foreach / for-loop: found_inf is refused
    assert not compat.skips_on_found_inf(torch.optim.AdamW(p, foreach=True))
    assert not compat.skips_on_found_inf(MyAdamW(p, fused=True))  # a subclass's step may differ
    # SGD's fused step fills the momentum buffer it creates on a skipped first step with empty_like
    assert not compat.skips_on_found_inf(torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True))
    mixed = torch.optim.AdamW(p, fused=True)
    mixed.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "fused": False})
    assert not compat.skips_on_found_inf(mixed)
    scaled = torch.optim.AdamW(p, fused=True)
    scaled.grad_scale = torch.ones(())  # what a GradScaler sets inside its step: not ours to take over
    assert not compat.skips_on_found_inf(scaled)


def test_device_sleep_takes_cycles() -> None:
    # ``device_busy_for`` spins the GPU with ``torch.cuda._sleep(cycles)``: one integer argument, the clock cycles.
    assert _params(torch.cuda._sleep) == ["cycles"]


def test_after_gradient_hooks_judge_what_the_update_reads() -> None:
    """The judge runs inside ``optimizer.step(closure)`` after Lightning's ``on_before_optimizer_step`` hooks and its
    clipping, before the update: it sees a gradient a hook edited and clipped, and what it does to the gradient is
    what the update uses."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    seen = []

    class Edit(pl.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            seen.append("hook")
            for p in module.parameters():
                p.grad.fill_(100.0)  # clipped to norm 1e-3 next, then judged

    class Judged(BoringModel):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    model = Judged()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1e-3,
                         callbacks=[Edit()])

    def judge(optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
        seen.append(round(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))), 6))
        for g in grads:
            g.zero_()  # the update reads this: the parameters must not move

    compat.after_gradient_hooks(trainer.strategy.precision_plugin, judge)
    compat.after_gradient_hooks(trainer.strategy.precision_plugin, judge)  # idempotent: wrapped once
    before = [p.detach().clone() for p in model.parameters()]
    trainer.fit(model)
    assert seen == ["hook", 0.001]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
