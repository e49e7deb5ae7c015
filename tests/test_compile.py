"""``compile=...`` and ``optimizer_fused=...`` of the GPT and T5 recipes: same training as eager/unfused, names unchanged, bad values
refused. Compilation runs with the "aot_eager" backend here: the same graph capture and autograd tracing as inductor,
without building C++ kernels on the 2-core CI machine (GPU runs use inductor, see benchmarks/speed/peers.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import lightning_3d.recipes.training as training
from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes import GPT, T5
from lightning_3d.recipes.data import SyntheticLMDataModule, SyntheticSeq2SeqDataModule


def fit(steps: int = 3, recipe: str = "gpt", **kwargs) -> tuple[list[float], pl.LightningModule, pl.Trainer]:
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    torch.manual_seed(0)
    if recipe == "gpt":
        model = GPT("tiny", **kwargs)
        data = SyntheticLMDataModule(vocab_size=4096, seq_length=64, batch_size=4, num_samples=64)
    else:
        model = T5("tiny", vocab_size=512, **kwargs)
        data = SyntheticSeq2SeqDataModule(vocab_size=512, input_length=32, target_length=16, batch_size=4, num_samples=64)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(num_microbatches=2, compression=False),
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Record()])
    trainer.fit(model, datamodule=data)
    return losses, model, trainer


def blocks_of(module: pl.LightningModule) -> list[torch.nn.Module]:
    if isinstance(module, GPT):
        return list(module.model.layers.values())
    return [*module.model.encoder.values(), *module.model.decoder.values()]


@pytest.mark.parametrize("recipe", ["gpt", "t5"])
def test_compiled_blocks_train_like_eager(recipe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(training, "COMPILE_BACKEND", "aot_eager")
    eager_losses, eager, _ = fit(recipe=recipe)
    compiled_losses, compiled, _ = fit(recipe=recipe, compile=True)
    assert all(block._compiled_call_impl is not None for block in blocks_of(compiled))  # every block runs compiled
    assert all(block._compiled_call_impl is None for block in blocks_of(eager))
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints and export see the same names
    assert torch.allclose(torch.tensor(compiled_losses), torch.tensor(eager_losses), rtol=1e-5, atol=0)
    for a, b in zip(compiled.parameters(), eager.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_compile_mode_reaches_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)
    training.compile_blocks([torch.nn.Linear(2, 2)], "max-autotune-no-cudagraphs")
    training.compile_blocks([torch.nn.Linear(2, 2)], True)
    training.compile_blocks([torch.nn.Linear(2, 2)], False)  # off: nothing compiled
    assert seen == [{"backend": "inductor", "mode": "max-autotune-no-cudagraphs"}, {"backend": "inductor", "mode": None}]


@pytest.mark.parametrize("recipe", ["gpt", "t5"])
def test_fused_optimizer_trains_like_the_default(recipe: str) -> None:
    default_losses, default, _ = fit(recipe=recipe)
    fused_losses, fused, trainer = fit(recipe=recipe, optimizer_fused=True)
    assert trainer.optimizers[0].defaults["fused"] is True
    assert torch.allclose(torch.tensor(fused_losses), torch.tensor(default_losses), rtol=1e-6, atol=0)
    for a, b in zip(fused.parameters(), default.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_recipes_default_to_fused_adamw_on_gpus_only() -> None:
    """optimizer_fused=None: fused AdamW where every parameter is on a GPU (the non-finite check's lazy verdict needs
    it), torch's default elsewhere; an explicit choice and optimizer_foreach=True are kept."""
    from types import SimpleNamespace

    from lightning_3d.recipes.training import default_fused

    on = lambda kind: SimpleNamespace(device=torch.device(kind))  # noqa: E731
    assert default_fused([on("cuda"), on("cuda")]) is True
    assert default_fused([on("cuda"), on("cpu")]) is None
    assert default_fused([on("cpu")]) is None and default_fused([]) is None
    _, _, trainer = fit(recipe="gpt")  # on the CPU: torch's default, as before
    assert trainer.optimizers[0].defaults["fused"] is None
    _, _, trainer = fit(recipe="gpt", optimizer_fused=False)
    assert trainer.optimizers[0].defaults["fused"] is False


@pytest.mark.parametrize("recipe", [GPT, T5])
def test_bad_compile_and_optimizer_options_are_refused(recipe: type) -> None:
    with pytest.raises(ValueError, match=r"compile='fast': use False, True or one of \('default', 'max-autotune"):
        recipe("tiny", compile="fast")
    with pytest.raises(ValueError, match="optimizer_foreach=True and optimizer_fused=True exclude each other"):
        recipe("tiny", optimizer_foreach=True, optimizer_fused=True)
    with pytest.raises(ValueError, match=r"compile='reduce-overhead': use True or one of"):
        training.compile_blocks([torch.nn.Linear(2, 2)], "reduce-overhead")


@pytest.mark.parametrize("loss", ["cross_entropy", "chunk"])
def test_compiled_loss_compiles_twice_for_any_number_of_token_counts(loss: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Variable micro-batches (dynamic plans, packing's shorter last micro-batch) hand the compiled loss a new token
    count each. Automatic dynamic shapes give it two graphs here: a static one for the first count, a symbolic one for
    every later count (Inductor may add one where a kernel guards on a size range); one graph per count reached
    dynamo's recompile limit after eight counts and ran the loss eagerly from then on. The capture-only backend runs
    the same float32 operations as eager, possibly reordered: each per-token loss term may differ by a few roundings
    of its operands (|log-sum-exp| + |largest logit|), the sum by one rounding per term, and a probability
    exp(s - lse) by a few roundings of lse's absolute error, |lse| eps each, plus its own."""
    from torch._dynamo.utils import counters

    import lightning_3d.recipes.kernels as kernels

    module = training if loss == "cross_entropy" else kernels
    monkeypatch.setattr(module, "COMPILE_BACKEND", "aot_eager")
    factory = training._compiled_fp32_cross_entropy if loss == "cross_entropy" else kernels._compiled_chunk
    eager = training._fp32_cross_entropy if loss == "cross_entropy" else kernels._chunk_loss_and_grad
    factory.cache_clear()
    torch._dynamo.reset()
    vocab, eps = 50, torch.finfo(torch.float32).eps
    graphs = counters["stats"]["unique_graphs"]
    try:
        compiled = factory()
        for tokens in range(6, 6 + 4 * 12, 4):  # twelve counts, beyond the recompile limit
            gen = torch.Generator().manual_seed(tokens)
            logits = 4 * torch.randn(tokens, vocab, generator=gen)
            labels = torch.randint(0, vocab, (tokens,), generator=gen)
            labels[0] = training.IGNORE_INDEX
            args = (logits, labels) if loss == "cross_entropy" else (logits, labels, vocab)
            got, want = compiled(*args), eager(*args)
            got_loss, want_loss = (got, want) if loss == "cross_entropy" else (got[0], want[0])
            terms = logits.logsumexp(1).abs() + logits.abs().amax(1)
            bound = 8 * eps * terms.sum() + tokens * eps * abs(float(want_loss))
            assert abs(float(got_loss) - float(want_loss)) <= bound, (tokens, float(got_loss), float(want_loss))
            if loss == "chunk":  # the gradient: softmax minus the one-hot, entries of magnitude at most 1
                row_bound = 8 * eps * (1 + logits.logsumexp(1).abs())
                assert ((got[1] - want[1]).abs() <= row_bound[:, None]).all(), tokens
        assert counters["stats"]["unique_graphs"] - graphs == 2
    finally:
        factory.cache_clear()
        torch._dynamo.reset()
