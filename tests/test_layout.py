"""The test tree's one import rule: test modules share code through tests.helpers only.

A test module (tests/**/test_*.py) imports hybridserve, tests.helpers and third-party
packages, never another test module; helper modules never import test modules either.
Importing a test module runs its module-level setup again under a second name and ties
one file's tests to another's private details. A module may name itself (a child
process that imports it runs its helpers).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# A dotted name of a test module: tests.test_<name>, tests.<folder>.test_<name>
TEST_MODULE = re.compile(r"\btests(?:\.\w+)*\.test_\w+\b")


def _module_name(path: Path) -> str:
    return ".".join(("tests", *path.relative_to(TESTS).with_suffix("").parts))


def _imported(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative imports would hide the target
            names.append("." * node.level + (node.module or ""))
    return names


def test_no_test_module_imports_another_test_module() -> None:
    bad: list[str] = []
    for path in sorted(TESTS.rglob("*.py")):
        me = _module_name(path)
        source = path.read_text()
        for name in _imported(ast.parse(source)):
            if name.startswith("."):
                bad.append(f"{me}: relative import {name} (write tests.helpers.<module>)")
            elif name.startswith("tests.") and not (name == "tests.helpers" or name.startswith("tests.helpers.")):
                bad.append(f"{me} imports {name}")
        # Also in strings (child processes): a test module may name only itself.
        for name in set(TEST_MODULE.findall(source)) - {me}:
            bad.append(f"{me} names test module {name}")
    assert not bad, "shared test code goes in tests/helpers/:\n" + "\n".join(bad)
