"""T5 model FLOPs for MFU: ``T5Config.flops_per_token`` against an independent count of the matmuls torch runs,
and ThroughputMFUMonitor's token and FLOP accounting for seq2seq batches (inputs and targets of other lengths)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lightning_3d import Compressed3DStrategy, MicroBatches
from lightning_3d.callbacks import ThroughputMFUMonitor
from lightning_3d.recipes import T5
from lightning_3d.recipes.data import SyntheticSeq2SeqDataModule

# Inner width (heads x head_dim = 48) differs from hidden (32) and the stacks differ in depth, so the formula
# cannot mix them up; vocabulary 256 is a multiple of 128, so the LM head has no padding columns.
SMALL = dict(vocab_size=256, num_layers=2, num_decoder_layers=3, hidden_size=32, num_heads=4, head_dim=12,
             ffn_hidden_size=64, relative_attention_num_buckets=8, relative_attention_max_distance=16)
VARIANTS = {"v1.0": dict(feed_forward="relu", tie_embeddings=True), "v1.1": dict(feed_forward="gated-gelu", tie_embeddings=False)}


def counted_training_flops(module: T5, batch: int, input_length: int, target_length: int) -> tuple[int, int]:
    """(forward + backward, forward) FLOPs that FlopCounterMode counts (mm/bmm: matmuls only) for one step."""
    g = torch.Generator().manual_seed(0)
    vocab = module.config.vocab_size
    inputs = torch.randint(0, vocab, (batch, input_length), generator=g)
    labels = torch.randint(0, vocab, (batch, target_length), generator=g)
    with FlopCounterMode(display=False) as forward:
        logits = module.model(inputs, None, torch.ones_like(inputs), labels)
    with FlopCounterMode(display=False) as backward:
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    return forward.get_total_flops() + backward.get_total_flops(), forward.get_total_flops()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_flops_per_token_equals_the_counted_matmul_flops(variant: str) -> None:
    """Exact: the formula counts matmuls only, and so does FlopCounterMode (softmax, norms, activations, embedding
    lookups and the loss are counted by neither). Backward is exactly twice the forward (every matmul needs both
    input and weight gradients: the embedding's gradient reaches the first block's input)."""
    module = T5("tiny", **SMALL, **VARIANTS[variant])
    module.configure_model()
    b, s, t = 3, 20, 7
    total, forward = counted_training_flops(module, b, s, t)
    assert total == 3 * forward
    assert module.flops_per_token(s, t) * b * (s + t) == pytest.approx(total, rel=1e-12)
    assert module.config.flops_per_sample(s, t) == pytest.approx(total / b, rel=1e-12)


def test_vocabulary_padding_is_not_model_flops() -> None:
    """With a padded head (300 -> 384 columns) torch also multiplies the padding columns; the formula, like GPT's,
    counts the real vocabulary only: the difference is exactly the padding columns' 6 x b x t x hidden x 84."""
    module = T5("tiny", **{**SMALL, "vocab_size": 300})
    module.configure_model()
    b, s, t = 2, 12, 5
    total, _ = counted_training_flops(module, b, s, t)
    padding = 6 * b * t * SMALL["hidden_size"] * (384 - 300)
    assert total - module.flops_per_token(s, t) * b * (s + t) == pytest.approx(padding, rel=1e-12)


def test_a_source_and_target_token_pair_costs_six_n_plus_attention() -> None:
    """Megatron's 6N at scale: a source token passes the encoder (and the cross-attention k/v), a target token the
    rest of the decoder and the head, so one (source, target) pair costs 6 x N weight FLOPs, up to the parameters that
    are not matmul weights (norms, bias tables: 0.02% of T5 770M, whose tied embedding counts once, as the head)."""
    config = T5("770m").config
    s = 512
    attention = 12 * config.inner_size * (config.num_layers + 2 * config.decoder_layers) * s  # per pair, in full
    weights = 2 * config.flops_per_token(s, s) - attention
    assert weights == pytest.approx(6 * config.num_parameters(), rel=1e-3)


def test_throughput_counts_inputs_plus_targets_for_seq2seq_batches(four_rank_trainer) -> None:
    """dp=2 of 4 devices, two steps 2 s apart: the second brings micro-batches of other (input, target) shapes."""
    model = T5("tiny", **SMALL)
    trainer, logged = four_rank_trainer

    def pairs(b: int, s: int, t: int) -> dict:
        return {"input_ids": torch.zeros(b, s, dtype=torch.long), "attention_mask": torch.ones(b, s, dtype=torch.long),
                "decoder_input_ids": torch.zeros(b, t, dtype=torch.long), "labels": torch.zeros(b, t, dtype=torch.long)}

    monitor = ThroughputMFUMonitor(peak_tflops=2.0, window_size=2)
    monitor.setup(trainer, model, "fit")
    monitor.on_train_start(trainer, model)
    monitor.on_train_batch_end(trainer, model, None, pairs(4, 16, 8), 0)
    monitor.on_train_batch_end(trainer, model, None, MicroBatches([pairs(2, 16, 4), pairs(1, 8, 8)]), 1)
    # second step, both replicas: 2 x (2 x 20 + 1 x 16) tokens over 2 s
    flops = 2 * (model.flops_per_token(16, 4) * 2 * 20 + model.flops_per_token(8, 8) * 16)
    m = logged[-1]
    assert m["train/samples"] == 2 * (4 + 3) and m["train/tokens"] == 2 * (4 * 24 + 40 + 16)
    assert m["train/tokens_per_sec"] == pytest.approx(2 * 56 / 2)
    assert m["train/tflops_per_sec"] == pytest.approx(flops / 2 / 1e12)
    assert m["train/device/mfu"] == pytest.approx(flops / 2 / 4 / 1e12 / 2.0)


def test_throughput_count_of_seq2seq_batches_and_its_warning() -> None:
    class EncoderDecoder:
        is_encoder_decoder = True

        def flops_per_token(self, input_length: int, target_length: int) -> float:
            return 10.0 * input_length + target_length

    monitor = ThroughputMFUMonitor(peak_tflops=1.0)
    pairs = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 4, dtype=torch.long)}
    assert monitor.count(EncoderDecoder(), pairs) == (2, 2 * 12, 84.0 * 2 * 12)
    with pytest.warns(UserWarning, match=r"lack 2-d `input_ids` and `labels` \(an encoder-decoder\)"):
        assert monitor.count(EncoderDecoder(), {"input_ids": pairs["input_ids"]}) == (2, None, None)


def test_mfu_of_a_t5_run_on_cpu(single_process) -> None:
    """A real 4-step fit on synthetic pairs: FLOP/s over tokens/s is T5's FLOPs per (input + target) token."""
    s, t = 24, 8
    model = T5("tiny", **SMALL, warmup_steps=1)
    data = SyntheticSeq2SeqDataModule(vocab_size=256, input_length=s, target_length=t, batch_size=2, num_samples=16)
    monitor = ThroughputMFUMonitor(peak_tflops=1.0, window_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(compression=False), max_steps=4,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, callbacks=[monitor])
    trainer.fit(model, datamodule=data)
    m = monitor.last_metrics
    assert m["train/tokens"] == m["train/samples"] * (s + t)
    assert m["train/tflops_per_sec"] * 1e12 / m["train/tokens_per_sec"] == pytest.approx(model.flops_per_token(s, t))
    assert m["train/device/mfu"] == pytest.approx(m["train/device/tflops_per_sec"]) and m["train/device/mfu"] > 0
