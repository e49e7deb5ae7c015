"""recipes/kernels.py against the plain path it replaces, with tolerances from an error analysis (tests/tolerance.py).

The chunked linear + cross-entropy computes the same sums as the plain head and loss, in another order: the logits'
dot products (length h) may be blocked differently by the chunk's GEMM, the loss is a sum of per-chunk sums, and the
weight's gradient a sum of per-chunk products. An fp32 sum of n terms in any order is within n·u·Σ|terms| of the exact
value (u = 2^-24), so two orders differ by at most 2·n·u·Σ|terms|. Chained:
- logits: |Δz_tj| ≤ δ_z = 2·h·u·max(|x| @ |W|ᵀ);
- per-token loss ℓ_t = lse_t − z_t,label: log-sum-exp moves by at most max|Δz| plus its own sum's rounding (V terms,
  relative V·u, twice), the picked logit by δ_z: |Δℓ_t| ≤ 2·δ_z + 2·V·u; the sum over N tokens adds 2·N·u·Σ|ℓ_t|;
- the logits' gradient g = softmax − onehot: each probability moves by at most p·(2·max|Δz| + 2·V·u) + 2·u (exp and
  division), so |Δg| ≤ δ_g = 2·δ_z + 2·V·u + 2·u (p ≤ 1);
- the input gradient g @ W (V terms): |Δ| ≤ δ_g·(1 @ |W|) + 2·V·u·(|g| @ |W|); the weight gradient gᵀ @ x (N terms):
  |Δ| ≤ δ_g·(1ᵀ @ |x|) + 2·N·u·(|g|ᵀ @ |x|).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_3d.recipes import kernels
from lightning_3d.recipes.kernels import linear_cross_entropy
from lightning_3d.recipes.training import IGNORE_INDEX, summed_token_cross_entropy
from tests.tolerance import U, gpt_tolerance, scaled_error

H, V_PADDED, VOCAB = 24, 64, 53  # hidden, the weight's rows (padded vocabulary), real vocabulary


def _problem(seed: int = 0, shape: tuple[int, ...] = (3, 13), dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, H, generator=g, dtype=dtype)
    w = torch.randn(V_PADDED, H, generator=g, dtype=dtype) * 0.5
    w[VOCAB:] = 0.0  # padding rows, as the recipes initialise them
    labels = torch.randint(0, VOCAB, shape, generator=g)
    labels.view(-1)[::5] = IGNORE_INDEX  # some positions ignored
    return x, w, labels


def _plain(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The recipes' head (``LMHead``: padded columns masked to -inf) and loss, as GPT runs them without the option."""
    mask = torch.zeros(V_PADDED, dtype=x.dtype)
    mask[VOCAB:] = float("-inf")
    return summed_token_cross_entropy(F.linear(x, w) + mask, labels)


def _run(fn, x, w, labels):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(x, w, labels)
    (loss * 0.37).backward()  # a scale, as the pipeline's division by the token count gives
    return loss.detach(), x.grad, w.grad


def _bounds(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(loss bound, input-gradient bound, weight-gradient bound) of the module docstring's analysis, all scaled by 0.37
    where the gradient is."""
    x2, valid = x.reshape(-1, H).double(), (labels.reshape(-1) != IGNORE_INDEX)
    n, v = int(valid.sum()), VOCAB
    z = x2 @ w[:VOCAB].double().t()
    delta_z = 2 * H * U * (x2.abs() @ w[:VOCAB].double().abs().t()).max().item()
    per_token = torch.logsumexp(z, 1) - z.gather(1, labels.reshape(-1).clamp_min(0)[:, None]).squeeze(1)
    loss_bound = n * (2 * delta_z + 2 * v * U) + 2 * n * U * per_token[valid].abs().sum().item()
    g = torch.softmax(z, 1)
    g[torch.arange(len(g)), labels.reshape(-1).clamp_min(0)] -= 1
    g[~valid] = 0
    delta_g = (2 * delta_z + 2 * v * U + 2 * U) * valid.double()[:, None]
    wv = w[:VOCAB].double().abs()
    dx = delta_g.sum(1, keepdim=True) * wv.sum(0) + 2 * v * U * (g.abs() @ wv)
    dw = torch.zeros(V_PADDED, H, dtype=torch.float64)
    dw[:VOCAB] = delta_g.t() @ x2.abs() + 2 * len(x2) * U * (g.abs().t() @ x2.abs())
    return loss_bound, 0.37 * dx.reshape(x.shape), 0.37 * dw


@pytest.mark.parametrize("chunk_tokens", [None, 1, 5, 39, 100])
def test_linear_cross_entropy_equals_the_plain_head_and_loss_in_fp32(chunk_tokens: int | None) -> None:
    """Loss, input gradient and weight gradient within the error analysis of the plain path, whatever the chunking
    (one token per chunk, uneven chunks, exactly one chunk, a chunk larger than the batch)."""
    x, w, labels = _problem()
    ref = _run(_plain, x, w, labels)
    got = _run(lambda a, b, c: linear_cross_entropy(a, b, c, VOCAB, chunk_tokens=chunk_tokens), x, w, labels)
    loss_bound, dx_bound, dw_bound = _bounds(x, w, labels)
    assert abs(got[0].item() - ref[0].item()) <= loss_bound
    assert ((got[1].double() - ref[1].double()).abs() <= dx_bound).all()
    assert ((got[2].double() - ref[2].double()).abs() <= dw_bound).all()
    assert (got[2][VOCAB:] == 0).all()  # padding rows are never scored, as with the -inf mask


def test_linear_cross_entropy_ignores_labels_and_handles_an_all_ignored_chunk() -> None:
    x, w, labels = _problem(seed=1)
    labels[0] = IGNORE_INDEX  # the first 13 tokens: a whole chunk of 13 ignored
    loss, dx, dw = _run(lambda a, b, c: linear_cross_entropy(a, b, c, VOCAB, chunk_tokens=13), x, w, labels)
    ref = _run(_plain, x, w, labels)
    assert (dx[0] == 0).all()  # ignored positions get no gradient
    assert abs(loss.item() - ref[0].item()) <= _bounds(x, w, labels)[0]


def test_compiled_chunk_gives_the_eager_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compiled=True`` traces the chunk's softmax and gradient (aot_eager here: the same capture as Inductor's,
    without a C++ build) and gives the same numbers as the eager chunk."""
    monkeypatch.setattr(kernels, "COMPILE_BACKEND", "aot_eager")
    kernels._compiled_chunk.cache_clear()
    try:
        x, w, labels = _problem(seed=2)
        eager = _run(lambda a, b, c: linear_cross_entropy(a, b, c, VOCAB, chunk_tokens=13), x, w, labels)
        compiled = _run(lambda a, b, c: linear_cross_entropy(a, b, c, VOCAB, chunk_tokens=13, compiled=True), x, w, labels)
    finally:
        kernels._compiled_chunk.cache_clear()
    loss_bound, dx_bound, dw_bound = _bounds(x, w, labels)
    assert abs(compiled[0].item() - eager[0].item()) <= loss_bound
    assert ((compiled[1].double() - eager[1].double()).abs() <= dx_bound).all()
    assert ((compiled[2].double() - eager[2].double()).abs() <= dw_bound).all()


def test_linear_cross_entropy_under_bf16_autocast_rounds_like_the_plain_path() -> None:
    """Under autocast both paths make bf16 logits from bf16 casts of the same inputs (rounding to bf16 is
    deterministic, the fp32-accumulated dot products differ only in order), take the log-softmax in fp32 and round the
    logits' gradient to bf16. So they differ by about one bf16 rounding of a logit per token in the loss (2^-8 of the
    largest logit, twice: log-sum-exp and the picked logit) and, in the gradients, by one bf16 rounding of each
    product (2^-8 of |g| @ |W| and |g|ᵀ @ |x|, for both paths, so twice) plus the propagated logit difference."""
    x, w, labels = _problem(seed=3, shape=(4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _run(_plain, x, w, labels)
        got = _run(lambda a, b, c: linear_cross_entropy(a, b, c, VOCAB, chunk_tokens=16), x, w, labels)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32  # autograd's dtypes: the leaves'
    ub = 2.0**-8
    xb, wb = x.reshape(-1, H).bfloat16().double(), w.bfloat16().double()
    z = xb @ wb.t()
    valid = labels.reshape(-1) != IGNORE_INDEX
    n = int(valid.sum())
    delta_z = 2 * ub * z.abs().max().item() + 2 * H * U * (xb.abs() @ wb.abs().t()).max().item()
    assert abs(got[0].item() - ref[0].item()) <= n * 2 * delta_z + 2 * n * U * abs(ref[0].item())
    delta_g = 2 * delta_z + 2 * ub  # probabilities move with the logits, then each path rounds g to bf16
    rows = valid.double()[:, None]
    dx_bound = 0.37 * (delta_g * rows * wb.abs().sum(0) + 2 * ub * (rows * wb.abs().sum(0)))
    assert ((got[1].double().reshape(-1, H) - ref[1].double().reshape(-1, H)).abs() <= dx_bound).all()
    dw_bound = 0.37 * (delta_g + 2 * ub) * (rows.t() @ xb.abs()).expand(V_PADDED, H)
    assert ((got[2].double() - ref[2].double()).abs() <= dw_bound).all()


def test_linear_cross_entropy_refuses_mismatched_inputs() -> None:
    x, w, labels = _problem()
    with pytest.raises(ValueError, match=r"labels have shape \(3, 12\) but the hidden states \(3, 13, 24\)"):
        linear_cross_entropy(x, w, labels[:, :12], VOCAB)
    with pytest.raises(ValueError, match=r"weight of shape \(64, 23\) does not project hidden states of width 24"):
        linear_cross_entropy(x, w[:, :23], labels, VOCAB)
    with pytest.raises(ValueError, match="vocab_size=65 must be in 1..64"):
        linear_cross_entropy(x, w, labels, 65)
    with pytest.raises(ValueError, match="chunk_tokens=0 must be a positive"):
        linear_cross_entropy(x, w, labels, VOCAB, chunk_tokens=0)


def _gpt_step(fused: bool):
    from lightning_3d.recipes import GPT

    torch.manual_seed(0)
    module = GPT("tiny", vocab_size=250, seq_length=16, fused_head_loss=fused)  # 250 -> padded to 256
    module.configure_model()
    g = torch.Generator().manual_seed(5)
    batch = {"input_ids": torch.randint(0, 250, (2, 16), generator=g), "labels": torch.randint(0, 250, (2, 16), generator=g)}
    loss = module.training_step(batch, 0)
    loss.backward()
    return module, loss.detach(), {n: p.grad for n, p in module.named_parameters()}


def test_gpt_fused_head_loss_trains_like_the_plain_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT(fused_head_loss=True) in fp32: the same loss and gradients as without the option, within the chained
    summation-order tolerance of a GPT (the head and loss are the only reordered sums, the blocks run identically), and
    ``forward`` still returns the logits."""
    monkeypatch.setattr("lightning_3d.recipes.gpt.module.GPT.log", lambda *a, **k: None)  # no trainer to log to
    plain, loss, grads = _gpt_step(False)
    fused, fused_loss, fused_grads = _gpt_step(True)
    tolerance = gpt_tolerance(blocks=4, longest=512)  # tiny: 4 blocks, the MLP's 512 the widest reduction
    assert abs(fused_loss.item() - loss.item()) <= tolerance * loss.item()
    assert grads.keys() == fused_grads.keys()
    for name, grad in grads.items():
        assert scaled_error(fused_grads[name], grad) <= tolerance, name
    ids = torch.randint(0, 250, (1, 8))
    with torch.no_grad():
        assert torch.equal(fused(ids), plain(ids))  # the same head, the same weights: the same logits


def test_gpt_fused_head_loss_refuses_tensor_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_3d.recipes import GPT

    module = GPT("tiny", fused_head_loss=True)
    monkeypatch.setattr(GPT, "_tensor_parallel_size", lambda self: 2)
    with pytest.raises(ValueError, match=r"fused_head_loss=True needs tensor_parallel_size 1 \(got 2\)"):
        module.configure_model()


def test_t5_encoder_bias_is_batch_free_and_gradients_match_transformers() -> None:
    """The encoder's position bias reaches every block as (1, heads, s, s), the padding mask as its own (batch, 1, 1, s)
    addend: before, the two were folded into a (batch, heads, s, s) fp32 tensor that every block read and whose gradient
    every block wrote (8 x 16 x 512 x 512 x 4 bytes = 134 MB per block for T5-770M at micro-batch 8). Masked scores get
    probability 0 either way, so the loss and every gradient stay transformers' (which folds them): within twice the
    logits' summation-order tolerance (the backward runs a mirror chain of reductions of the same lengths)."""
    from transformers import T5ForConditionalGeneration

    from lightning_3d.recipes.hf_t5 import hf_config_for, hf_key, t5_to_hf_state_dict
    from tests.test_t5 import inputs, tiny_t5
    from tests.tolerance import t5_tolerance

    module = tiny_t5("v1.0").train()
    hf = T5ForConditionalGeneration(hf_config_for(module.config)).train()
    hf.load_state_dict(t5_to_hf_state_dict(module.model.state_dict(), module.config), strict=False)
    batch = inputs()
    batch["labels"] = torch.randint(0, 300, batch["decoder_input_ids"].shape, generator=torch.Generator().manual_seed(1))
    seen = []
    hooks = [b.register_forward_pre_hook(lambda _, args: seen.append((args[1].shape, args[2].shape)))
             for b in module.model.encoder.values()]
    ours = module._step_loss(batch) * count(batch)
    for hook in hooks:
        hook.remove()
    assert seen == [((1, 4, 40, 40), (3, 1, 1, 40))] * 2
    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                decoder_input_ids=batch["decoder_input_ids"]).logits
    theirs = summed_token_cross_entropy(logits, batch["labels"])
    ours.backward()
    theirs.backward()
    tolerance = 2 * t5_tolerance(2, 3, 64)
    assert abs(ours.item() - theirs.item()) <= tolerance * theirs.item()
    hf_params = dict(hf.named_parameters())
    for name, p in module.model.named_parameters():
        reference = hf_params[hf_key(name)].grad  # unpadded vocabulary: our padding rows get no gradient
        assert scaled_error(p.grad[: reference.shape[0]], reference) <= tolerance, name
        assert not p.grad[reference.shape[0] :].any(), name


def count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"] != IGNORE_INDEX).sum()


@pytest.mark.parametrize("recipe", ["gpt"])  # T5's stage: tests/test_benchmarks.py (speed script, t5 part)
def test_stage_compile_scope_trains_like_per_block(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_scope="stage"``: under our strategy each pipeline stage (embedding, every block, norm, head) is one
    compiled module and no block is compiled on its own; training gives the per-block losses (aot_eager: the same
    captured operations, so only fusion-free reordering could differ, bounded like test_compile's comparison)."""
    import lightning_3d.recipes.training as training
    from lightning_3d.recipes import GPT, T5
    from tests.test_compile import blocks_of, fit

    monkeypatch.setattr(training, "COMPILE_BACKEND", "aot_eager")
    cls = GPT if recipe == "gpt" else T5
    built: list[torch.nn.Module] = []
    original = cls.build_pipeline_stages
    monkeypatch.setattr(cls, "build_pipeline_stages",
                        lambda self, layouts: (stages := original(self, layouts), built.extend(stages))[0])
    block_losses, _, _ = fit(recipe=recipe, compile=True)
    built.clear()
    stage_losses, staged, _ = fit(recipe=recipe, compile=True, compile_scope="stage")
    assert len(built) == 1 and built[0]._compiled_call_impl is not None
    assert all(block._compiled_call_impl is None for block in blocks_of(staged))
    assert torch.allclose(torch.tensor(stage_losses), torch.tensor(block_losses), rtol=1e-5, atol=0)


def test_compile_scope_is_checked() -> None:
    from lightning_3d.recipes import GPT, T5

    for cls in (GPT, T5):
        with pytest.raises(ValueError, match=r"compile_scope='model': use one of \('block', 'stage'\)"):
            cls("tiny", compile=True, compile_scope="model")
