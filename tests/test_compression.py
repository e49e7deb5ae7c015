"""Compression building blocks in one process: CB + LEP codec, SC (against PyTorch's PowerSGD), options and errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_3d import Compressed3DStrategy
from lightning_3d.compression.backprop import CompressedBackprop, CompressedBackpropConfig, compression_ratio
from lightning_3d.compression.config import CompressionConfig
from lightning_3d.compression.lowrank import orthonormalize
from lightning_3d.compression.selective import DataParallelPowerSGD
from lightning_3d.pipeline.codec import BoundaryKey
from lightning_3d.utils.comm_stats import CommunicationStats


def codec(**kw) -> CompressedBackprop:
    """Compresses every send with LEP unless told otherwise (the library defaults: cool-down sends only, no LEP)."""
    return CompressedBackprop(CompressedBackpropConfig(**{"rank": 4, "min_compression_ratio": 0.0, "epilogue_only": False,
                                                          "lazy_error_propagation": True, **kw}))


def roundtrip(c: CompressedBackprop, grad: torch.Tensor, key: BoundaryKey) -> torch.Tensor:
    meta = (tuple(grad.shape), grad.dtype)
    parts = c.encode(grad, key)
    assert [tuple(p.shape) for p in parts] == [m[0] for m in c.message_metas(meta, key)]
    return c.decode(parts, meta, key)


def test_power_step_factors_and_warm_start() -> None:
    g = torch.randn(2, 8, 16)
    c = codec()
    key = BoundaryKey(stage=1, microbatch=0, epilogue=False)
    p, q = c.encode(g, key)
    assert p.shape == (16, 4) and q.shape == (16, 4)
    assert torch.allclose(p.t() @ p, torch.eye(4), atol=1e-5)  # P is orthonormal
    assert torch.equal(c.q_memory[(1, 0)], q)  # the next call starts from this Q
    # P·Qᵀ is the projection of M (+ error) onto span(P): the best rank-4 fit in that subspace.
    m = g.reshape(-1, 16)
    assert torch.allclose(p @ q.t(), p @ (p.t() @ m), atol=1e-5)


def test_full_rank_is_exact_and_low_rank_is_not() -> None:
    g = torch.randn(3, 5, 8)
    exact = roundtrip(codec(rank=8, lazy_error_propagation=False), g, BoundaryKey(1, 0, False))
    assert ((exact - g).norm() / g.norm()).item() < 1e-5
    lossy = roundtrip(codec(rank=2, lazy_error_propagation=False), g, BoundaryKey(1, 0, False))
    assert ((lossy - g).norm() / g.norm()).item() > 0.1


def test_lep_stores_exactly_the_residual_and_adds_it_to_the_next_microbatch() -> None:
    c = codec()
    g1, g2 = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    rebuilt1 = roundtrip(c, g1, BoundaryKey(1, 0, False))
    e1 = c.errors[(1, 0)].clone()
    assert torch.equal(e1, g1 - rebuilt1)  # e = M' - P·Qᵀ (M' = M on the first call)
    q_before = c.q_memory[(1, 0)].clone()
    p2, q2 = c.encode(g2, BoundaryKey(1, 1, False))
    m2 = (g2 + e1).reshape(-1, 16)  # the second call compressed M + e
    p_expected = orthonormalize(m2 @ q_before)
    assert torch.allclose(p2, p_expected, atol=1e-5)
    assert torch.allclose(c.errors[(1, 0)].reshape(-1, 16), m2 - p2 @ q2.t(), atol=1e-6)


def test_lep_grid_keeps_error_outside_a_smaller_microbatch() -> None:
    c = codec()
    big = torch.randn(2, 8, 16)
    roundtrip(c, big, BoundaryKey(1, 0, False))
    kept = c.errors[(1, 0)][:, 4:].clone()  # positions the next, shorter micro-batch does not cover
    small = torch.randn(2, 4, 16)
    roundtrip(c, small, BoundaryKey(1, 1, False))
    assert c.errors[(1, 0)].shape == (2, 8, 16)
    assert torch.equal(c.errors[(1, 0)][:, 4:], kept)
    larger = torch.randn(3, 8, 16)  # a bigger one grows the grid; old error stays in place, new rows start at zero
    before = c.errors[(1, 0)].clone()
    c._error_region((1, 0), (3, 8, 16), big.device)
    assert torch.equal(c.errors[(1, 0)][:2], before) and torch.equal(c.errors[(1, 0)][2], torch.zeros(8, 16))
    roundtrip(c, larger, BoundaryKey(1, 2, False))


def test_epilogue_only_and_min_ratio_decide_on_both_ends() -> None:
    g = torch.randn(2, 8, 16)
    c = codec(epilogue_only=True)
    assert c.encode(g, BoundaryKey(1, 0, epilogue=False)) == [g]
    assert len(c.encode(g, BoundaryKey(1, 1, epilogue=True))) == 2
    assert c.compressed_sends == {1: 1}
    tiny = torch.randn(1, 2, 16)  # 2 x 16 at rank 2 saves nothing: sent as is when the ratio is below 2
    strict = CompressedBackprop(CompressedBackpropConfig(rank=4, epilogue_only=False, min_compression_ratio=2.0))
    assert compression_ratio(2, 16, 2) < 2.0
    assert strict.message_metas(((1, 2, 16), torch.float32), BoundaryKey(1, 0, False)) == [((1, 2, 16), torch.float32)]
    assert strict.encode(tiny, BoundaryKey(1, 0, False)) == [tiny]


def test_powersgd_warmup_is_plain_averaging_then_compresses(tmp_path) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    stats = CommunicationStats()
    sc = DataParallelPowerSGD(dist.group.WORLD, rank=2, warmup_steps=2, min_compression_rate=1.0, stats=stats)
    shapes = [torch.Size([16, 8]), torch.Size([8])]
    for step in range(3):
        flat = torch.randn(136)
        original = flat.clone()
        result = sc.launch(0, flat, shapes, is_last=True).wait()
        if step < 2:
            assert torch.equal(result, original)  # warm-up: an exact (one-rank) average
        else:
            assert not torch.equal(result[:128], original[:128])  # rank-2 approximation of the 16x8 matrix
            assert torch.equal(result[128:], original[128:])  # 1-D tensors are sent exactly
    last = stats.as_dict()["dp_gradients"]
    assert last["bytes_before"] == 3 * 136 * 4
    assert last["bytes_after"] == 2 * 136 * 4 + ((16 + 8) * 2 + 8) * 4
    dist.destroy_process_group()


@pytest.mark.parametrize("adjacent", [False, True], ids=["interleaved-shapes", "same-shapes-adjacent"])
def test_powersgd_equals_torch_hook_step_by_step(tmp_path, adjacent: bool) -> None:
    """Our SC is PyTorch's PowerSGD (batched by shape: warm-up, error feedback, warm start, exact small tensors)
    with a different orthonormalisation; the averaged gradients and the error feedback agree at every step.
    Adjacent same-shape matrices (the synchronizer's SC bucket layout) are computed in place on views of the bucket
    and its error buffer; interleaved ones on a stacked copy."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    from benchmarks.compression.sc_kernels import TorchBucket  # DDP's GradBucket as the hook reads it

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    shapes = [torch.Size([48, 40]), torch.Size([40]), torch.Size([48, 40]), torch.Size([40, 2, 8]), torch.Size([6, 4])]
    if adjacent:
        shapes[1], shapes[2] = shapes[2], shapes[1]
    theirs = PowerSGDState(dist.group.WORLD, matrix_approximation_rank=4, start_powerSGD_iter=2,
                           min_compression_rate=2.0, use_error_feedback=True, warm_start=True, random_seed=5,
                           batch_tensors_with_same_shape=True)
    ours = DataParallelPowerSGD(dist.group.WORLD, rank=4, warmup_steps=2, min_compression_rate=2.0, seed=5)
    total = sum(s.numel() for s in shapes)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(total, generator=generator)
    for step in range(6):
        flat = base + 0.3 * torch.randn(total, generator=generator)  # correlated steps: warm start matters
        expected = powerSGD_hook(theirs, TorchBucket(0, flat.clone(), shapes, is_last=True)).wait()
        got = ours.launch(0, flat.clone(), shapes, is_last=True).wait()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        if step >= 2:
            torch.testing.assert_close(ours.state.error_dict[0], theirs.error_dict[0], rtol=1e-4, atol=5e-5)
            one_d = slice(3840, 3880) if adjacent else slice(1920, 1960)
            assert not torch.equal(got[:1920], flat[:1920])  # compressed: a rank-4 approximation, not the input
            assert torch.equal(got[one_d], flat[one_d])  # the 1-D tensor travels exactly
    assert ours.state.iter == theirs.iter == 6
    dist.destroy_process_group()


@pytest.mark.parametrize("precision,flag", [("tf32", "tf32"), ("fp32", "ieee")])
def test_powersgd_products_run_at_the_chosen_precision_and_orthonormalisation_in_ieee(
        tmp_path, monkeypatch, precision: str, flag: str) -> None:
    """SC's bulk products (every ``torch.bmm``, in place and on stacked copies) run under the CUDA fp32 flag asked for;
    the Cholesky-QR always under IEEE fp32, even when the user allowed TF32; the user's setting is restored after.
    Error feedback keeps input minus exactly what was applied."""
    from lightning_3d.compression import lowrank

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    seen: dict[str, set[str]] = {"bmm": set(), "orthonormalize": set()}
    real_bmm, real_qr = torch.bmm, lowrank._cholesky_qr

    def bmm(*args, **kwargs):
        seen["bmm"].add(torch.backends.cuda.matmul.fp32_precision)
        return real_bmm(*args, **kwargs)

    def cholesky_qr(a, shift):
        seen["orthonormalize"].add(torch.backends.cuda.matmul.fp32_precision)
        return real_qr(a, shift)

    monkeypatch.setattr(torch, "bmm", bmm)
    monkeypatch.setattr(lowrank, "_cholesky_qr", cholesky_qr)
    sc = DataParallelPowerSGD(dist.group.WORLD, rank=2, warmup_steps=0, min_compression_rate=1.0,
                              matmul_precision=precision)
    # 16x8 twice side by side (computed in place), 12x8 twice apart (computed on a stacked copy), 1-D exact
    shapes = [torch.Size(s) for s in ([16, 8], [16, 8], [8], [12, 8], [8], [12, 8])]
    torch.set_float32_matmul_precision("high")  # a user who allowed TF32 everywhere
    try:
        flat = torch.randn(sum(s.numel() for s in shapes))
        original = flat.clone()
        result = sc.launch(0, flat, shapes, is_last=True).wait()
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision("highest")
    assert seen == {"bmm": {flag}, "orthonormalize": {"ieee"}}
    assert not torch.equal(result, original)
    torch.testing.assert_close(result + sc.state.error_dict[0], original, rtol=0, atol=1e-6)
    dist.destroy_process_group()


def test_orthonormalize_spans_like_qr_also_when_rank_deficient() -> None:
    torch.manual_seed(0)
    a = torch.randn(4, 300, 16)
    a[1] *= torch.logspace(0, -3, 16)  # condition number 1e3: one Cholesky-QR pass would not be orthonormal
    a[2, :, 5] = a[2, :, 3]  # rank 15
    a[3] = 0  # rank 0
    q = orthonormalize(a)
    for i in range(4):  # always orthonormal: dependent columns are completed, as Householder QR completes them
        torch.testing.assert_close(q[i].T @ q[i], torch.eye(16), atol=1e-5, rtol=0)
    for i in range(3):  # and the span contains every column of a
        torch.testing.assert_close(q[i] @ q[i].T @ a[i], a[i], atol=1e-4, rtol=1e-4)
    for i in range(2):
        householder = torch.linalg.qr(a[i]).Q
        torch.testing.assert_close(q[i] @ q[i].T, householder @ householder.T, atol=1e-5, rtol=0)


def test_orthonormalize_never_breaks_down_on_gradient_like_factors() -> None:
    """Low-rank factors with fast-decaying spectra at any magnitude (what a power step sees: a gradient of low rank, a
    warm start left by one, fp32 values from 1e-20 to 1e20). Cholesky broke down on such Gram matrices and returned
    NaN, which error feedback then kept forever (GPT-125M training went NaN on the step SC began); now the result is
    always finite, orthonormal and spans the input."""
    generator = torch.Generator().manual_seed(1)
    for case in range(300):  # 0.8 s on CPU
        r = (16, 128)[case % 2]
        k = int(torch.randint(1, r + 1, (), generator=generator))
        spectrum = torch.logspace(0, -float(torch.randint(2, 12, (), generator=generator)), k)
        p = (torch.randn(512, k, generator=generator) * spectrum) @ torch.randn(k, r, generator=generator)
        p *= 10.0 ** float(torch.randint(-20, 21, (), generator=generator))
        q = orthonormalize(p)
        assert torch.isfinite(q).all(), case
        torch.testing.assert_close(q.T @ q, torch.eye(r), atol=1e-4, rtol=0)
        assert (p - q @ (q.T @ p)).norm() <= 1e-3 * p.norm(), case


def test_full_rank_power_step_is_exact_after_a_rank_deficient_warm_start() -> None:
    """A warm-started Q of low rank (left by an earlier, low-rank gradient) must not trap the power iteration in a
    smaller span: at full rank, P·(MᵀP)ᵀ rebuilds M exactly."""
    torch.manual_seed(0)
    m = torch.randn(64, 96)
    q_low_rank = torch.randn(96, 20) @ torch.randn(20, 64)
    p = orthonormalize(m @ q_low_rank)
    torch.testing.assert_close(p @ (m.T @ p).T, m, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(cb_rank=0), "`cb_rank=0` must be a positive integer"),
        (dict(sc_rank=-3), "`sc_rank=-3` must be a positive integer"),
        (dict(pipeline_parallel_size=2, num_microbatches=2, compressed_stages=[0, 2]), r"has \[2\] outside \[0, 2\)"),
        (dict(compressed_stages=[-1]), r"has \[-1\] outside \[0, 1\)"),
        (dict(sc_warmup=1.5), "`sc_warmup=1.5` must be a number of steps"),
        (dict(cb_min_compression_ratio=-1.0), "must be >= 0"),
        (dict(sc_matmul_precision="bf16"), "`sc_matmul_precision='bf16'` must be 'tf32'"),
        (dict(sc_max_link_gbps=0), r"`sc_max_link_gbps=0` must be a bandwidth in GB/s > 0"),
        (dict(cb_max_link_gbps=-5.0), r"`cb_max_link_gbps=-5.0` must be a bandwidth in GB/s > 0"),
        (dict(compressed_backprop="yes"), r"`compressed_backprop='yes'` must be 'auto' .*True \(always\) or False"),
    ],
)
def test_bad_compression_options(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Compressed3DStrategy(**kwargs)


def test_defaults_and_options_without_traffic() -> None:
    cfg = CompressionConfig()
    assert cfg.enabled and cfg.stages_to_compress(4) == {0, 1, 2} and cfg.stages_to_compress(1) == {0}
    assert cfg.warmup_steps(1000) == 100 and CompressionConfig(sc_warmup=7).warmup_steps(1000) == 7
    assert CompressionConfig().unused_options(dp=1, pp=1, tied=True) == []  # defaults never nag
    notes = CompressionConfig(cb_rank=8, sc_rank=64).unused_options(dp=1, pp=1, tied=True)
    assert notes == ["cb_rank has no effect: compressed backpropagation needs pipeline_parallel_size > 1",
                     "sc_rank has no effect: selective stage compression needs data_parallel_size > 1"]
    assert CompressionConfig(enabled=False, cb_rank=8, sc_warmup=3).unused_options(dp=2, pp=2, tied=True) == [
        "cb_rank, sc_warmup have no effect: compression=False turns compression off"]
    assert CompressionConfig(compressed_backprop=False, cb_rank=8, cb_epilogue_only=False).unused_options(
        dp=2, pp=2, tied=True) == ["cb_epilogue_only, cb_rank have no effect: compressed_backprop=False"]
    assert CompressionConfig(compressed_stages=[], sc_rank=8).unused_options(dp=2, pp=2, tied=True) == [
        "sc_rank has no effect: compressed_stages=[]"]
    assert CompressionConfig(compressed_stages=[0], sc_max_link_gbps=10.0).unused_options(dp=2, pp=2, tied=True) == [
        "sc_max_link_gbps has no effect: compressed_stages names the stages, so no link is measured"]


def test_sc_by_default_only_below_the_link_threshold() -> None:
    cfg = CompressionConfig(sc_max_link_gbps=50.0)
    assert not cfg.compresses_on_link(None)  # never measured: no SC
    assert cfg.compresses_on_link(25.0) and not cfg.compresses_on_link(50.0) and not cfg.compresses_on_link(300.0)
    assert CompressionConfig(compressed_stages=[0]).compresses_on_link(300.0)  # named stages: whatever the link
    assert CompressionConfig(sc_max_link_gbps=float("inf")).compresses_on_link(1e6)


def test_checkpointed_sc_state_without_sc_is_reported_not_silently_dropped() -> None:
    s = Compressed3DStrategy(data_parallel_size=2, compression=False)
    with pytest.warns(UserWarning, match="holds selective-compression state.*compression is off.*dropped"):
        s.load_rank_state_dict({"selective_compression": {"iter": 3}})


def test_options_for_traffic_the_topology_lacks_warn_once(recwarn) -> None:
    import lightning.pytorch as pl

    from lightning_3d.recipes import GPT

    trainer = pl.Trainer(accelerator="cpu", devices=1,
                         strategy=Compressed3DStrategy(compression=CompressionConfig(cb_rank=8, compressed_stages=[0])),
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    data = [{"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long)}]
    trainer.fit(GPT("tiny", vocab_size=64, seq_length=8), torch.utils.data.DataLoader(data, batch_size=None))
    messages = [str(w.message) for w in recwarn if "Compressed3DStrategy:" in str(w.message)]
    assert len(messages) == 1
    assert messages == ["Compressed3DStrategy: cb_rank has no effect: compressed backpropagation needs"
                        " pipeline_parallel_size > 1; compressed_stages has no effect: selective stage compression needs"
                        " data_parallel_size > 1."]
    torch.distributed.destroy_process_group()


def test_sc_stage_is_one_bucket_with_same_shapes_adjacent() -> None:
    """SC's cost is per shape group, so a compressed stage is one bucket (whatever ``bucket_size_mb``) whose
    same-shape matrices lie side by side (the compressor then works on views, in place); other stages keep
    size-capped buckets in reverse registration order."""
    from torch import nn

    from lightning_3d.distributed.grad_sync import GradientSynchronizer

    def stage() -> list[nn.Parameter]:
        return [nn.Parameter(torch.zeros(shape)) for shape in ((8, 4), (8,), (6, 4), (8, 4), (6, 4), (8,))]

    compressed, exact = stage(), stage()
    sync = GradientSynchronizer({0: compressed, 1: exact}, dp_group=None, dp_size=1, bucket_size_mb=130 / 2**20,
                                compressed_stages={0})
    try:
        by_stage = {s: [b.params for b in sync.buckets if b.stage == s] for s in (0, 1)}
        assert len(by_stage[0]) == 1
        shapes = [tuple(p.shape) for p in by_stage[0][0]]
        assert shapes == [(8,), (8,), (6, 4), (6, 4), (8, 4), (8, 4)]  # first-seen order, reverse registration
        assert [[tuple(p.shape) for p in b] for b in by_stage[1]] == [[(8,), (6, 4)], [(8, 4)], [(6, 4), (8,)], [(8, 4)]]
    finally:
        sync.remove_hooks()


def test_cb_rank_too_large_for_the_activations_warns() -> None:
    # A (4, 16, 48) gradient is a 64 x 48 matrix: rank r factors are 64*48 / (112 r) times smaller, >= 2 up to r = 13.
    codec = CompressedBackprop(CompressedBackpropConfig(rank=1000, epilogue_only=False))
    meta = ((4, 16, 48), torch.float32)
    with pytest.warns(UserWarning, match=r"cb_rank=1000 is too large for activation gradients of 64x48 .* cb_rank <= 13"):
        assert codec.message_metas(meta, BoundaryKey(1, 0, True)) == [meta]  # sent uncompressed
    assert len(CompressedBackprop(CompressedBackpropConfig(rank=13, epilogue_only=False)).message_metas(
        meta, BoundaryKey(1, 0, True))) == 2


def test_cb_state_ignores_a_nonfinite_gradient() -> None:
    """A NaN gradient travels (the step is then skipped) but leaves the warm start and the LEP error as they were."""
    codec = CompressedBackprop(CompressedBackpropConfig(rank=2, epilogue_only=False, lazy_error_propagation=True))
    key = BoundaryKey(1, 0, True)
    g = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    codec.encode(g, key)
    q, error = codec.q_memory[(1, 0)].clone(), codec.errors[(1, 0)].clone()
    poisoned = g.clone()
    poisoned[0, 3, 5] = float("nan")
    p_sent, q_sent = codec.encode(poisoned, key)
    assert not torch.isfinite(p_sent @ q_sent.T).all()  # the receiver's gradients turn non-finite: the strategy skips the step
    assert torch.equal(codec.q_memory[(1, 0)], q) and torch.equal(codec.errors[(1, 0)], error)
    codec.encode(g, key)  # and the next finite gradient compresses from that state
    assert torch.isfinite(codec.q_memory[(1, 0)]).all() and torch.isfinite(codec.errors[(1, 0)]).all()


def test_cb_by_default_only_below_the_pipeline_link_threshold() -> None:
    cfg = CompressionConfig()
    assert cfg.compressed_backprop == "auto" and cfg.cb_max_link_gbps == 100.0
    assert not cfg.cb_on_link(None)  # never measured: exact
    assert cfg.cb_on_link(25.0) and not cfg.cb_on_link(100.0) and not cfg.cb_on_link(400.0)  # IB-like / NVLink-like
    assert CompressionConfig(compressed_backprop=True).cb_on_link(400.0)  # True and False force the choice
    assert not CompressionConfig(compressed_backprop=False).cb_on_link(1.0)
    assert CompressionConfig(cb_max_link_gbps=float("inf")).cb_on_link(1e6)
    assert CompressionConfig(compressed_backprop=True, cb_max_link_gbps=10.0).unused_options(dp=1, pp=2, tied=True) == [
        "cb_max_link_gbps has no effect: compressed_backprop=True compresses on any link"]
    assert CompressionConfig(cb_max_link_gbps=10.0).unused_options(dp=1, pp=1, tied=True) == [
        "cb_max_link_gbps has no effect: compressed backpropagation needs pipeline_parallel_size > 1"]


def test_cb_link_decision_is_measured_once_recorded_and_restored(monkeypatch) -> None:
    """strategies/cb_link.py on a one-process group (the probe replaced): measured only under "auto" with pp > 1,
    recorded, and a recorded measurement replaces this run's own on resume, saying whether CB flips."""
    import torch.distributed as dist

    from lightning_3d.distributed.parallel_dims import ParallelDims
    from lightning_3d.strategies import cb_link
    from lightning_3d.strategies.compression_state import CompressionState
    from lightning_3d.utils.comm_stats import CommunicationStats

    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: None)  # one process: the minimum is itself
    pp2, pp1 = ParallelDims(1, 2, 1, 2), ParallelDims(1, 1, 1, 1)

    def state(gbps: float, **cfg) -> CompressionState:
        s = CompressionState(CompressionConfig(**cfg), CommunicationStats(), guard_nonfinite=False)
        s.probed = 0

        def probe(group, device):
            s.probed += 1
            return gbps
        s.pipeline_link_probe = probe
        return s

    nvlink, ib = state(400.0), state(20.0)
    for s in (nvlink, ib):
        with pytest.warns(UserWarning, match="the pipeline link runs at"):
            cb_link.measure_pipeline_link(s, pp2, None, torch.device("cpu"))
        cb_link.measure_pipeline_link(s, pp2, None, torch.device("cpu"))  # once per run
        assert s.probed == 1
    assert not cb_link.compresses_backprop(nvlink, pp2) and cb_link.compresses_backprop(ib, pp2)
    assert nvlink.build_codec(pp2, None, False) is None and ib.build_codec(pp2, None, False) is not None
    record = nvlink.record(pp2)
    assert (record["pp_link_gbps"], record["cb_max_link_gbps"], record["cb_on"]) == (400.0, 100.0, False)
    assert ib.record(pp2)["cb_on"] is True and ib.record(pp2)["pp_link_gbps"] == 20.0
    # Resumed on a slow link from a run saved on a fast one: keeps the recorded (exact) decision, and says it flips.
    resumed = state(20.0)
    resumed.pipeline_link_gbps = 20.0  # its own measurement, taken at setup
    with pytest.warns(UserWarning, match=r"400.0 GB/s .*recorded in the checkpoint.*off \(exact"):
        assert cb_link.restore_cb_record(resumed, pp2, nvlink.record(pp2)) is True
    assert not cb_link.compresses_backprop(resumed, pp2)
    assert cb_link.restore_cb_record(resumed, pp2, nvlink.record(pp2)) is False  # already the recorded one
    # True / False (and pp = 1, compression off) decide without measuring, and ignore a recorded measurement.
    for forced, dims, on in ((state(400.0, compressed_backprop=True), pp2, True),
                             (state(1.0, compressed_backprop=False), pp2, False),
                             (state(1.0), pp1, False), (state(1.0, enabled=False), pp2, False)):
        cb_link.measure_pipeline_link(forced, dims, None, torch.device("cpu"))
        assert forced.probed == 0 and forced.pipeline_link_gbps is None
        assert cb_link.compresses_backprop(forced, dims) is on
        assert cb_link.restore_cb_record(forced, dims, ib.record(pp2)) is False and forced.pipeline_link_gbps is None
