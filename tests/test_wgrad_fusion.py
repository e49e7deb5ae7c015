"""Gradient-accumulation fusion (``gradient_accumulation_fusion``): which layers it takes, that training is the same
as autograd's accumulation, that the gradients live in the buckets, and the errors it raises. The multi-process
layouts of tests/test_distributed.py run with it on (``True``: the tiny models' layers are all below the "auto"
threshold) against single-process references."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_3d.distributed.wgrad_fusion as wgrad_fusion
import lightning_3d.recipes.training as training
from lightning_3d import Compressed3DStrategy
from lightning_3d.distributed.grad_sync import GradientSynchronizer
from lightning_3d.distributed.wgrad_fusion import FusedGradLinear, fusable_linears, fuse_gradient_accumulation, unfuse_gradient_accumulation
from lightning_3d.recipes import GPT
from lightning_3d.recipes.data import SyntheticLMDataModule


def fit(fusion: bool | str, precision: str = "32-true", steps: int = 3, **gpt) -> tuple[GPT, list[float], list[dict], list]:
    """Train the tiny GPT on one process; the model, the losses, each step's gradients (before the optimizer) and
    where the fused weights' gradients lived then: (their storages, the synchronizer's bucket buffers)."""
    losses: list[float] = []
    grads: list[dict] = []
    layouts: list[tuple[set[int], set[int]]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            grads.append({n: p.grad.detach().clone() for n, p in module.named_parameters()})
            fused = [m.weight.grad for m in module.modules() if isinstance(m, FusedGradLinear)]
            buckets = trainer.strategy.engine.grad_sync.buckets
            layouts.append(({g.untyped_storage().data_ptr() for g in fused},
                            {b.buffer.data_ptr() for b in buckets if b.buffer is not None}))

    torch.manual_seed(0)
    model = GPT("tiny", vocab_size=512, seq_length=32, **gpt)
    data = SyntheticLMDataModule(vocab_size=512, seq_length=32, batch_size=4, num_samples=64)
    strategy = Compressed3DStrategy(num_microbatches=2, gradient_accumulation_fusion=fusion)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[Record()])
    trainer.fit(model, datamodule=data)
    # Counted now: the next run with a new model undoes the fusion of this one (PipelineEngine.release).
    fused = sum(isinstance(m, FusedGradLinear) for m in model.modules())
    return model, losses, grads, layouts, fused


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fused_accumulation_trains_like_autograd(precision: str) -> None:
    fused_model, fused_losses, fused_grads, _, fused = fit(True, precision)
    plain_model, plain_losses, plain_grads, plain_layouts, plain_fused = fit(False, precision)
    assert plain_layouts == [(set(), set())] * 3
    layers = fused_model.config.num_layers
    assert fused == 6 * layers  # q, k, v, attention proj, fc, mlp proj per block; the tied head is left alone
    assert plain_fused == 0
    assert not any(isinstance(m, FusedGradLinear) for m in fused_model.modules())  # undone when the next run began
    assert type(fused_model.model.head) is type(plain_model.model.head)
    assert list(fused_model.state_dict()) == list(plain_model.state_dict())  # the slots are not checkpointed
    # Off the GPU the fused op computes what autograd does (product in the input dtype, then cast and add); only the
    # bias gradient's summation order differs.
    tolerance = dict(rtol=1e-5, atol=1e-7) if precision == "32-true" else dict(rtol=1e-2, atol=1e-5)
    assert torch.allclose(torch.tensor(fused_losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    for step_fused, step_plain in zip(fused_grads, plain_grads, strict=True):
        for name, grad in step_plain.items():
            assert torch.allclose(step_fused[name], grad, **tolerance), name
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_fused_gradients_are_views_of_one_bucket_and_compile_keeps_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training, "COMPILE_BACKEND", "aot_eager")
    _, losses, grads, layouts, _ = fit(True, steps=2, compile=True)
    _, eager_losses, eager_grads, _, _ = fit(True, steps=2)
    assert torch.allclose(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    for name, grad in eager_grads[-1].items():
        assert torch.allclose(grads[-1][name], grad, rtol=1e-4, atol=1e-7), name
    # At every optimizer step all fused weights' .grad lived in the one bucket buffer (the tiny model's weights fit one
    # 25 MB bucket), the same buffer each step: nothing was copied into or out of a bucket, nothing allocated anew.
    storages, buffers = layouts[0]
    assert len(buffers) == 1 and storages == buffers and layouts == [layouts[0]] * 2


def test_auto_fuses_exactly_the_weights_at_or_above_the_threshold(caplog: pytest.LogCaptureFixture) -> None:
    """``"auto"`` fuses a weight of exactly FUSION_MIN_ELEMENTS (2**23) elements and none below it (one just below,
    small ones); ``True`` every fusable layer, ``False`` none; the log says how many were fused and left out."""
    assert wgrad_fusion.FUSION_MIN_ELEMENTS == 2**23
    for mode, fused_names in (("auto", ["0"]), (True, ["0", "1", "2", "3"]), (False, [])):
        # 2048 x 4096 = 2**23 elements; 4095 x 2048 = 2**23 - 2048; the head is tied to the embedding (not fusable).
        stage = nn.Sequential(nn.Linear(2048, 4096, bias=False), nn.Linear(2048, 4095), nn.Linear(16, 16),
                              nn.Linear(16, 8))
        strategy = Compressed3DStrategy(gradient_accumulation_fusion=mode)
        caplog.clear()
        with caplog.at_level("INFO"):
            strategy.engine.fuse_gradient_accumulation({0: stage}, tp=1)
        assert [name for name, m in stage.named_children() if type(m) is FusedGradLinear] == fused_names, mode
        assert all(type(m) is nn.Linear for name, m in stage.named_children() if name not in fused_names)
        assert strategy.engine.fused_weights == [stage[int(n)].weight for n in fused_names]
        wgrad_fusion.unfuse_gradient_accumulation(strategy.engine.fused_weights)
        if mode == "auto":
            assert ("gradient_accumulation_fusion='auto' on 1 nn.Linear weights of this rank's stages; 3 left unfused"
                    f" (fewer than {2**23} elements") in caplog.text
        elif mode:
            assert "gradient_accumulation_fusion on 4 nn.Linear weights" in caplog.text
        else:
            assert "gradient_accumulation_fusion" not in caplog.text


@pytest.mark.parametrize("value", ["on", 1, None, "True"])
def test_a_bad_fusion_value_is_refused_naming_it(value) -> None:
    with pytest.raises(ValueError, match=rf"`gradient_accumulation_fusion={value!r}` must be True \(every fusable"
                                         r" nn.Linear\), False \(none\) or 'auto'"):
        Compressed3DStrategy(gradient_accumulation_fusion=value)
    assert Compressed3DStrategy().options.gradient_accumulation_fusion == "auto"


def test_auto_with_fused_and_unfused_layers_in_one_stage_trains_like_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under "auto" a stage mixes fused weights (in their fp32 bucket) with unfused ones (autograd's accumulation,
    in the other buckets). The threshold is moved to the tiny GPT's MLP weights (128 x 512) so that the mix is cheap
    on the CPU: fc and proj fused, q/k/v and the attention projection not. Same tolerance as the all-fused check
    (fp32 on the CPU: the same products; the bias gradients' summation order differs)."""
    monkeypatch.setattr(wgrad_fusion, "FUSION_MIN_ELEMENTS", 128 * 512)
    auto_model, auto_losses, auto_grads, auto_layouts, fused = fit("auto")
    _, plain_losses, plain_grads, _, _ = fit(False)
    assert fused == 2 * auto_model.config.num_layers
    storages, buffers = auto_layouts[0]
    assert len(storages) == 1 and storages == buffers  # the fused gradients in one fp32 bucket of their own
    assert torch.allclose(torch.tensor(auto_losses), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    for step_auto, step_plain in zip(auto_grads, plain_grads, strict=True):
        for name, grad in step_plain.items():
            assert torch.allclose(step_auto[name], grad, rtol=1e-5, atol=1e-7), name


def test_fusable_linears_skips_what_it_cannot_fuse() -> None:
    tied = nn.Embedding(8, 4)
    head = nn.Linear(4, 8, bias=False)
    head.weight = tied.weight  # a weight shared with another module gets gradient from both
    bf16 = nn.Linear(4, 4).to(torch.bfloat16)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    excluded, plain = nn.Linear(4, 4), nn.Linear(4, 4)

    class Sub(nn.Linear):
        pass

    model = nn.ModuleList([tied, head, bf16, frozen, excluded, plain, Sub(4, 4)])
    assert fusable_linears(model, exclude={id(excluded.weight)}) == [plain]
    fuse_gradient_accumulation([plain])
    assert type(plain) is FusedGradLinear and fusable_linears(model, exclude={id(excluded.weight)}) == [plain]


def test_plain_modules_and_tensor_parallel_are_told_it_does_not_apply(caplog: pytest.LogCaptureFixture) -> None:
    """Told when the option was chosen (True); the default "auto" says nothing where it fuses nothing."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    for mode in ("auto", True):
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(gradient_accumulation_fusion=mode),
                             max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0)
        caplog.clear()
        with caplog.at_level("INFO"):
            trainer.fit(BoringModel())
        assert ("BoringModel's gradients accumulate as autograd's" in caplog.text) is (mode is True), mode
        assert ("gradient_accumulation_fusion" in caplog.text) is (mode is True), (mode, caplog.text)
    assert not any(isinstance(m, FusedGradLinear) for m in trainer.lightning_module.modules())
    stage = nn.Sequential(nn.Linear(4, 4))
    caplog.clear()
    with caplog.at_level("INFO"):
        Compressed3DStrategy().engine.fuse_gradient_accumulation({0: stage}, tp=2)  # "auto": silent
    assert "gradient_accumulation_fusion" not in caplog.text
    strategy = Compressed3DStrategy(gradient_accumulation_fusion=True)
    with caplog.at_level("INFO"):
        strategy.engine.fuse_gradient_accumulation({0: stage}, tp=2)
    assert "does not apply with tensor_parallel_size > 1" in caplog.text and type(stage[0]) is nn.Linear
    strategy.engine.fuse_gradient_accumulation({0: stage}, tp=1)
    assert type(stage[0]) is FusedGradLinear and strategy.engine.fused_weights == [stage[0].weight]


def test_grad_sync_hooks_only_where_work() -> None:
    """A post-accumulate-grad hook is a Python call per parameter and micro-batch: the synchronizer registers one only
    where it has work. One replica of plain tensors: none (``finish`` still runs); several replicas: every parameter
    but the fused weights (their op reports instead)."""
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    params = [p for layer in layers for p in layer.parameters()]
    hooked = lambda: [bool(getattr(p, "_post_accumulate_grad_hooks", None)) for p in params]  # noqa: E731
    alone = GradientSynchronizer({0: params}, None, 1)
    assert hooked() == [False] * 4
    alone.begin(sync=True)
    sum(layer(torch.ones(2, 4)).sum() for layer in layers).backward()
    alone.finish()  # no hook ran; the step still completes and leaves the gradients as autograd wrote them
    assert all(p.grad is not None for p in params)
    alone.remove_hooks()
    fused = fuse_gradient_accumulation([layers[0]])
    replicas = GradientSynchronizer({0: params}, None, 2, fused=fused)
    try:
        assert hooked() == [False, True, True, True]  # layers[0].weight is fused: its slot reports, no hook
    finally:
        replicas.remove_hooks()
        unfuse_gradient_accumulation(fused)
    assert hooked() == [False] * 4


def test_a_layer_called_twice_after_its_bucket_left_raises() -> None:
    layer = nn.Linear(4, 4)
    weights = fuse_gradient_accumulation([layer])
    sync = GradientSynchronizer({0: [layer.weight, layer.bias]}, None, 1, fused=weights)
    try:
        bucket = sync._bucket_of[id(layer.weight)]
        bucket.work = object()  # as if the bucket's all-reduce had been launched
        with pytest.raises(RuntimeError, match=r"more than once per forward.*gradient_accumulation_fusion=False"):
            sync._on_grad_ready(layer.weight)
        sync._syncing = True  # the op's report reaches the same check in a step that synchronises
        with pytest.raises(RuntimeError, match=r"more than once per forward.*gradient_accumulation_fusion=False"):
            sync._on_fused_accumulated(layer.weight)
    finally:
        sync.remove_hooks()


def test_no_accumulation_in_a_backward_raises() -> None:
    layer = nn.Linear(4, 4)
    sync = GradientSynchronizer({0: [layer.weight]}, None, 1, fused=fuse_gradient_accumulation([layer]))
    try:
        sync.begin(sync=False)
        with pytest.raises(RuntimeError, match="compiler dropped the fused accumulation"):
            sync.finish()
        layer(torch.randn(3, 4)).sum().backward()
        sync.finish()  # one accumulation happened: no error
        assert layer.weight.grad.data_ptr() == layer.grad_slot.data_ptr()
    finally:
        sync.remove_hooks()


def test_backward_after_teardown_says_why() -> None:
    model, _, _, _, _ = fit(True, steps=1)
    with pytest.raises(RuntimeError, match="without a registered gradient slot"):
        model.model(torch.randint(0, 512, (1, 8))).sum().backward()


def test_a_slot_of_its_own_follows_the_layer_when_it_moves_and_a_bucket_view_does_not() -> None:
    """``.to()`` gives the slot buffer a new address (the profiler moves layers between the CPU and the GPU): a
    standalone slot's registration moves with it; a bucket view's is dropped, so the backward names the cause instead
    of writing into the old address. ``_apply`` with a copy stands in for a device move on a CPU-only machine."""
    from lightning_3d.distributed.wgrad_fusion import _SLOTS, register_slot, unfuse_gradient_accumulation

    torch.manual_seed(0)
    layer, plain = nn.Linear(4, 3), nn.Linear(4, 3)
    plain.load_state_dict(layer.state_dict())
    (weight,) = fuse_gradient_accumulation([layer])
    register_slot(weight, torch.zeros_like(weight), None)
    try:
        old = layer.grad_slot.data_ptr()
        layer._apply(lambda t: t.clone())  # every buffer (and parameter data) to a new tensor, as a device move does
        assert layer.grad_slot.data_ptr() != old and old not in _SLOTS
        x = torch.randn(5, 4)
        layer(x).square().sum().backward()
        plain(x).square().sum().backward()
        assert layer.weight.grad.data_ptr() == layer.grad_slot.data_ptr()
        torch.testing.assert_close(layer.weight.grad, plain.weight.grad, rtol=0, atol=0)  # fp32 on CPU: same GEMM
    finally:
        unfuse_gradient_accumulation([weight])

    bucket_layer = nn.Linear(4, 4)
    sync = GradientSynchronizer({0: [bucket_layer.weight]}, None, 1,
                                fused=fuse_gradient_accumulation([bucket_layer]))
    try:
        bucket_layer._apply(lambda t: t.clone())
        with pytest.raises(RuntimeError, match="moved to another device or dtype after the strategy laid"):
            bucket_layer(torch.randn(3, 4)).sum().backward()
    finally:
        sync.remove_hooks()


def test_the_op_is_autograd_accumulation_over_every_leading_dimension() -> None:
    """The op as the layer calls it (output gradient and input with leading batch and sequence dimensions, flattened
    into tokens by the layer's backward): the first micro-batch writes the slot and makes it ``weight.grad``, later
    ones add to it, and a gradient someone else put in ``weight.grad`` is added to instead; the report comes once per
    call. Against autograd's own accumulation of ``nn.Linear``: the same products, in fp32 on the CPU, up to the
    GEMM's summation order over the tokens and the rounding of the add into the running sum (per micro-batch and
    element 2·(n + 1)·u·Σ|terms|, n = tokens, u = fp32 unit roundoff)."""
    from lightning_3d.distributed.wgrad_fusion import register_slot, unfuse_gradient_accumulation

    torch.manual_seed(0)
    layer, plain = nn.Linear(6, 5), nn.Linear(6, 5)
    plain.load_state_dict(layer.state_dict())
    (weight,) = fuse_gradient_accumulation([layer])
    reports: list[nn.Parameter] = []
    register_slot(weight, torch.full_like(weight, float("nan")), reports.append)  # the first write must not read it
    try:
        inputs = [torch.randn(2, 3, 6), torch.randn(4, 6), torch.randn(1, 2, 2, 6)]
        bound = torch.zeros_like(weight, dtype=torch.float64)
        for x in inputs:
            for m in (layer, plain):
                m(x).square().sum().backward()
            g = 2 * plain(x).detach().reshape(-1, 5).double()  # d(sum y^2)/dy, for the bound's Σ|terms|
            bound += 2 * (g.shape[0] + 1) * 2.0**-24 * (g.abs().t() @ x.reshape(-1, 6).double().abs())
        assert layer.weight.grad.data_ptr() == layer.grad_slot.data_ptr() and len(reports) == len(inputs)
        assert reports[0] is weight
        assert ((layer.weight.grad.double() - plain.weight.grad.double()).abs() <= bound).all()
        other = torch.zeros_like(weight)
        layer.weight.grad = other  # not the slot: the op adds there and leaves the slot alone
        slot_before = layer.grad_slot.clone()
        layer(inputs[0]).square().sum().backward()
        assert layer.weight.grad is other and other.abs().sum() > 0
        torch.testing.assert_close(layer.grad_slot, slot_before, rtol=0, atol=0)
    finally:
        unfuse_gradient_accumulation([weight])


def test_t5_compiled_per_stage_trains_with_fusion_as_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """The T5 recipe compiled per stage (the one-GPU speed configuration, here with the aot_eager backend): the
    op stays in the stage's compiled backward (one graph for the stage, one for the loss, no graph break), every fused
    layer reports once per micro-batch, and the gradients equal the unfused run's (fp32 on the CPU: the same products,
    up to summation order)."""
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader

    from lightning_3d.recipes import T5

    monkeypatch.setattr(training, "COMPILE_BACKEND", "aot_eager")
    runs = {}
    for fusion in (True, False):
        torch._dynamo.reset()
        counters.clear()
        grads: list[dict] = []
        counts: list[int] = []

        class Record(pl.Callback):
            def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
                grads.append({n: p.grad.detach().clone() for n, p in module.named_parameters()})
                counts.append(trainer.strategy.engine.grad_sync._fused_accumulations)

        torch.manual_seed(0)
        model = T5("tiny", vocab_size=256, num_layers=1, hidden_size=32, num_heads=2, head_dim=16, ffn_hidden_size=64,
                   compile=True, compile_scope="stage", attention="sdpa")
        g = torch.Generator().manual_seed(0)
        data = DataLoader([{"input_ids": torch.randint(2, 256, (12,), generator=g),
                            "labels": torch.randint(2, 256, (6,), generator=g)} for _ in range(8)], batch_size=4)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                             strategy=Compressed3DStrategy(num_microbatches=2, gradient_accumulation_fusion=fusion),
                             callbacks=[Record()])
        trainer.fit(model, train_dataloaders=data)
        assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters)
        runs[fusion] = grads, counts
    (fused, fused_counts), (plain, plain_counts) = runs[True], runs[False]
    # one encoder block (q, k, v, o, wi, wo) and one decoder block (+ cross-attention's q, k, v, o), 2 micro-batches
    assert fused_counts == [2 * 16] * 2 and plain_counts == [0, 0]
    for step_fused, step_plain in zip(fused, plain, strict=True):
        for name, grad in step_plain.items():
            torch.testing.assert_close(step_fused[name], grad, rtol=1e-5, atol=1e-7, msg=name)
