"""Synthetic token data (causal-LM and seq2seq) for throughput benchmarks: no files, no tokenizer, no ``datasets``.

Sample ``i`` is drawn from ``numpy.random.default_rng((seed, i))``, so any sample can be produced in
any process without shared state, and the batches are identical on every machine. It goes through
the same sampler and resumable loader as the real data, so benchmarks measure the real input path.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_3d.recipes.data.loader import ResumableDataLoader, train_loader_of


class SyntheticTokens(Dataset):
    """``num_samples`` uniform random sequences of ``seq_length + 1`` tokens below ``vocab_size``."""

    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int) -> None:
        self.vocab_size, self.seq_length, self.num_samples, self.seed = vocab_size, seq_length, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range 0..{self.num_samples - 1}")
        rng = np.random.default_rng((self.seed, index))
        block = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64))
        return {"input_ids": block[:-1], "labels": block[1:]}


class _SyntheticDataModule(L.LightningDataModule):
    """What the synthetic modules share: argument checks, ``vocab_size`` and the resumable training loader."""

    train_dataset: Dataset
    # Every micro-batch has the same shape: the recipes' sdpa_backends="auto" then keeps torch's own attention kernel
    # (recipes/attention.py, docs/speed.md).
    varies_microbatch_shapes = False

    def _require_at_least(self, **minimums: int) -> None:
        """``name=low``: the hyper-parameter ``name`` must be at least ``low``."""
        for name, low in minimums.items():
            if self.hparams[name] < low:
                raise ValueError(f"{name} must be >= {low}, got {self.hparams[name]}")

    @property
    def vocab_size(self) -> int:
        return self.hparams.vocab_size

    def train_dataloader(self) -> ResumableDataLoader:
        return train_loader_of(self, self.train_dataset)


class SyntheticLMDataModule(_SyntheticDataModule):
    """Deterministic random tokens in the causal-LM batch format (training only, no validation)."""

    def __init__(
        self,
        vocab_size: int = 32000,
        seq_length: int = 1024,
        batch_size: int = 8,
        num_samples: int = 10_000,
        seed: int = 1234,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._require_at_least(vocab_size=2, seq_length=1, batch_size=1, num_samples=1, num_workers=0)
        self.train_dataset = SyntheticTokens(vocab_size, seq_length, num_samples, seed)

    @property
    def eos_token_id(self) -> int:
        """Nominal: the last id. Random data has no documents, but models may expect the attribute."""
        return self.hparams.vocab_size - 1


class SyntheticPairs(Dataset):
    """``num_samples`` random (input, target) pairs of fixed lengths in T5's batch format, nothing padded or ignored.

    ``decoder_input_ids`` are the labels shifted right behind ``decoder_start_token_id`` (T5's pad id, 0), and
    the attention mask is all ones: the model runs its masked path, as with real (padded) data.
    """

    def __init__(self, vocab_size: int, input_length: int, target_length: int, num_samples: int, seed: int,
                 decoder_start_token_id: int = 0) -> None:
        self.vocab_size, self.input_length, self.target_length = vocab_size, input_length, target_length
        self.num_samples, self.seed, self.start = num_samples, seed, decoder_start_token_id

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range 0..{self.num_samples - 1}")
        rng = np.random.default_rng((self.seed, index))
        tokens = torch.from_numpy(rng.integers(0, self.vocab_size, self.input_length + self.target_length, dtype=np.int64))
        inputs, labels = tokens[: self.input_length], tokens[self.input_length :]
        decoder = torch.cat([torch.tensor([self.start]), labels[:-1]])
        return {"input_ids": inputs, "attention_mask": torch.ones_like(inputs), "decoder_input_ids": decoder, "labels": labels}


class SyntheticSeq2SeqDataModule(_SyntheticDataModule):
    """Deterministic random (input, target) pairs in the seq2seq batch format (training only, no validation).

    The counterpart of :class:`SyntheticLMDataModule` for encoder-decoder benchmarks; ``input_length`` and
    ``target_length`` are the encoder and decoder lengths (T5's span corruption gives targets ~1/4 of the inputs).
    """

    def __init__(
        self,
        vocab_size: int = 32128,
        input_length: int = 512,
        target_length: int = 128,
        batch_size: int = 8,
        num_samples: int = 10_000,
        seed: int = 1234,
        num_workers: int = 0,
        shuffle: bool = True,
        pad_token_id: int = 0,
        eos_token_id: int = 1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self._require_at_least(vocab_size=2, input_length=1, target_length=1, batch_size=1, num_samples=1,
                               num_workers=0)
        self.train_dataset = SyntheticPairs(vocab_size, input_length, target_length, num_samples, seed, pad_token_id)

    @property
    def pad_token_id(self) -> int:
        """Also the decoder start token (T5's convention)."""
        return self.hparams.pad_token_id

    @property
    def eos_token_id(self) -> int:
        """Nominal: random data has no sequence ends, but the model and the CLI links expect the id."""
        return self.hparams.eos_token_id
