"""Cutting a global batch of variable-length samples into this data-parallel replica's micro-batches.

A sample is a dict of NumPy token arrays: GPT ``{"tokens", "prompt"}`` (``input_ids = tokens[:-1]``, ``labels =
tokens[1:]`` with the first ``prompt - 1`` labels ignored: the loss is on the target) or T5 ``{"inputs",
"targets"}`` (EOS included). The micro-batchings (docs/multitask.md says when to use which):

- ``padding``: ``micro_batch_size`` samples in sampled order, each micro-batch padded to its longest sample;
- ``token_budget``: samples sorted by length and grouped while ``count x longest <= token_budget`` (padded);
- ``packing``: samples packed first-fit-decreasing into rows of ``seq_length`` (T5: and ``target_length``) tokens
  with ``document_ids`` (and GPT ``position_ids``), ``micro_batch_size`` rows per micro-batch: the models mask
  attention across documents, so packing changes no sample's loss;
- ``dynamic``: DynaPipe's planner (``lightning_3d.dynamic``) chooses the micro-batches from a cost model;
- ``packed_dynamic``: the same planner over packed rows (its micro-batches are packed rows with document ids);
- ``auto``: per global batch, the cheapest under that cost model of dynamic, packed dynamic, packing and token
  budgets (``lightning_3d.dynamic.choose_step``).

Padding labels are -100 and T5 encoder padding is masked (``attention_mask``). The global batch is split over the
replicas by position (replica ``r`` takes samples ``r, r + dp, ...``), so replicas hold the same number of samples and
different numbers of tokens: the pipeline normalises the loss by the target tokens of all replicas together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_3d.dynamic.choice import token_budget_groups
from lightning_3d.dynamic.packed import first_fit_decreasing, packed_groups_to_multiple
from lightning_3d.pipeline.microbatch import MicroBatches
from lightning_3d.recipes.training import IGNORE_INDEX

MICROBATCHINGS = ("padding", "packing", "token_budget", "dynamic", "packed_dynamic", "auto")
# Planned by ``lightning_3d.dynamic`` over the whole global batch (every replica plans it and keeps its share).
PLANNED = ("dynamic", "packed_dynamic", "auto")
Sample = dict[str, Any]


def sample_lengths(sample: Sample) -> tuple[int, int]:
    """(sequence length, target length) a sample occupies: GPT (tokens - 1, 0), T5 (input, target)."""
    if "tokens" in sample:
        return len(sample["tokens"]) - 1, 0
    return len(sample["inputs"]), len(sample["targets"])


def sample_input_length(sample: Sample) -> int:
    """The dynamic planner's sequence length of a sample (module-level: picklable into DataLoader workers)."""
    return sample_lengths(sample)[0]


def sample_target_length(sample: Sample) -> int:
    return sample_lengths(sample)[1]


# ----- collate: samples -> one micro-batch dict ---------------------------------------------------------------------
def collate_gpt(samples: Sequence[Sample], seq_len: int, pad_id: int) -> dict[str, Tensor]:
    """``input_ids`` / ``labels`` of shape (len(samples), seq_len); padding after each sample, labels -100 there
    (causal attention never lets a real token see the padding behind it, so no mask is needed)."""
    ids = np.full((len(samples), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(samples), seq_len), IGNORE_INDEX, dtype=np.int64)
    for row, sample in enumerate(samples):
        tokens, n = sample["tokens"], len(sample["tokens"]) - 1
        ids[row, :n], labels[row, :n] = tokens[:-1], tokens[1:]
        labels[row, : max(sample["prompt"] - 1, 0)] = IGNORE_INDEX
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}


def collate_t5(samples: Sequence[Sample], seq_len: int, target_len: int, pad_id: int) -> dict[str, Tensor]:
    """T5 ``input_ids`` / ``attention_mask`` (seq_len) and ``decoder_input_ids`` / ``labels`` (target_len); the
    decoder input is the target shifted right behind the start token (``pad_id``, as in T5)."""
    b = len(samples)
    ids, mask = np.full((b, seq_len), pad_id, dtype=np.int64), np.zeros((b, seq_len), dtype=np.int64)
    dec = np.full((b, target_len), pad_id, dtype=np.int64)
    labels = np.full((b, target_len), IGNORE_INDEX, dtype=np.int64)
    for row, sample in enumerate(samples):
        inputs, targets = sample["inputs"], sample["targets"]
        ids[row, : len(inputs)], mask[row, : len(inputs)] = inputs, 1
        labels[row, : len(targets)], dec[row, 1 : len(targets)] = targets, targets[:-1]
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
            "decoder_input_ids": torch.from_numpy(dec), "labels": torch.from_numpy(labels)}


def collate_packed_gpt(rows: Sequence[Sequence[Sample]], seq_len: int, pad_id: int) -> dict[str, Tensor]:
    """Rows of concatenated samples: ``document_ids`` 0, 1, ... per sample (the padding tail is one more document),
    ``position_ids`` restarting at 0 per document, labels -100 on prompts and padding."""
    flat = collate_gpt([s for row in rows for s in row], seq_len, pad_id)
    shape = (len(rows), seq_len)
    ids, labels = np.full(shape, pad_id, dtype=np.int64), np.full(shape, IGNORE_INDEX, dtype=np.int64)
    docs, positions = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    k = 0
    for r, row in enumerate(rows):
        at = 0
        for d, sample in enumerate(row):
            n = len(sample["tokens"]) - 1
            ids[r, at : at + n], labels[r, at : at + n] = flat["input_ids"][k, :n], flat["labels"][k, :n]
            docs[r, at : at + n], positions[r, at : at + n] = d, np.arange(n)
            at, k = at + n, k + 1
        docs[r, at:], positions[r, at:] = len(row), np.arange(seq_len - at)
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions), "document_ids": torch.from_numpy(docs)}


def collate_packed_t5(rows: Sequence[Sequence[Sample]], seq_len: int, target_len: int,
                      pad_id: int) -> dict[str, Tensor]:
    """Rows of concatenated pairs with encoder ``document_ids`` and ``decoder_document_ids`` (pair d of a row is d
    on both sides; the padding tails are one more "pair"); each decoder input restarts with the start token."""
    shape, tshape = (len(rows), seq_len), (len(rows), target_len)
    ids, docs = np.full(shape, pad_id, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    dec, labels = np.full(tshape, pad_id, dtype=np.int64), np.full(tshape, IGNORE_INDEX, dtype=np.int64)
    dec_docs = np.zeros(tshape, dtype=np.int64)
    for r, row in enumerate(rows):
        at = tat = 0
        for d, sample in enumerate(row):
            inputs, targets = sample["inputs"], sample["targets"]
            ids[r, at : at + len(inputs)], docs[r, at : at + len(inputs)] = inputs, d
            labels[r, tat : tat + len(targets)], dec_docs[r, tat : tat + len(targets)] = targets, d
            dec[r, tat + 1 : tat + len(targets)] = targets[:-1]
            at, tat = at + len(inputs), tat + len(targets)
        docs[r, at:], dec_docs[r, tat:] = len(row), len(row)
    return {"input_ids": torch.from_numpy(ids), "document_ids": torch.from_numpy(docs),
            "decoder_input_ids": torch.from_numpy(dec), "decoder_document_ids": torch.from_numpy(dec_docs),
            "labels": torch.from_numpy(labels)}


# ----- planners: which samples go together ------------------------------------------------------------------------
def _cost(lengths: Sequence[tuple[int, int]]) -> tuple[int, int]:
    return max(s for s, _ in lengths), max(t for _, t in lengths)


def plan_padding(lengths: Sequence[tuple[int, int]], micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` samples (the last may be smaller)."""
    return [list(range(i, min(i + micro_batch_size, len(lengths)))) for i in range(0, len(lengths), micro_batch_size)]


def plan_token_budget(lengths: Sequence[tuple[int, int]], budget: int) -> list[list[int]]:
    """Samples sorted by length (longest first, ties by position) and grouped greedily while the padded micro-batch
    holds at most ``budget`` tokens: ``count x (longest input + longest target)`` (``microbatching="auto"`` costs
    the same groups: ``lightning_3d.dynamic.choice``)."""
    return token_budget_groups(lengths, budget)


def plan_packing(lengths: Sequence[tuple[int, int]], capacity: tuple[int, int]) -> list[list[int]]:
    """First-fit decreasing into rows of ``capacity`` (sequence, target) tokens; rows keep their samples in order of
    placement. Deterministic (stable sort on length, then position); ``microbatching="auto"`` packs the same rows."""
    return first_fit_decreasing(lengths, capacity)


class StepCollator:
    """``collate_fn`` of the training loader: a global batch of samples -> this replica's ``MicroBatches``.

    Picklable (DataLoader workers run it). ``dynamic``: a ``lightning_3d.dynamic.DynamicMicroBatcher`` (``samples ->
    MicroBatches`` with the step's schedule) built by the data module; it sees the whole global batch, to balance the
    replicas, and collates with :meth:`collate`.
    """

    def __init__(self, model_type: str, microbatching: str, dp: int, rank: int, *, seq_length: int, target_length: int,
                 pad_id: int, micro_batch_size: int, token_budget: int | None, microbatch_multiple: int = 1,
                 dynamic: Callable[[list[Sample]], MicroBatches] | None = None) -> None:
        if microbatching not in MICROBATCHINGS:
            raise ValueError(f"microbatching={microbatching!r} is not one of {list(MICROBATCHINGS)}.")
        self.model_type, self.microbatching, self.dp, self.rank = model_type, microbatching, dp, rank
        self.seq_length, self.target_length, self.pad_id = seq_length, target_length, pad_id
        self.micro_batch_size, self.token_budget, self.dynamic = micro_batch_size, token_budget, dynamic
        self.microbatch_multiple = microbatch_multiple

    @property
    def varies_microbatch_shapes(self) -> bool:
        """As ``MultiTaskDataModule.varies_microbatch_shapes``, for a loader handed to ``fit`` without its module."""
        return self.microbatching != "packing"

    def collate(self, samples: Sequence[Sample], seq_len: int, target_len: int | None) -> dict[str, Tensor]:
        """One padded micro-batch of exactly (seq_len, target_len): what the dynamic planner calls (GPT: target_len
        is ignored)."""
        if self.model_type == "gpt":
            return collate_gpt(samples, seq_len, self.pad_id)
        return collate_t5(samples, seq_len, target_len, self.pad_id)

    def collate_packed(self, rows: Sequence[Sequence[Sample]], seq_len: int, target_len: int | None) -> dict[str, Tensor]:
        """One micro-batch of packed rows of (seq_len, target_len) tokens with document ids: what the planner calls
        for packed candidates (GPT: target_len is ignored)."""
        if self.model_type == "gpt":
            return collate_packed_gpt(rows, seq_len, self.pad_id)
        return collate_packed_t5(rows, seq_len, target_len, self.pad_id)

    def microbatches(self, samples: Sequence[Sample]) -> list[dict[str, Tensor]]:
        """Micro-batches of some samples (one replica's share) under the padding/packing/token_budget options."""
        lengths = [sample_lengths(s) for s in samples]
        if self.microbatching == "packing":
            rows = plan_packing(lengths, (self.seq_length, self.target_length))
            groups = [rows[i : i + self.micro_batch_size] for i in range(0, len(rows), self.micro_batch_size)]
            if self.microbatch_multiple > 1:  # halving, then splitting rows: what auto's packing candidate prices
                try:
                    groups = packed_groups_to_multiple(groups, [sum(n) for n in lengths], self.microbatch_multiple)
                except ValueError as err:
                    raise ValueError(f"Cannot make micro-batches a multiple of microbatch_multiple="
                                     f"{self.microbatch_multiple}: {err} Raise global_batch_size or lower"
                                     " microbatch_multiple.") from None
            groups = [[[samples[i] for i in row] for row in group] for group in groups]
            if self.model_type == "gpt":
                return [collate_packed_gpt(g, self.seq_length, self.pad_id) for g in groups]
            return [collate_packed_t5(g, self.seq_length, self.target_length, self.pad_id) for g in groups]
        if self.microbatching == "padding":
            plan = plan_padding(lengths, self.micro_batch_size)
        else:
            plan = plan_token_budget(lengths, self.token_budget)
        return [self.collate([samples[i] for i in g], *_cost([lengths[i] for i in g])) for g in plan]

    def __call__(self, samples: list[Sample]) -> MicroBatches:
        if self.microbatching in PLANNED:
            if self.dynamic is None:
                raise RuntimeError(f"microbatching={self.microbatching!r} needs the planner the data module builds in"
                                   " train_dataloader(); call it through the data module.")
            return self.dynamic(samples)
        share = samples[self.rank :: self.dp]
        if not share:
            raise ValueError(f"A global batch of {len(samples)} samples leaves replica {self.rank} of {self.dp} none:"
                             f" make global_batch_size >= {self.dp} (the data-parallel size).")
        return MicroBatches(split_to_multiple(self.microbatches(share), self.microbatch_multiple))


def split_to_multiple(mbs: list[dict[str, Tensor]], multiple: int) -> list[dict[str, Tensor]]:
    """Halve the micro-batch with the most rows until the count is a multiple of ``multiple`` (schedules such as
    interleaved 1F1B need a multiple of the pipeline size); shapes stay valid, only the batch dimension is cut."""
    mbs = list(mbs)
    while len(mbs) % multiple:
        big = max(range(len(mbs)), key=lambda i: (mbs[i]["input_ids"].shape[0], -i))
        rows = mbs[big]["input_ids"].shape[0]
        if rows < 2:
            raise ValueError(f"Cannot make {len(mbs)} micro-batches a multiple of microbatch_multiple={multiple}: every"
                             " micro-batch holds one row. Raise global_batch_size or lower microbatch_multiple.")
        half = rows // 2
        mbs[big : big + 1] = [{k: v[:half] for k, v in mbs[big].items()}, {k: v[half:] for k, v in mbs[big].items()}]
    return mbs
