"""The offline default corpus: English prose from Python's own documentation.

Every machine that can run this project has a Python installation, and with it two sources of
well-written English technical prose: ``pydoc_data.topics.topics`` (the language reference topics
that ``help()`` shows, about 465 KB) and the docstrings of the standard library. Building the corpus
from them means examples, tests and smoke runs train on real text without any download.

The text is Python documentation, copyright the Python Software Foundation and distributed under the
PSF License Agreement (https://docs.python.org/3/license.html) together with CPython itself.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path

MIN_DOCSTRING_CHARS = 200
_SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"})
_DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def iter_pydoc_topics() -> Iterator[str]:
    """The ``help()`` topic texts, in sorted topic order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield text


def iter_stdlib_docstrings(stdlib: Path | None = None, min_chars: int = MIN_DOCSTRING_CHARS) -> Iterator[str]:
    """Module, class and function docstrings of at least ``min_chars`` characters.

    Files are visited in sorted path order and nodes in ``ast.walk`` order, so the result is the
    same on every run; tests, IDLE and installed packages are skipped, as are files that do not
    parse, and repeated docstrings are kept once.
    """
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # old escape sequences in some modules
                tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError, OSError, RecursionError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, _DOCUMENTED_NODES):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) >= min_chars and doc not in seen:
                    seen.add(doc)
                    yield doc


def iter_python_docs(include_installed_packages: bool = False) -> Iterator[str]:
    """All corpus documents: pydoc topics first, then standard-library docstrings, then (optionally) the
    docstrings of the installed packages (``site-packages``, sorted by package)."""
    yield from iter_pydoc_topics()
    yield from iter_stdlib_docstrings()
    if include_installed_packages:
        root = Path(sysconfig.get_paths()["purelib"])
        for package in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.endswith((".dist-info", ".egg-info"))):
            yield from iter_stdlib_docstrings(package)


def build_python_docs_corpus(path: Path, max_bytes: int | None = None, include_installed_packages: bool = False) -> Path:
    """Write the Python-documentation corpus to ``path`` as JSON lines (``{"text": ...}`` per document).

    ``include_installed_packages`` adds the docstrings of every installed package (tens of MB on a machine
    with the scientific stack: enough text for convergence runs of a few thousand steps). Those texts keep
    their packages' licences; the corpus is built on the machine that trains and never shipped.
    ``max_bytes`` caps the total UTF-8 size of the texts: whole documents are kept while they fit
    and the one that crosses the cap is cut, so small test corpora are cheap and exact. The file is
    written to a temporary name and renamed, so concurrent builders never see a partial file.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    budget = max_bytes
    with tmp.open("w", encoding="utf-8") as f:
        for text in iter_python_docs(include_installed_packages):
            if budget is not None:
                data = text.encode("utf-8")
                if len(data) > budget:
                    text = data[:budget].decode("utf-8", errors="ignore")
                budget -= len(data)
            if text:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            if budget is not None and budget <= 0:
                break
    os.replace(tmp, path)
    return path
