"""Imports inside hybridserve run one way, in two senses.

Layers: the packages stand in the order LAYERS gives, lowest first, and a module imports
only its own package and the layers below it, never a layer above or a package beside it
in its own layer. The engine builds the executors, so it stands above them; the text
services (tokenizer, grammar) serve both, so they stand below both; the simulator drives
the engine, so it stands above it.

Cycles: no two modules import each other, directly or through others. A cycle means one
idea is split across files (and usually hides behind an import inside a function).

Every import counts here, including those inside functions and under TYPE_CHECKING. A
module importing its own parent package is not an edge (the package's __init__ runs first
anyway).
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


# The layers, lowest first: the packages (and top-level modules) right under hybridserve,
# "__init__" for the package itself. Names in one layer do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),                        # pure Python: KV cache, requests, the scheduler
    ("config", "models", "testing"),  # on the core alone: engine arguments, model code, test helpers
    ("text",),                        # tokenizer, chat prompts, the grammar backend
    ("executor",),                    # torch, distributed and simulated executors
    ("engine",),                      # the engine loop and its construction, LLM and AsyncLLM
    ("sim",),                         # the simulator: the engine on a simulated clock
    ("entrypoints",),                 # the CLI and the OpenAI server
    ("__init__",),                    # the public API: from hybridserve import LLM, ...
)
LAYER_OF = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def package_of(module: str) -> str:
    """The name right under hybridserve that `module` belongs to ("__init__" for the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(package: str) -> int:
    assert package in LAYER_OF, f"hybridserve.{package} is in no layer: add it to LAYERS"
    return LAYER_OF[package]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """One line per import of a module from a layer above its own or from another package
    in the same layer, naming both modules."""
    found = []
    for importer in sorted(graph):
        own = package_of(importer)
        for imported in sorted(graph[importer]):
            other = package_of(imported)
            if other != own and layer_of(other) >= layer_of(own):
                where = "above it" if layer_of(other) > layer_of(own) else "beside it"
                found.append(f"{importer} ({own}, layer {layer_of(own)}) imports {imported} "
                             f"({other}, layer {layer_of(other)}, {where})")
    return found


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
    assert "hybridserve.models.arch.mamba_config" in graph["hybridserve.models.config"]


def test_hybridserve_has_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_every_module_has_a_layer() -> None:
    graph = import_graph()
    unplaced = sorted({package_of(m) for m in graph} - set(LAYER_OF))
    assert unplaced == [], f"packages under hybridserve missing from LAYERS: {unplaced}"
    stale = sorted(set(LAYER_OF) - {package_of(m) for m in graph})
    assert stale == [], f"LAYERS names packages hybridserve does not have: {stale}"


def test_layer_check_finds_planted_upward_and_sideways_imports() -> None:
    graph = {
        "hybridserve.executor.torch.runner": {"hybridserve.engine.loop", "hybridserve.text.tokenizer"},
        "hybridserve.engine.loop": {"hybridserve.executor.base", "hybridserve.core.request"},
        "hybridserve.models.loaders.loader": {"hybridserve.config"},
        "hybridserve": {"hybridserve.engine.loop"},
    }
    assert layer_violations(graph) == [
        "hybridserve.executor.torch.runner (executor, layer 3) imports hybridserve.engine.loop "
        "(engine, layer 4, above it)",
        "hybridserve.models.loaders.loader (models, layer 1) imports hybridserve.config (config, layer 1, beside it)",
    ]


def test_hybridserve_imports_only_downward() -> None:
    violations = layer_violations(import_graph())
    assert violations == [], "imports against the layer order:\n" + "\n".join(violations)


def test_the_server_package_does_not_import_the_command_line() -> None:
    """entrypoints/openai is the server as a library (the CLI's `serve` builds it, tests
    build it directly): it never reaches back into the CLI's modules."""
    graph = import_graph()
    server = [m for m in graph if m.startswith("hybridserve.entrypoints.openai")]
    assert len(server) > 5
    cli = {m for m in graph
           if m.startswith("hybridserve.entrypoints.") and not m.startswith("hybridserve.entrypoints.openai")}
    assert "hybridserve.entrypoints.serve" in cli
    assert {m: sorted(graph[m] & cli) for m in server if graph[m] & cli} == {}


def test_models_platform_is_the_lowest_part_of_models() -> None:
    """models/platform (CPU features, the heap) is what the rest of models, and text,
    stand on: it imports nothing else of hybridserve but core."""
    graph = import_graph()
    platform = [m for m in graph if m.startswith("hybridserve.models.platform")]
    assert len(platform) >= 2
    upward = {m: sorted(d for d in graph[m] if not d.startswith(("hybridserve.models.platform", "hybridserve.core")))
              for m in platform}
    assert {m: deps for m, deps in upward.items() if deps} == {}


def test_model_code_does_not_import_the_loaders() -> None:
    """models/arch is the math of each family; models/loaders fills it from checkpoints
    (one loader module per family that needs its own filling): the loaders import the
    model classes, never the other way round."""
    graph = import_graph()
    arch = [m for m in graph if m.startswith("hybridserve.models.arch.")]
    assert len(arch) > 20
    upward = {m: sorted(d for d in graph[m] if d.startswith("hybridserve.models.loaders")) for m in arch}
    assert {m: deps for m, deps in upward.items() if deps} == {}
