"""Imports inside hybridserve run one way: no two modules import each other, directly or
through others. A cycle means one idea is split across files (and usually hides behind an
import inside a function), so every import counts here, including those inside functions
and under TYPE_CHECKING. A module importing its own parent package is not an edge (the
package's __init__ runs first anyway).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hybridserve

ROOT = Path(hybridserve.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(name: str, path: Path, tree: ast.AST, modules: set[str]) -> set[str]:
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    found.add(target)
                elif base in modules:
                    found.add(base)
    return {m for m in found if m != name and not name.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    names = set(paths)
    return {n: _imported(n, p, ast.parse(p.read_text()), names) for n, p in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()
    # engine/frontend.py imports the torch executor only inside a function (core stays torch-free).
    assert "hybridserve.executor.torch.executor" in graph["hybridserve.engine.frontend"]
    assert "hybridserve.models.mamba_config" in graph["hybridserve.models.config"]


def test_hybridserve_has_no_import_cycles() -> None:
    assert cycles(import_graph()) == []
