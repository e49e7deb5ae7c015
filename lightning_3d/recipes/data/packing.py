"""Reading document files and packing their tokens into fixed-length blocks on disk.

Documents are tokenized, each is followed by EOS, and the token stream is cut into blocks of
``seq_length + 1`` tokens (the remainder is dropped); a sample is ``input_ids = block[:-1]`` and
``labels = block[1:]``. Blocks are stored as ``.npy`` (``uint16`` when the vocabulary has at most
65535 entries, else ``int32``) and memory-mapped, so every rank and every worker shares the page cache.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_3d.recipes.data.tokenizer import TextTokenizer

# Extension -> `datasets` builder. A `.txt` file is ONE document (the whole file, byte-exact):
# splitting on lines or blank lines would cut prose mid-thought; use JSON lines for many documents.
FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def resolve_data_files(files: str | list[str] | None, argument: str) -> list[Path] | None:
    """Expand globs, check that every file exists and that all share one supported extension."""
    if files is None:
        return None
    patterns = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not patterns:
        raise ValueError(f"{argument} is an empty list; give at least one file or leave it unset")
    paths: list[Path] = []
    for pattern in map(str, patterns):
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(os.path.expanduser(pattern)))
            if not matches:
                raise FileNotFoundError(f"{argument}: no files match {pattern!r}")
            paths.extend(map(Path, matches))
        else:
            path = Path(pattern).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"{argument}: file {pattern!r} does not exist")
            paths.append(path)
    suffixes = sorted({p.suffix.lower() for p in paths})
    if len(suffixes) > 1:
        raise ValueError(f"{argument}: all files must have the same type, got mixed extensions {suffixes}")
    if suffixes[0] not in FILE_BUILDERS:
        raise ValueError(f"{argument}: unsupported extension {suffixes[0]!r}; use one of {sorted(FILE_BUILDERS)}")
    return paths


class PackedBlocks(Dataset):
    """Rows ``start..stop`` of a packed ``.npy``, opened lazily so workers never pickle the data."""

    def __init__(self, path: str | Path, start: int, stop: int) -> None:
        self.path, self.start, self.stop = str(path), start, stop
        self._blocks: np.ndarray | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} out of range 0..{len(self) - 1}")
        if self._blocks is None:
            self._blocks = np.load(self.path, mmap_mode="r")
        block = torch.from_numpy(self._blocks[self.start + index].astype(np.int64))
        return {"input_ids": block[:-1], "labels": block[1:]}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_blocks": None}


def cap_bytes(documents: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """Stop after ``max_bytes`` of UTF-8 text; the crossing document is cut."""
    budget = max_bytes
    for text in documents:
        if budget is not None:
            data = text.encode("utf-8")
            if len(data) > budget:
                text = data[:budget].decode("utf-8", errors="ignore")
            budget -= len(data)
        if text:
            yield text
        if budget is not None and budget <= 0:
            return


def pack_documents(
    documents: Iterable[str], tokenizer: TextTokenizer, vocab_size: int, seq_length: int, out: Path
) -> dict[str, int]:
    """Tokenize, append EOS per document, cut into ``(n, seq_length + 1)`` blocks and save as ``.npy``.

    Tokens stream through a temporary raw file so memory stays flat for large corpora; the result is
    renamed into place only when complete. Returns the metadata that is also saved next to it.
    """
    dtype = np.uint16 if vocab_size <= 65535 else np.int32
    eos = np.array([tokenizer.eos_token_id], dtype=dtype)
    raw = out.with_name(f"{out.name}.tokens-{os.getpid()}")
    n_tokens = n_docs = 0
    documents = iter(documents)
    try:
        with raw.open("wb") as f:
            while batch := list(islice(documents, 256)):
                ids = tokenizer.encode_batch(batch)
                top = max((max(doc) for doc in ids if len(doc)), default=0)
                if top >= vocab_size:
                    raise ValueError(f"Tokenizer produced id {top} >= vocab_size {vocab_size}")
                flat = np.concatenate([part for doc in ids for part in (np.asarray(doc, dtype=dtype), eos)])
                f.write(flat.tobytes())
                n_tokens, n_docs = n_tokens + flat.size, n_docs + len(batch)
        n_blocks = n_tokens // (seq_length + 1)
        if n_blocks == 0:
            raise ValueError(
                f"The text gives only {n_tokens} tokens ({n_docs} documents), fewer than seq_length + 1 = "
                f"{seq_length + 1} needed for one block. Add data, raise max_corpus_bytes or lower seq_length."
            )
        tokens = np.memmap(raw, dtype=dtype, mode="r", shape=(n_blocks * (seq_length + 1),))
        tmp = out.with_name(f"{out.stem}.tmp-{os.getpid()}.npy")
        blocks = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n_blocks, seq_length + 1))
        blocks[:] = tokens.reshape(n_blocks, seq_length + 1)
        blocks.flush()
        del blocks, tokens
        meta = {"num_documents": n_docs, "num_tokens": n_tokens, "num_blocks": n_blocks, "seq_length": seq_length,
                "vocab_size": vocab_size, "eos_token_id": tokenizer.eos_token_id}
        meta_tmp = out.with_name(f"{out.stem}.tmp-{os.getpid()}.json")
        meta_tmp.write_text(json.dumps(meta, indent=1))
        os.replace(meta_tmp, out.with_suffix(".json"))  # metadata first: the .npy marks completion
        os.replace(tmp, out)
        return meta
    finally:
        raw.unlink(missing_ok=True)
