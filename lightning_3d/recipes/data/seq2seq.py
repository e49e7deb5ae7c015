"""Seq2seq data for T5: span corruption over text (offline by default), or (input, target) pairs from files.

Span corruption reuses :class:`CausalLMDataModule`'s machinery (offline Python-docs corpus, tokenizer, packed and
cached blocks) with blocks of the raw length that T5's rule gives for ``input_length``; each block is corrupted on
the fly (see :mod:`.span_corruption`). Pairs are read with ``datasets`` (imported lazily) from json/jsonl/parquet
files, tokenized once and cached as ``.npz`` under a key of everything they depend on. As in the causal-LM module,
only data-parallel replicas get distinct samples, and the training loader resumes mid-epoch exactly.

Vocabulary: the text tokenizer's ids, then ``pad`` (also T5's decoder start token) and ``num_sentinels`` sentinels
right after them; a local T5 tokenizer (with ``<extra_id_0>`` ...) keeps its own pad and sentinels.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any, Literal

import lightning as L
from torch.utils.data import DataLoader, Dataset

from lightning_3d.recipes.data.causal_lm import CausalLMDataModule, cache_key, default_cache_dir
from lightning_3d.recipes.data.loader import ResumableDataLoader, build_eval_loader, train_loader_of
from lightning_3d.recipes.data.offline import local_files_only
from lightning_3d.recipes.data.packing import FILE_BUILDERS, resolve_data_files
from lightning_3d.recipes.data.span_corruption import Seq2SeqVocab, SpanCorruptedBlocks, TokenizedPairs, save_pairs, span_lengths
from lightning_3d.recipes.data.tokenizer import (
    BPE_EOS_TOKEN_ID,
    BYTE_VOCAB_SIZE,
    TOKENIZER_STATE_KEY,
    PretrainedTokenizer,
    TextTokenizer,
    files_fingerprint,
    load_tokenizer,
    read_error,
    tokenizer_files,
    tokenizer_kind,
)

PAIRS_FORMAT_VERSION = 1
OBJECTIVES = ("span_corruption", "pairs")


class Seq2SeqDataModule(L.LightningDataModule):
    """Batches of ``input_ids``, ``attention_mask``, ``decoder_input_ids`` and ``labels`` (-100 = ignored).

    ``objective="span_corruption"`` (default): T5's pre-training objective over ``data_files`` (text column
    ``text_column``) or, with none, the offline Python-docs corpus; inputs are exactly ``input_length`` tokens and
    targets exactly the length T5's rule gives (``target_length`` may only make them longer, by padding).
    ``objective="pairs"``: ``input_column`` -> ``target_column`` from local json/jsonl/parquet ``data_files``,
    truncated/padded to ``input_length`` / ``target_length`` (default: ``input_length``), EOS appended. Validation:
    ``val_files``, else the last ``val_fraction`` of the samples. ``tokenizer`` as in :class:`CausalLMDataModule`.
    """

    # Every micro-batch has the same shape: the recipes' sdpa_backends="auto" then keeps torch's own attention kernel
    # (recipes/attention.py, docs/speed.md).
    varies_microbatch_shapes = False

    def __init__(
        self,
        data_files: str | list[str] | None = None,
        val_files: str | list[str] | None = None,
        objective: Literal["span_corruption", "pairs"] = "span_corruption",
        text_column: str = "text",
        input_column: str = "input",
        target_column: str = "target",
        tokenizer: str = "bpe",
        tokenizer_vocab_size: int = 4096,
        num_sentinels: int = 100,
        input_length: int = 128,
        target_length: int | None = None,
        noise_density: float = 0.15,
        mean_noise_span_length: float = 3.0,
        batch_size: int = 8,
        val_fraction: float = 0.02,
        cache_dir: str | None = None,
        num_workers: int = 0,
        seed: int = 1234,
        shuffle: bool = True,
        max_corpus_bytes: int | None = None,
        extended_corpus: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if objective not in OBJECTIVES:
            raise ValueError(f"objective={objective!r} is not one of {list(OBJECTIVES)}.")
        if num_sentinels < 1:
            raise ValueError(f"num_sentinels must be >= 1, got {num_sentinels}")
        self.input_length = input_length
        if objective == "span_corruption":
            self.raw_length, needed = span_lengths(input_length, noise_density, mean_noise_span_length)
            if target_length is not None and target_length < needed:
                raise ValueError(f"target_length={target_length} is shorter than the {needed} target tokens span corruption"
                                 f" of input_length={input_length} produces; leave it unset or raise it.")
            self.target_length = target_length or needed
            self.text = _text_module(
                data_files=data_files, val_files=val_files, text_column=text_column, tokenizer=tokenizer,
                tokenizer_vocab_size=tokenizer_vocab_size, seq_length=self.raw_length - 1, batch_size=batch_size,
                val_fraction=val_fraction, cache_dir=cache_dir, num_workers=num_workers, seed=seed, shuffle=shuffle,
                max_corpus_bytes=max_corpus_bytes, extended_corpus=extended_corpus,
            )
        else:
            if data_files is None:
                raise ValueError("objective='pairs' needs data_files: json/jsonl/parquet files with columns"
                                 f" {input_column!r} and {target_column!r}.")
            self.target_length = target_length or input_length
            self.text = None
        if min(self.input_length, self.target_length) < 2 or batch_size < 1 or num_workers < 0:
            raise ValueError(f"input_length and target_length must be >= 2, batch_size >= 1 and num_workers >= 0; got "
                             f"{self.input_length}, {self.target_length}, {batch_size}, {num_workers}.")
        self.train_files = resolve_data_files(data_files, "data_files")
        self.val_files = resolve_data_files(val_files, "val_files")
        for files in (self.train_files, self.val_files):
            if objective == "pairs" and files is not None and FILE_BUILDERS[files[0].suffix.lower()] == "text":
                raise ValueError(f"objective='pairs' reads json, jsonl or parquet files, not {files[0].suffix} ({files[0]}).")
        self.tokenizer_kind = tokenizer_kind(tokenizer)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self._tokenizer: TextTokenizer | None = None
        self._tokenizer_files: dict[str, bytes] | None = None

    # ----------------------------------------------------------------- vocabulary
    @property
    def vocab(self) -> Seq2SeqVocab:
        """Where eos, pad and the sentinels are (known after ``__init__``; a local tokenizer is loaded for it)."""
        sentinels = self.hparams.num_sentinels
        if self.tokenizer_kind == "bytes":
            return Seq2SeqVocab.appended(BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE - 1, sentinels)
        if self.tokenizer_kind == "bpe":
            return Seq2SeqVocab.appended(self.hparams.tokenizer_vocab_size, BPE_EOS_TOKEN_ID, sentinels)
        tok = self.load_text_tokenizer()
        if isinstance(tok, PretrainedTokenizer) and tok.tokenizer.pad_token_id is not None:
            ids = [tok.tokenizer.convert_tokens_to_ids(f"<extra_id_{k}>") for k in range(sentinels)]
            if all(i is not None and i != tok.tokenizer.unk_token_id for i in ids):  # a T5 tokenizer
                return Seq2SeqVocab(tok.eos_token_id, tok.tokenizer.pad_token_id, tuple(ids), tok.vocab_size)
        return Seq2SeqVocab.appended(tok.vocab_size, tok.eos_token_id, sentinels)

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def pad_token_id(self) -> int:
        return self.vocab.pad_token_id

    @property
    def eos_token_id(self) -> int:
        return self.vocab.eos_token_id

    def load_text_tokenizer(self) -> TextTokenizer:
        """The text tokenizer ("bpe" is trained on the training text, or the pairs' inputs and targets, once)."""
        if self.text is not None:
            return self.text.load_text_tokenizer()
        if self._tokenizer is None:
            texts = fingerprint = None
            if self.tokenizer_kind == "bpe":
                fingerprint = json.dumps(self._pairs_identity(self.train_files))
                texts = lambda: (t for pair in zip(*self._read_pairs(self.train_files), strict=True) for t in pair)  # noqa: E731
            self._tokenizer = load_tokenizer(self.hparams.tokenizer, vocab_size=self.hparams.tokenizer_vocab_size,
                                             cache_dir=self.cache_dir, texts=texts, fingerprint=fingerprint)
        return self._tokenizer

    # ----------------------------------------------------------------- pairs
    def _pairs_identity(self, files: list[Path] | None) -> dict:
        hp = self.hparams
        return {"files": files_fingerprint(files or []), "columns": [hp.input_column, hp.target_column]}

    def pairs_path(self, split: str) -> Path:
        """Cache file of the tokenized ``train`` pairs or of the ``val`` pairs from ``val_files``."""
        hp = self.hparams
        files = self.train_files if split == "train" else self.val_files
        tokenizer = {"spec": hp.tokenizer, "vocab": hp.tokenizer_vocab_size, "train": self._pairs_identity(self.train_files)}
        if self.tokenizer_kind == "local":
            path = Path(hp.tokenizer).expanduser()
            tokenizer = {"files": files_fingerprint(sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path])}
        key = cache_key([PAIRS_FORMAT_VERSION, self._pairs_identity(files), tokenizer, hp.num_sentinels])
        return self.cache_dir / "seq2seq" / f"pairs-{split}-{key}.npz"

    def _read_pairs(self, files: list[Path]) -> tuple[list[str], list[str]]:
        import datasets

        hp = self.hparams
        builder = FILE_BUILDERS[files[0].suffix.lower()]
        try:
            with local_files_only():  # no download counter, no Hub lookup for local files (offline.py)
                ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                           cache_dir=str(self.cache_dir / "hf"))
        except Exception as err:  # datasets' generic errors name neither file nor line
            raise read_error(files, err) from None
        missing = [c for c in (hp.input_column, hp.target_column) if c not in ds.column_names]
        if missing:
            raise ValueError(f"{[str(f) for f in files]} have no column(s) {missing} (columns: {ds.column_names}); set"
                             " input_column and target_column.")
        return [str(t) for t in ds[hp.input_column]], [str(t) for t in ds[hp.target_column]]

    def _build_pairs(self, files: list[Path], path: Path) -> None:
        tokenizer, vocab = self.load_text_tokenizer(), self.vocab
        inputs, targets = self._read_pairs(files)
        if not inputs:
            raise ValueError(f"{[str(f) for f in files]} hold no (input, target) pairs.")
        encoded = []  # whole token sequences: truncation and EOS happen per sample, so the cache fits any length
        for texts in (inputs, targets):
            rows = tokenizer.encode_batch(texts)
            top = max((max(r) for r in rows if r), default=0)
            if top >= vocab.vocab_size:
                raise ValueError(f"The tokenizer produced id {top} >= vocab_size {vocab.vocab_size}.")
            encoded.append(rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}.npz")
        save_pairs(str(tmp), *encoded)
        os.replace(tmp, path)

    # ----------------------------------------------------------------- Lightning hooks
    def state_dict(self) -> dict[str, Any]:
        """What checkpoints record of the data: the text tokenizer's files (see ``CausalLMDataModule.state_dict``;
        export adds ``<pad>`` and the sentinels from the model's ids)."""
        if self._tokenizer_files is None:
            self._tokenizer_files = tokenizer_files(self.load_text_tokenizer())
        return {TOKENIZER_STATE_KEY: self._tokenizer_files}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the tokenizer comes from the arguments; the stored copy serves export."""

    def prepare_data(self) -> None:
        """Build what is not cached yet: corpus, tokenizer and packed blocks, or the tokenized pairs."""
        if self.text is not None:
            self.text.prepare_data()
            return
        for split, files in (("train", self.train_files), ("val", self.val_files)):
            if files is not None and not self.pairs_path(split).exists():
                self._build_pairs(files, self.pairs_path(split))

    def setup(self, stage: str | None = None) -> None:
        hp, vocab = self.hparams, self.vocab
        lengths = (self.input_length, self.target_length)
        if self.text is not None:
            self.text.setup(stage)
            wrap = lambda blocks, seed: SpanCorruptedBlocks(  # noqa: E731
                blocks, vocab, *lengths, hp.noise_density, hp.mean_noise_span_length, seed)
            self.train_dataset = wrap(self.text.train_dataset, hp.seed)
            self.val_dataset = wrap(self.text.val_dataset, hp.seed + 1) if self.text.val_dataset is not None else None
            return
        self.prepare_data()
        train = str(self.pairs_path("train"))
        n = _count(train)
        if self.val_files is not None:
            self.train_dataset = TokenizedPairs(train, 0, n, vocab, *lengths)
            val = str(self.pairs_path("val"))
            self.val_dataset = TokenizedPairs(val, 0, _count(val), vocab, *lengths)
            return
        n_val = max(1, int(n * hp.val_fraction)) if hp.val_fraction > 0 else 0
        if n - n_val < 1:
            raise ValueError(f"Only {n} pair(s): cannot hold out val_fraction={hp.val_fraction} and keep training data."
                             " Add data, set val_fraction=0 or give val_files.")
        self.train_dataset = TokenizedPairs(train, 0, n - n_val, vocab, *lengths)
        self.val_dataset = TokenizedPairs(train, n - n_val, n, vocab, *lengths) if n_val else None

    def train_dataloader(self) -> ResumableDataLoader:
        """Resumable loader over this data-parallel replica's share of the training samples."""
        if self.train_dataset is None:
            self.setup("fit")
        return train_loader_of(self, self.train_dataset)

    def val_dataloader(self) -> DataLoader | list:
        """In-order validation loader, or ``[]`` when nothing is held out."""
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        return build_eval_loader(self.val_dataset, self.hparams.batch_size, trainer=self.trainer,
                                 num_workers=self.hparams.num_workers)

    def test_dataloader(self) -> DataLoader | list:
        """The validation samples (a held-out split is all this module has)."""
        return self.val_dataloader()


def _text_module(**kwargs) -> CausalLMDataModule:
    """The packed-text module span corruption reads, with exactly its own arguments as hparams (LightningCLI hands
    the outer module's hyper-parameters to every ``save_hyperparameters`` run while it instantiates that module)."""
    module = CausalLMDataModule(**kwargs)
    arguments = inspect.signature(CausalLMDataModule.__init__).bind(None, **kwargs)
    arguments.apply_defaults()
    module.save_hyperparameters({k: v for k, v in arguments.arguments.items() if k != "self"})
    return module


def _count(path: str) -> int:
    import numpy as np

    with np.load(path) as data:
        return len(data["input_offsets"]) - 1
