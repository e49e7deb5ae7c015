"""Where multi-task (input, target) pairs come from: an offline mix built from the Python installation, or local
JSON-lines files in FLAN's format.

The offline mix has the long-tailed lengths of real instruction data without any download: every documented
function and class of the standard library (sorted paths, ``ast`` order: the same on every run) gives up to three
tasks, and the ``help()`` topics two:

- ``summarize``: a docstring or topic without its first sentence -> that first sentence (long input, short target);
- ``question``: a passage -> the question it answers ("What does json.dumps() do?": a short, question-like target);
- ``code``: the first half of a function's source lines -> the rest (long-tailed on both sides).

The text is Python's own documentation and source (PSF License, see :mod:`.corpus`), built on the machine that trains.
FLAN files hold one JSON object per line with string fields ``"inputs"`` and ``"targets"`` (names configurable);
a bad line raises an error naming the file and the line.
"""

from __future__ import annotations

import ast
import json
import re
import sysconfig
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

TASKS = ("summarize", "question", "code")
_SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"})
_SENTENCE_END = re.compile(r"[.!?](\s|$)")
MIN_REST_CHARS = 40  # a summarize input shorter than this has nothing left to summarise
MIN_CODE_LINES = 4
PROMPTS = {
    "summarize": "Summarize the passage in one sentence.\n\n",
    "question": "Write the question this passage answers.\n\n",
    "code": "Continue the Python code.\n\n",
}


def split_first_sentence(text: str) -> tuple[str, str]:
    """(first sentence of the first paragraph, the rest), both stripped; ("", "") when there is no rest."""
    first_paragraph = text.strip().split("\n\n", 1)[0]
    match = _SENTENCE_END.search(first_paragraph)
    cut = match.end() if match else len(first_paragraph)
    head, rest = text.strip()[:cut].strip(), text.strip()[cut:].strip()
    return (" ".join(head.split()), rest) if head and rest else ("", "")


def _without_heading(text: str) -> str:
    """A help() topic without its underlined title (``Title\n*****``): the first sentence is then real prose."""
    lines = text.strip().splitlines()
    if len(lines) >= 2 and lines[1].strip() and set(lines[1].strip()) <= set("*=-~^"):
        lines = lines[2:]
    return "\n".join(lines).strip()


def _documented(root: Path) -> Iterator[tuple[str, str, str]]:
    """(qualified name, docstring, source) of the standard library's documented functions and classes."""
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if _SKIPPED_DIRS.intersection(parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # old escape sequences in some modules
                tree = ast.parse(text, filename=str(path))
        except (SyntaxError, ValueError, UnicodeDecodeError, OSError, RecursionError):
            continue
        module = ".".join(p for p in (*parts[:-1], path.stem) if p != "__init__")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    yield f"{module}.{node.name}", doc, ast.get_source_segment(text, node) or ""


def _tasks_of(name: str, doc: str, source: str, is_class: bool, tasks: Sequence[str]) -> Iterator[tuple[str, str, str]]:
    head, rest = split_first_sentence(doc)
    if "summarize" in tasks and head and len(rest) >= MIN_REST_CHARS:
        yield "summarize", PROMPTS["summarize"] + rest, head
    if "question" in tasks and len(doc) >= MIN_REST_CHARS:
        question = f"What is the {name} class for?" if is_class else f"What does {name}() do?"
        yield "question", PROMPTS["question"] + doc, question
    lines = source.splitlines()
    if "code" in tasks and not is_class and len(lines) >= MIN_CODE_LINES:
        half = len(lines) // 2
        yield "code", PROMPTS["code"] + "\n".join(lines[:half]), "\n".join(lines[half:])


def iter_offline_mix(tasks: Sequence[str] = TASKS, stdlib: Path | None = None) -> Iterator[tuple[str, str, str]]:
    """(task, input text, target text) of the offline mix: the ``help()`` topics first, then the standard library."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise ValueError(f"tasks={list(tasks)!r}: choose a non-empty subset of {list(TASKS)} (unknown: {unknown}).")
    from pydoc_data.topics import topics

    for topic in sorted(topics):
        text = _without_heading(topics[topic])
        if not text:
            continue
        head, rest = split_first_sentence(text)
        if "summarize" in tasks and head and len(rest) >= MIN_REST_CHARS:
            yield "summarize", PROMPTS["summarize"] + rest, head
        if "question" in tasks:
            yield "question", PROMPTS["question"] + text, f"What is {topic.replace('-', ' ')} in Python?"
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    for name, doc, source in _documented(root):
        is_class = source.lstrip().startswith("class ")
        yield from _tasks_of(name, doc, source, is_class, tasks)


def read_flan_jsonl(paths: Sequence[Path], input_key: str = "inputs",
                    target_key: str = "targets") -> Iterator[tuple[str, str, str]]:
    """(where, input, target) for every line of FLAN-format JSON-lines files (blank lines skipped); ``where`` is
    ``"file:line"``. Raises ValueError naming the file and line of a line that is not a JSON object with non-empty
    string ``input_key`` and ``target_key`` fields."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be one"
                                     f' object like {{"{input_key}": "...", "{target_key}": "..."}}.') from None
                if not isinstance(record, dict):
                    raise ValueError(f"{where}: expected a JSON object with {input_key!r} and {target_key!r}, got"
                                     f" {type(record).__name__}.")
                for key in (input_key, target_key):
                    value = record.get(key)
                    if not isinstance(value, str):
                        found = "missing" if key not in record else f"a {type(value).__name__}"
                        raise ValueError(f"{where}: field {key!r} is {found}, must be a string (fields present:"
                                         f" {sorted(record)}; set input_key/target_key for other names).")
                    if not value.strip():
                        raise ValueError(f"{where}: field {key!r} is empty; every sample needs a non-empty input and"
                                         " target (remove the line).")
                yield where, record[input_key], record[target_key]
