"""T5's span-corruption objective and the seq2seq sample datasets built on packed or tokenized arrays.

A raw block of ``raw_length`` tokens loses ~``noise_density`` of its tokens in spans of mean length
``mean_noise_span_length``; the input keeps the rest with one sentinel per dropped span (plus EOS), the target
is each sentinel followed by its span (plus EOS). Lengths follow T5's ``compute_input_and_target_lengths`` so
that every sample has exactly the same input and target length (fixed shapes, no padding for the pipeline).
Sample ``i`` is corrupted with ``numpy.random.default_rng((seed, i))``: a pure function of its index, identical on
every rank and worker, and resumable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_3d.recipes.training import IGNORE_INDEX


@dataclass(frozen=True)
class Seq2SeqVocab:
    """Where the special ids live: text ids come from the tokenizer, ``pad`` (also the decoder start) and the
    sentinels usually right after them (``pad = text size``, sentinel ``k`` = ``pad + 1 + k``)."""

    eos_token_id: int
    pad_token_id: int
    sentinel_ids: tuple[int, ...]
    text_vocab_size: int

    @property
    def vocab_size(self) -> int:
        return max(self.text_vocab_size - 1, self.pad_token_id, *self.sentinel_ids, self.eos_token_id) + 1

    @classmethod
    def appended(cls, text_vocab_size: int, eos_token_id: int, num_sentinels: int) -> Seq2SeqVocab:
        pad = text_vocab_size
        return cls(eos_token_id, pad, tuple(range(pad + 1, pad + 1 + num_sentinels)), text_vocab_size)


def _lengths_for(raw_length: int, noise_density: float, mean_span: float) -> tuple[int, int, int]:
    """(input length, target length, noise spans) of a raw block of ``raw_length`` tokens (EOS included)."""
    noise = int(round(raw_length * noise_density))
    spans = int(round(noise / mean_span))
    return raw_length - noise + spans + 1, noise + spans + 1, spans


def span_lengths(input_length: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """(raw block length, target length) whose corrupted inputs are at most ``input_length`` long (T5's rule)."""
    if not 0.0 < noise_density < 1.0 or mean_span < 1.0 or input_length < 3:
        raise ValueError(f"Span corruption needs 0 < noise_density < 1 (got {noise_density}), mean_noise_span_length"
                         f" >= 1 (got {mean_span}) and input_length >= 3 (got {input_length}).")
    raw = input_length
    while _lengths_for(raw + 1, noise_density, mean_span)[0] <= input_length:
        raw += 1
    target = _lengths_for(raw, noise_density, mean_span)[1]
    if noise_density == 0.5 and target > input_length:
        raw, target = raw - 1, target - 1
    return raw, target


def random_spans_noise_mask(length: int, noise_density: float, mean_span: float, rng: np.random.Generator) -> np.ndarray:
    """Boolean noise mask of ``length`` tokens: alternating clean and noise spans, T5's segmentation."""
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    spans = max(int(round(min(noise, length - noise) / mean_span)), 1)

    def segmentation(items: int, segments: int) -> np.ndarray:
        first = np.arange(items - 1) < (segments - 1)
        rng.shuffle(first)
        segment_id = np.cumsum(np.pad(first, [[1, 0]]))
        return np.unique(segment_id, return_counts=True)[1]

    lengths = np.stack([segmentation(length - noise, spans), segmentation(noise, spans)], axis=1).reshape(-1)
    starts = np.zeros(length, dtype=np.int64)
    starts[np.cumsum(lengths)[:-1]] = 1
    return np.cumsum(starts) % 2 == 1


def corrupt(tokens: np.ndarray, noise: np.ndarray, vocab: Seq2SeqVocab) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of T5's span corruption for one block and its noise mask (both end with EOS)."""
    runs = _runs(noise)
    if len(runs) > len(vocab.sentinel_ids):
        raise ValueError(f"A block has {len(runs)} noise spans but only {len(vocab.sentinel_ids)} sentinels; raise"
                         " num_sentinels or lower input_length.")
    inputs: list = []
    targets: list = []
    position = 0
    for k, (start, end) in enumerate(runs):
        sentinel = [vocab.sentinel_ids[k]]
        inputs += [tokens[position:start], sentinel]
        targets += [sentinel, tokens[start:end]]
        position = end
    eos = [vocab.eos_token_id]
    inputs += [tokens[position:], eos]
    targets += [eos]
    return np.concatenate(inputs).astype(np.int64), np.concatenate(targets).astype(np.int64)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of every run of True values."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def seq2seq_sample(inputs: np.ndarray, targets: np.ndarray, input_length: int, target_length: int,
                   vocab: Seq2SeqVocab) -> dict[str, Tensor]:
    """One padded sample: ``input_ids``/``attention_mask`` of ``input_length``, ``labels`` (-100 padded) and
    ``decoder_input_ids`` (labels shifted right behind the pad/start token) of ``target_length``."""
    inputs, targets = inputs[:input_length], targets[:target_length]
    ids = torch.full((input_length,), vocab.pad_token_id, dtype=torch.long)
    ids[: len(inputs)] = torch.from_numpy(np.asarray(inputs, dtype=np.int64))
    mask = torch.zeros(input_length, dtype=torch.long)
    mask[: len(inputs)] = 1
    labels = torch.full((target_length,), IGNORE_INDEX, dtype=torch.long)
    labels[: len(targets)] = torch.from_numpy(np.asarray(targets, dtype=np.int64))
    decoder = torch.full((target_length,), vocab.pad_token_id, dtype=torch.long)
    decoder[1 : len(targets) + 1] = labels[: min(len(targets), target_length - 1)]  # transformers' _shift_right
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder, "labels": labels}


class SpanCorruptedBlocks(Dataset):
    """Span corruption over a dataset of packed blocks (``PackedBlocks``: input_ids + last label = the block)."""

    def __init__(self, blocks: Dataset, vocab: Seq2SeqVocab, input_length: int, target_length: int,
                 noise_density: float, mean_span: float, seed: int) -> None:
        self.blocks, self.vocab, self.seed = blocks, vocab, seed
        self.input_length, self.target_length = input_length, target_length
        self.noise_density, self.mean_span = noise_density, mean_span

    def __len__(self) -> int:
        return len(self.blocks)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        sample = self.blocks[index]
        tokens = torch.cat([sample["input_ids"], sample["labels"][-1:]]).numpy()
        rng = np.random.default_rng((self.seed, index))
        noise = random_spans_noise_mask(len(tokens), self.noise_density, self.mean_span, rng)
        inputs, targets = corrupt(tokens, noise, self.vocab)
        return seq2seq_sample(inputs, targets, self.input_length, self.target_length, self.vocab)


class TokenizedPairs(Dataset):
    """(input, target) pairs stored as an ``.npz`` of ragged token arrays (``ids`` + ``offsets`` per side); each side
    is cut to its length minus one and ends with EOS."""

    def __init__(self, path: str, start: int, stop: int, vocab: Seq2SeqVocab, input_length: int, target_length: int) -> None:
        self.path, self.start, self.stop, self.vocab = path, start, stop, vocab
        self.input_length, self.target_length = input_length, target_length
        self._arrays: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"pair {index} out of range 0..{len(self) - 1}")
        if self._arrays is None:
            with np.load(self.path) as data:
                self._arrays = {k: data[k] for k in data.files}
        a, i = self._arrays, self.start + index
        eos = [self.vocab.eos_token_id]
        inputs = a["input_ids"][a["input_offsets"][i] : a["input_offsets"][i + 1]][: self.input_length - 1]
        targets = a["target_ids"][a["target_offsets"][i] : a["target_offsets"][i + 1]][: self.target_length - 1]
        return seq2seq_sample(np.concatenate([inputs, eos]), np.concatenate([targets, eos]), self.input_length,
                              self.target_length, self.vocab)


def save_pairs(path: str, inputs: Sequence[Sequence[int]], targets: Sequence[Sequence[int]]) -> None:
    """Write tokenized pairs (whole sequences, no EOS) as the ragged ``.npz`` :class:`TokenizedPairs` reads."""
    def ragged(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(r) for r in rows])
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
        return flat, offsets

    (in_ids, in_off), (tg_ids, tg_off) = ragged(inputs), ragged(targets)
    with open(path, "wb") as f:
        np.savez(f, input_ids=in_ids, input_offsets=in_off, target_ids=tg_ids, target_offsets=tg_off)
