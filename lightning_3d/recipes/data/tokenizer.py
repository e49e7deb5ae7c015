"""Tokenizers that work offline by default.

``load_tokenizer(spec, ...)`` understands four kinds of spec:

* ``"bytes"``: UTF-8 bytes are the ids 0..255 and EOS is 256 (vocab 257); nothing to train or load.
* ``"bpe"``: a byte-level BPE trained with HF ``tokenizers`` on the training text, cached as
  ``<cache_dir>/tokenizers/bpe-<vocab>-<hash>/tokenizer.json`` so later runs just load it.
  ``<|endoftext|>`` is its first special token, so its id is always 0. The trainer stops early when
  the text has no more pairs to merge, so the trained vocabulary has *at most* ``vocab_size``
  entries; every id is below ``vocab_size``, which is therefore the embedding size to use.
* an existing local path: a directory with ``tokenizer_config.json`` (loaded with
  ``transformers.AutoTokenizer``, ``local_files_only=True``), a directory with ``tokenizer.json`` or
  that file itself (``tokenizers.Tokenizer.from_file``), or a directory saved from ``"bytes"``.
* anything else is a Hugging Face Hub name, used only with ``allow_download=True`` while
  ``HF_HUB_OFFLINE`` is not set: nothing is ever fetched by default.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

EOS_TOKEN = "<|endoftext|>"
BPE_EOS_TOKEN_ID = 0  # BpeTrainer assigns special tokens the first ids
BYTE_VOCAB_SIZE = 257
_BYTES_FILE = "byte_tokenizer.json"
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")


class TextTokenizer(Protocol):
    """What the data modules need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str | Path) -> Path: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no files, identical everywhere."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_token_id = 256

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / _BYTES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"type": "bytes", "eos_token_id": self.eos_token_id}))
        return path


class FastTokenizer:
    """A ``tokenizers.Tokenizer`` (for example a ``tokenizer.json``) with a known EOS token."""

    def __init__(self, tokenizer: Any, eos_token: str | None = None, source: str = "tokenizer") -> None:
        self.tokenizer = tokenizer
        candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
        ids = [tokenizer.token_to_id(t) for t in candidates]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"{source} has none of the end-of-text tokens {list(candidates)} to separate documents")
        self._eos = found[0]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int:
        return self._eos

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path))
        return path


class PretrainedTokenizer:
    """A ``transformers`` tokenizer directory (``tokenizer_config.json`` and friends)."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"Tokenizer {source!r} defines no eos_token; cannot separate documents")
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def save(self, directory: str | Path) -> Path:
        self.tokenizer.save_pretrained(str(directory))
        return Path(directory)


# The key under which the recipes' data modules store their tokenizer's files in a checkpoint (their ``state_dict``),
# so that a checkpoint knows its tokenizer wherever it is moved: ``lightning-3d export`` includes it by default.
TOKENIZER_STATE_KEY = "tokenizer_files"


def tokenizer_files(tokenizer: TextTokenizer) -> dict[str, bytes]:
    """The files ``tokenizer.save`` writes (relative name -> content): a copy that :func:`write_tokenizer_files` turns
    back into a directory :func:`load_tokenizer` reads."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        return {p.relative_to(tmp).as_posix(): p.read_bytes() for p in sorted(Path(tmp).rglob("*")) if p.is_file()}


def write_tokenizer_files(files: dict[str, bytes], directory: str | Path) -> Path:
    """Write :func:`tokenizer_files`' output into ``directory``; names that would leave it are refused (the files
    come from a checkpoint, which users may have received from anyone)."""
    directory = Path(directory)
    for name, content in files.items():
        parts = Path(name).parts
        if not isinstance(content, bytes) or not parts or Path(name).is_absolute() or ".." in parts:
            raise ValueError(f"Stored tokenizer file {name!r} is not a plain relative file name with bytes content;"
                             " the checkpoint was altered. Pass the tokenizer explicitly (--tokenizer PATH).")
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    return directory


def hub_access_allowed(allow_download: bool) -> bool:
    """Hub downloads need an explicit opt-in and must not contradict ``HF_HUB_OFFLINE``."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return allow_download and not offline


def tokenizer_kind(spec: str, allow_download: bool = False) -> str:
    """Classify ``spec`` as ``bytes``, ``bpe``, ``local`` or ``hub``; raise if a hub name is not allowed."""
    if spec in ("bytes", "bpe"):
        return spec
    if Path(spec).expanduser().exists():
        return "local"
    if not hub_access_allowed(allow_download):
        raise ValueError(
            f"Tokenizer {spec!r} is neither 'bytes', 'bpe' nor an existing local path, so it would have to be "
            f"downloaded from the Hugging Face Hub, which is off (needs allow_download=True and HF_HUB_OFFLINE "
            f"unset; HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE')!r}). Fix: give a local path to a tokenizer "
            "directory or tokenizer.json, 'bpe' to train one on the data, or 'bytes'."
        )
    return "hub"


def files_fingerprint(paths: Iterable[str | Path]) -> list[tuple[str, int, int]]:
    """(resolved path, size, mtime) of each file: cheap, and changes whenever the content does."""
    out = []
    for p in paths:
        st = Path(p).stat()
        out.append((str(Path(p).resolve()), st.st_size, st.st_mtime_ns))
    return out


def unreadable_line(path: str | Path) -> str | None:
    """Where a local ``.txt`` / ``.json`` / ``.jsonl`` data file cannot be read ("FILE, line N: why"), else None.
    Run only after a read failed (``datasets`` names neither file nor line): it reads the file once more."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        return (f"{path}, line {line}: byte 0x{raw[err.start]:02x} at offset {err.start} is not UTF-8 text (a binary"
                " file?); data files must be UTF-8 text")
    suffix = path.suffix.lower()
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return f"{path}, line {err.lineno}: not valid JSON ({err.msg})"
        return None
    if suffix in (".json", ".jsonl"):
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                return f"{path}, line {number}: not valid JSON ({err.msg}); JSON lines hold one object per line"
            if not isinstance(record, dict):
                return f"{path}, line {number}: a JSON {type(record).__name__}, not an object such as {{\"text\": \"...\"}}"
    return None


def read_error(paths: Sequence[str | Path], err: Exception) -> Exception:
    """The error to raise when reading local data ``paths`` failed with ``err``: a ValueError naming the file and
    line when one of them is malformed, else ``err`` itself."""
    for p in paths:
        if Path(p).suffix.lower() in (".txt", ".json", ".jsonl") and (where := unreadable_line(p)):
            return ValueError(f"Cannot read data file {where}. Fix or remove it.")
    return err


def iter_file_texts(paths: Sequence[str | Path], text_column: str = "text") -> Iterator[str]:
    """Documents of local files without ``datasets``: ``.txt`` whole file, JSON lines/array, parquet."""
    for p in map(Path, paths):
        suffix = p.suffix.lower()
        if suffix == ".txt":
            try:
                yield p.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise read_error([p], err) from None
        elif suffix in (".json", ".jsonl"):
            try:
                raw = p.read_text(encoding="utf-8")
                is_array = raw.lstrip().startswith("[")
                records = json.loads(raw) if is_array else [json.loads(line) for line in raw.splitlines() if line.strip()]
                texts = [r[text_column] for r in records if r.get(text_column)]
            except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
                raise read_error([p], err) from None
            yield from texts
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            yield from (t for t in pq.read_table(p, columns=[text_column]).column(text_column).to_pylist() if t)
        else:
            raise ValueError(f"Cannot read training text from {str(p)!r}: use .txt, .json, .jsonl or .parquet")


def _train_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """Train a byte-level BPE (GPT-2 style pre-tokenization, all 256 bytes in the alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(
    spec: str,
    training_files: Sequence[str | Path] = (),
    vocab_size: int = 4096,
    cache_dir: str | Path | None = None,
    *,
    texts: Callable[[], Iterable[str]] | None = None,
    fingerprint: str | None = None,
    allow_download: bool = False,
) -> TextTokenizer:
    """Build or load the tokenizer named by ``spec`` (see the module docstring).

    For ``"bpe"`` the training text is ``texts()`` when given (``fingerprint`` must then identify it
    for the cache), else the documents of ``training_files`` (fingerprinted by path, size, mtime).
    """
    kind = tokenizer_kind(spec, allow_download)
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "local":
        return _load_local(Path(spec).expanduser())
    if kind == "hub":
        from transformers import AutoTokenizer

        hub_cache = str(Path(cache_dir) / "hf") if cache_dir else None
        return PretrainedTokenizer(AutoTokenizer.from_pretrained(spec, cache_dir=hub_cache), spec)
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(f"bpe vocab_size must be at least {BYTE_VOCAB_SIZE} (256 bytes + EOS), got {vocab_size}")
    if texts is None:
        if not training_files:
            raise ValueError("Training a 'bpe' tokenizer needs training_files or texts")
        fingerprint = json.dumps(files_fingerprint(training_files))
        files = list(training_files)
        texts = lambda: iter_file_texts(files)  # noqa: E731
    elif fingerprint is None:
        raise ValueError("load_tokenizer(texts=...) needs a fingerprint that identifies the text for caching")
    if cache_dir is None:
        raise ValueError("Training a 'bpe' tokenizer needs a cache_dir to store it in")
    digest = hashlib.sha256(json.dumps(["bpe-v1", vocab_size, fingerprint]).encode()).hexdigest()[:16]
    path = Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{digest}" / "tokenizer.json"
    if not path.exists():
        trained = _train_bpe(texts(), vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"tokenizer.json.tmp-{os.getpid()}")
        trained.save(str(tmp))
        os.replace(tmp, path)
    from tokenizers import Tokenizer

    tokenizer = FastTokenizer(Tokenizer.from_file(str(path)), EOS_TOKEN, str(path))
    if tokenizer.eos_token_id != BPE_EOS_TOKEN_ID or tokenizer.vocab_size > vocab_size:
        raise RuntimeError(
            f"Trained BPE at {path} has EOS id {tokenizer.eos_token_id} and {tokenizer.vocab_size} tokens; expected "
            f"EOS id {BPE_EOS_TOKEN_ID} and at most {vocab_size}. Delete the file to retrain."
        )
    return tokenizer


def _load_local(path: Path) -> TextTokenizer:
    if path.is_dir() and (path / _BYTES_FILE).exists():
        return ByteTokenizer()
    if path.is_dir() and (path / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        return PretrainedTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True), str(path))
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"Tokenizer path {str(path)!r} has no tokenizer.json, tokenizer_config.json or {_BYTES_FILE}; "
            "give a tokenizer directory, a tokenizer.json file, 'bpe' or 'bytes'."
        )
    from tokenizers import Tokenizer

    return FastTokenizer(Tokenizer.from_file(str(file)), source=str(file))
