"""T5's two attention implementations compute the same function (``attention="sdpa"`` runs one
``scaled_dot_product_attention`` call per attention with the relative position bias and the masks as its additive
``attn_mask`` and ``scale=1``; ``"explicit"``, the default, runs scores, fp32 softmax and value mix).

In fp32 the two differ only in summation order, so logits agree within tests/tolerance.py's chained bound for a T5
and every gradient within the same analysis taken twice (the backward repeats each forward reduction once more); the
relative-bias tables' gradients also sum over every (sample, query, key) position of every block that reads them, so
their longest reduction is batch x queries x keys x blocks. Dropout on the attention probabilities keeps the explicit
path (its masks come from the tensor-parallel stream), so with dropout the two are bitwise equal in training.
"""

from __future__ import annotations

import pytest
import torch

from lightning_3d.recipes.t5.config import preset
from lightning_3d.recipes.t5.model import T5Model
from tests.tolerance import chain_tolerance, scaled_error, t5_tolerance

BATCH, SOURCE, TARGET, VOCAB = 3, 16, 8, 300


def _config(**overrides):
    return preset("tiny", vocab_size=VOCAB, num_layers=2, num_decoder_layers=2, hidden_size=32, num_heads=4,
                  head_dim=8, ffn_hidden_size=64, **overrides)


def _pair(**overrides) -> tuple[T5Model, T5Model]:
    """(sdpa, explicit) models holding the same weights; the bias tables drawn wider than T5's init, so that the bias
    shapes the attention (at init it is nearly zero and a wrong bias would go unseen)."""
    sdpa = T5Model(_config(**overrides), attention="sdpa")
    sdpa.init_weights(1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for table in (sdpa.encoder_relative_bias.weight, sdpa.decoder_relative_bias.weight):
            table.copy_(torch.randn(table.shape, generator=g))
    explicit = T5Model(_config(**overrides), attention="explicit")
    explicit.load_state_dict(sdpa.state_dict())
    return sdpa, explicit


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, VOCAB, (BATCH, SOURCE), generator=g),
             "decoder_input_ids": torch.randint(0, VOCAB, (BATCH, TARGET), generator=g),
             "attention_mask": torch.ones(BATCH, SOURCE, dtype=torch.long)}
    batch["attention_mask"][1, 10:] = 0  # padding: the encoder's key mask and the cross-attention's
    if packed:  # two pairs per row: per-document masks in all three attentions
        batch["document_ids"] = (torch.arange(SOURCE) >= SOURCE // 2).long().expand(BATCH, -1)
        batch["decoder_document_ids"] = (torch.arange(TARGET) >= TARGET // 2).long().expand(BATCH, -1)
    return batch


def _run(model: T5Model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from lightning_3d.recipes.t5.model import run_stage

    logits = run_stage(model, (), batch)[..., :VOCAB]
    # A loss that weights every logit differently, so no gradient is zero by symmetry.
    weights = torch.linspace(-1.0, 1.0, logits.numel()).view_as(logits)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sdpa_attention_matches_the_explicit_one(packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.nn.functional as F

    calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(k["scale"]) or fused(*a, **k))
    sdpa, explicit = _pair()
    batch = _batch(packed)
    logits, grads = _run(sdpa, batch)
    assert calls == [1.0] * (2 + 2 * 2)  # every attention (encoder self; decoder self and cross) one call, unscaled
    ref_logits, ref_grads = _run(explicit, batch)
    assert len(calls) == 6
    assert scaled_error(logits, ref_logits) <= t5_tolerance(2, 2, 64)  # 64: the FFN width, the longest reduction
    forward_reductions = 9 * 2 + 15 * 2 + 3  # t5_tolerance's count for 2 + 2 blocks
    tolerance = chain_tolerance(2 * forward_reductions, max(64, BATCH * SOURCE * SOURCE * 2))
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert grad is not None and grad.abs().max() > 0, name
        assert scaled_error(grads[name], grad) <= tolerance, name
    assert ref_grads["encoder_relative_bias.weight"].abs().max() > 0  # the tables train through the SDPA mask too


def test_dropout_in_training_keeps_the_explicit_path() -> None:
    """With dropout the SDPA model trains exactly as the explicit one (the same masks from the same generator);
    evaluation (no dropout) takes SDPA again."""
    sdpa, explicit = _pair(dropout=0.3)
    batch = _batch(packed=False)
    outputs = []
    for model in (sdpa, explicit):
        torch.manual_seed(7)
        outputs.append(_run(model.train(), batch))
    assert torch.equal(outputs[0][0], outputs[1][0])
    for name, grad in outputs[1][1].items():
        assert torch.equal(outputs[0][1][name], grad), name
    with torch.no_grad():
        sdpa.eval(), explicit.eval()
        from lightning_3d.recipes.t5.model import run_stage

        got, want = (run_stage(m, (), batch)[..., :VOCAB] for m in (sdpa, explicit))
        assert scaled_error(got, want) <= t5_tolerance(2, 2, 64)


def test_attention_option_is_checked() -> None:
    from lightning_3d.recipes import T5

    with pytest.raises(ValueError, match=r"attention='flash' is not supported; choose one of \['explicit', 'sdpa'\]"):
        T5("tiny", attention="flash")
    with pytest.raises(ValueError, match="attention='math'"):
        T5Model(_config(), attention="math")
    for kwargs, expected in (({}, "explicit"), ({"attention": "sdpa"}, "sdpa")):
        module = T5("tiny", **kwargs)
        module.configure_model()
        assert {m.implementation for m in module.model.modules() if hasattr(m, "implementation")} == {expected}
