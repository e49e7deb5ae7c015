"""The import layering contract (docs/architecture.md), checked on the source: it fails on any violation.

Layers, bottom to top: utils -> pipeline -> compression -> distributed -> checkpoint -> strategies -> {callbacks,
recipes} -> cli. A module may
import its own package and the layers below it (``lightning_3d`` itself re-exports the strategy, so it sits just
above the strategies layer; ``dynamic`` sits beside compression and ``planner`` beside the recipes). On top of that: no
import cycle between modules (function-level imports included, since they
only hide a cycle), no ``from X import _private`` across modules, and upper layers reach the strategies package only
through its public modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_3d"

LAYER = {"utils": 0, "pipeline": 1, "costs": 1.5, "compression": 2, "context": 2, "tensor_parallel": 2, "dynamic": 2,
         "distributed": 2.5, "checkpoint": 2.7, "strategies": 3, "": 3.5, "planner": 4,
         "callbacks": 4, "recipes": 4, "cli": 5, "cli_checks": 5}
# What callbacks and recipes may import from strategies: the strategy, its configs, the model protocol and what a run
# prints (summary, progress bar); the layout, the checkpoint format and the dropout streams live in the lower packages
# distributed/ and checkpoint/.
PUBLIC_STRATEGY_MODULES = {"lightning_3d.strategies.compressed_3d", "lightning_3d.strategies.protocol",
                           "lightning_3d.strategies.config", "lightning_3d.strategies.run_output"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    """The layer key of a module: its subpackage under lightning_3d ('' for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) of every lightning_3d import in the file, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("lightning_3d"):
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}:{node.lineno}: use absolute imports (the layering check reads them)")
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("lightning_3d")]
    return out


def _graph() -> dict[str, list[tuple[str, list[str], int]]]:
    return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(target: str, names: list[str], modules: set[str]) -> list[str]:
    """``from pkg import mod`` imports the module ``pkg.mod``; anything else imports ``target`` itself."""
    subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
    return subs or [target]


def violations(graph: dict[str, list[tuple[str, list[str], int]]]) -> list[str]:
    modules, bad = set(graph), []
    edges: dict[str, set[str]] = {m: set() for m in graph}
    for module, imports in graph.items():
        mine = _part(module)
        for target, names, line in imports:
            for dep in _resolve(target, names, modules):
                theirs = _part(dep)
                edges[module].add(dep)
                if theirs != mine and LAYER.get(theirs, 99) >= LAYER.get(mine, -1) and not (mine == "cli"):
                    bad.append(f"{module}:{line} imports {dep}: layer '{mine or 'lightning_3d'}' may not import"
                               f" '{theirs or 'lightning_3d'}'")
                if theirs == "strategies" and mine in ("callbacks", "recipes") and dep not in PUBLIC_STRATEGY_MODULES:
                    bad.append(f"{module}:{line} imports {dep}: {mine} may use only the strategy's public modules"
                               f" {sorted(PUBLIC_STRATEGY_MODULES)}")
                private = [n for n in names if n.startswith("_") and f"{target}.{n}" not in modules]
                if private and dep != module:
                    bad.append(f"{module}:{line} imports private {private} from {target}: make them public or move them")
    bad += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(edges)]
    return bad


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            # A package __init__ re-exporting its own modules is not a cycle that matters; real module pairs are.
            real = [m for m in component if not any(o.startswith(m + ".") for o in component)]
            if len(real) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_package_follows_the_layering_contract() -> None:
    assert not violations(_graph()), "\n".join(violations(_graph()))


@pytest.mark.parametrize(
    "graph, expected",
    [
        # pipeline reaching up into compression
        ({"lightning_3d.pipeline.runtime": [("lightning_3d.compression.backprop", ["X"], 3)],
          "lightning_3d.compression.backprop": []}, "layer 'pipeline' may not import 'compression'"),
        # a cycle inside one layer, hidden in a function-level import
        ({"lightning_3d.callbacks.a": [("lightning_3d.callbacks.b", ["f"], 1)],
          "lightning_3d.callbacks.b": [("lightning_3d.callbacks.a", ["g"], 9)]}, "import cycle"),
        # a recipe reaching into strategy internals
        ({"lightning_3d.recipes.gpt.module": [("lightning_3d.strategies.pipeline_engine", ["PipelineEngine"], 2)],
          "lightning_3d.strategies.pipeline_engine": []}, "public modules"),
        # the distributed machinery reaching up into the strategy
        ({"lightning_3d.distributed.grad_sync": [("lightning_3d.strategies.config", ["RuntimeConfig"], 2)],
          "lightning_3d.strategies.config": []}, "layer 'distributed' may not import 'strategies'"),
        # a private helper imported across modules
        ({"lightning_3d.recipes.hf_t5": [("lightning_3d.recipes.hf", ["_pad_rows"], 2)],
          "lightning_3d.recipes.hf": []}, "imports private"),
    ],
)
def test_the_check_catches_each_kind_of_violation(graph: dict, expected: str) -> None:
    found = violations(graph)
    assert any(expected in v for v in found), found
