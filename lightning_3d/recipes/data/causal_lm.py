"""Causal-LM data module: tokenize documents once, pack them into blocks, memory-map the blocks.

The packed blocks (see :mod:`.packing`) are stored once in the cache directory under a key that
hashes everything they depend on, so every later run (and every rank) just memory-maps them.

``datasets`` is imported only where files are read: benchmark machines without it can still import
this package and use :class:`SyntheticLMDataModule`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from lightning_3d.recipes.data.corpus import build_python_docs_corpus
from lightning_3d.recipes.data.loader import ResumableDataLoader, build_eval_loader, train_loader_of
from lightning_3d.recipes.data.offline import local_files_only
from lightning_3d.recipes.data.packing import FILE_BUILDERS, PackedBlocks, cap_bytes, pack_documents, resolve_data_files
from lightning_3d.recipes.data.tokenizer import (
    BPE_EOS_TOKEN_ID,
    BYTE_VOCAB_SIZE,
    TOKENIZER_STATE_KEY,
    TextTokenizer,
    files_fingerprint,
    hub_access_allowed,
    load_tokenizer,
    read_error,
    tokenizer_files,
    tokenizer_kind,
)

PACK_FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    """``$LIGHTNING_3D_CACHE`` or ``~/.cache/lightning_3d``."""
    return Path(os.environ.get("LIGHTNING_3D_CACHE") or Path.home() / ".cache" / "lightning_3d").expanduser()


def cache_key(obj: Any) -> str:
    """A short content hash of a JSON-able description, naming a cache entry (data modules share it)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


class CausalLMDataModule(L.LightningDataModule):
    """Packed next-token-prediction data from local files, a hub dataset, or the offline default corpus.

    With neither ``data_files`` nor ``dataset_name`` it trains on Python's own documentation
    (:func:`build_python_docs_corpus`), built into the cache, so it works on any machine offline.
    Without ``val_files`` the LAST ``val_fraction`` of the packed blocks is held out (at least one
    block when ``val_fraction > 0``); ``val_fraction=0`` disables validation. ``max_corpus_bytes``
    caps the training text (and the default corpus); ``extended_corpus=True`` adds the docstrings of the
    installed packages to it (tens of MB: enough for convergence runs). Hub dataset names need ``allow_download=True``
    and neither ``HF_HUB_OFFLINE`` nor ``HF_DATASETS_OFFLINE`` set. ``tokenizer`` is ``"bpe"``
    (trained on the training text with ``tokenizer_vocab_size`` entries at most), ``"bytes"``, or a
    local tokenizer path; see :func:`load_tokenizer`. ``vocab_size`` is then ``tokenizer_vocab_size``,
    257, or the loaded tokenizer's size.
    """

    # Every micro-batch has the same shape: the recipes' sdpa_backends="auto" then keeps torch's own attention kernel
    # (recipes/attention.py, docs/speed.md).
    varies_microbatch_shapes = False

    def __init__(
        self,
        data_files: str | list[str] | None = None,
        val_files: str | list[str] | None = None,
        dataset_name: str | None = None,
        text_column: str = "text",
        tokenizer: str = "bpe",
        tokenizer_vocab_size: int = 4096,
        seq_length: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.02,
        cache_dir: str | None = None,
        num_workers: int = 0,
        seed: int = 1234,
        shuffle: bool = True,
        max_corpus_bytes: int | None = None,
        extended_corpus: bool = False,
        allow_download: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        limits = (("seq_length", seq_length, 1), ("batch_size", batch_size, 1), ("num_workers", num_workers, 0))
        for name, value, low in limits:
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if max_corpus_bytes is not None and max_corpus_bytes < 1:
            raise ValueError(f"max_corpus_bytes must be positive or None, got {max_corpus_bytes}")
        if data_files is not None and dataset_name is not None:
            raise ValueError(f"Give data_files or dataset_name, not both (got {data_files!r} and {dataset_name!r})")
        offline = os.environ.get("HF_DATASETS_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        if dataset_name is not None and (offline or not hub_access_allowed(allow_download)):
            raise ValueError(
                f"dataset_name={dataset_name!r} would be downloaded from the Hugging Face Hub, which is off (needs "
                "allow_download=True and HF_HUB_OFFLINE/HF_DATASETS_OFFLINE unset). Fix: give local data_files, "
                "or leave both unset to use the offline Python-docs corpus."
            )
        self.train_files = resolve_data_files(data_files, "data_files")
        self.val_files = resolve_data_files(val_files, "val_files")
        self.tokenizer_kind = tokenizer_kind(tokenizer, allow_download)
        if self.tokenizer_kind == "bpe" and tokenizer_vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(f"tokenizer_vocab_size must be >= {BYTE_VOCAB_SIZE} for 'bpe', got {tokenizer_vocab_size}")
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.train_dataset: PackedBlocks | None = None
        self.val_dataset: PackedBlocks | None = None
        self.meta: dict | None = None
        self._tokenizer: TextTokenizer | None = None
        self._tokenizer_files: dict[str, bytes] | None = None
        self._documents_cache: dict[str, Callable[[], Iterator[str]]] = {}

    # ----------------------------------------------------------------- cheap metadata
    @property
    def vocab_size(self) -> int:
        """Model vocabulary (embedding rows); available right after ``__init__``."""
        if self.tokenizer_kind == "bytes":
            return BYTE_VOCAB_SIZE
        if self.tokenizer_kind == "bpe":
            return self.hparams.tokenizer_vocab_size
        return self.load_text_tokenizer().vocab_size

    @property
    def eos_token_id(self) -> int:
        """Id appended after every document; available right after ``__init__``."""
        if self.tokenizer_kind == "bytes":
            return BYTE_VOCAB_SIZE - 1
        if self.tokenizer_kind == "bpe":
            return BPE_EOS_TOKEN_ID
        return self.load_text_tokenizer().eos_token_id

    # ----------------------------------------------------------------- sources and keys
    def corpus_path(self) -> Path:
        """Where the default Python-docs corpus lives in the cache (depends on Python version and cap)."""
        cap = f"-max{self.hparams.max_corpus_bytes}" if self.hparams.max_corpus_bytes else ""
        kind = "python-docs-extended" if self.hparams.extended_corpus else "python-docs"
        return self.cache_dir / "corpus" / f"{kind}-{sys.version_info[0]}.{sys.version_info[1]}{cap}.jsonl"

    def _resolved_train_files(self) -> list[Path] | None:
        if self.train_files is not None or self.hparams.dataset_name is not None:
            return self.train_files
        path = self.corpus_path()
        if not path.exists():
            build_python_docs_corpus(path, self.hparams.max_corpus_bytes, self.hparams.extended_corpus)
        return [path]

    def _train_identity(self) -> dict:
        if self.train_files is not None:
            source: dict = {"files": files_fingerprint(self.train_files)}
        elif self.hparams.dataset_name is not None:
            source = {"hub": self.hparams.dataset_name}
        else:  # the default corpus is a pure function of the Python installation and the cap
            source = {"corpus": self.corpus_path().name, "python": sys.version}
        return {**source, "column": self.hparams.text_column, "max_bytes": self.hparams.max_corpus_bytes}

    def _tokenizer_identity(self) -> dict:
        spec = self.hparams.tokenizer
        if self.tokenizer_kind == "bpe":
            return {"spec": "bpe", "vocab": self.hparams.tokenizer_vocab_size, "train": self._train_identity()}
        if self.tokenizer_kind == "local":
            path = Path(spec).expanduser()
            files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
            return {"files": files_fingerprint(files)}
        return {"spec": spec}

    def packed_path(self, split: str) -> Path:
        """Cache file of the packed ``train`` blocks or of the ``val`` blocks from ``val_files``."""
        data = self._train_identity() if split == "train" else {"files": files_fingerprint(self.val_files or [])}
        key = cache_key([PACK_FORMAT_VERSION, data, self._tokenizer_identity(), self.hparams.seq_length])
        return self.cache_dir / "packed" / f"{split}-{key}.npy"

    def _documents(self, files: list[Path] | None, max_bytes: int | None) -> Callable[[], Iterator[str]]:
        """A re-iterable source of the documents, read with ``datasets`` (imported here, lazily)."""
        import datasets

        column = self.hparams.text_column
        hf_cache = str(self.cache_dir / "hf")
        if files is None:
            ds = datasets.load_dataset(self.hparams.dataset_name, split="train", cache_dir=hf_cache)
            where = repr(self.hparams.dataset_name)
        else:
            builder = FILE_BUILDERS[files[0].suffix.lower()]
            extra = {"sample_by": "document"} if builder == "text" else {}
            paths = [str(f) for f in files]
            try:
                with local_files_only():  # no download counter, no Hub lookup for local files (offline.py)
                    ds = datasets.load_dataset(builder, data_files=paths, split="train", cache_dir=hf_cache, **extra)
            except Exception as err:  # datasets' generic errors name neither file nor line
                raise read_error(files, err) from None
            where = str(paths)
        if column not in ds.column_names:
            raise ValueError(f"text_column={column!r} is not a column of {where}; columns are {ds.column_names}")

        def documents() -> Iterator[str]:
            texts = (t for batch in ds.iter(batch_size=1000) for t in batch[column] if t)
            return cap_bytes(texts, max_bytes)

        return documents

    def _train_documents(self) -> Callable[[], Iterator[str]]:
        if "train" not in self._documents_cache:
            files, cap = self._resolved_train_files(), self.hparams.max_corpus_bytes
            self._documents_cache["train"] = self._documents(files, cap)
        return self._documents_cache["train"]

    def load_text_tokenizer(self) -> TextTokenizer:
        """The tokenizer object (for ``"bpe"`` this trains it on the training text unless cached)."""
        if self._tokenizer is None:
            texts = fingerprint = None
            if self.tokenizer_kind == "bpe":
                # Lazily: the documents are opened (``datasets`` imported, the corpus loaded and cached in this
                # module) only when the tokenizer must be trained; with a cached tokenizer, e.g. a rank other than
                # the one that ran ``prepare_data`` asked for ``state_dict`` at a checkpoint, nothing is read.
                texts = lambda: self._train_documents()()  # noqa: E731
                fingerprint = json.dumps(self._train_identity(), sort_keys=True)
            self._tokenizer = load_tokenizer(
                self.hparams.tokenizer,
                vocab_size=self.hparams.tokenizer_vocab_size,
                cache_dir=self.cache_dir,
                texts=texts,
                fingerprint=fingerprint,
                allow_download=self.hparams.allow_download,
            )
        return self._tokenizer

    def state_dict(self) -> dict[str, Any]:
        """What checkpoints record of the data: the tokenizer's files (``tokenizer.json`` or a directory's files, a
        few hundred kB), so that a checkpoint knows its tokenizer wherever it is moved and ``lightning-3d export``
        includes it by default. Read once per data module."""
        if self._tokenizer_files is None:
            self._tokenizer_files = tokenizer_files(self.load_text_tokenizer())
        return {TOKENIZER_STATE_KEY: self._tokenizer_files}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the tokenizer comes from the arguments; the stored copy serves export."""

    # ----------------------------------------------------------------- Lightning hooks
    def prepare_data(self) -> None:
        """Build the corpus, tokenizer and packed blocks that are not cached yet (local rank 0)."""
        train_path = self.packed_path("train")
        todo = [] if train_path.exists() else [("train", train_path)]
        if self.val_files is not None and not (val_path := self.packed_path("val")).exists():
            todo.append(("val", val_path))
        for split, path in todo:
            tokenizer = self.load_text_tokenizer()
            documents = self._train_documents() if split == "train" else self._documents(self.val_files, None)
            path.parent.mkdir(parents=True, exist_ok=True)
            pack_documents(documents(), tokenizer, self.vocab_size, self.hparams.seq_length, path)
        self._documents_cache.clear()

    def setup(self, stage: str | None = None) -> None:
        """Memory-map the packed blocks and split off validation."""
        train_path = self.packed_path("train")
        val_path = self.packed_path("val") if self.val_files is not None else None
        if not train_path.exists() or (val_path is not None and not val_path.exists()):
            self.prepare_data()
        self.meta = json.loads(train_path.with_suffix(".json").read_text())
        n = self.meta["num_blocks"]
        if val_path is not None:
            self.train_dataset = PackedBlocks(train_path, 0, n)
            n_val = json.loads(val_path.with_suffix(".json").read_text())["num_blocks"]
            self.val_dataset = PackedBlocks(val_path, 0, n_val)
            return
        n_val = max(1, int(n * self.hparams.val_fraction)) if self.hparams.val_fraction > 0 else 0
        if n - n_val < 1:
            raise ValueError(
                f"Only {n} packed block(s): cannot hold out val_fraction={self.hparams.val_fraction} and keep training "
                "data. Add data, lower seq_length, set val_fraction=0 or give val_files."
            )
        self.train_dataset = PackedBlocks(train_path, 0, n - n_val)
        self.val_dataset = PackedBlocks(train_path, n - n_val, n) if n_val else None

    def train_dataloader(self) -> ResumableDataLoader:
        """Resumable loader over this data-parallel replica's share of the training blocks."""
        if self.train_dataset is None:
            self.setup("fit")
        return train_loader_of(self, self.train_dataset)

    def val_dataloader(self) -> DataLoader | list:
        """In-order validation loader, or ``[]`` (no validation) when nothing is held out."""
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None:
            return []
        return build_eval_loader(
            self.val_dataset, self.hparams.batch_size, trainer=self.trainer, num_workers=self.hparams.num_workers
        )
