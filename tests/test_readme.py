"""README.md stays short, starts with the two set-up commands, shows the supported-models
table the code generates, and every relative link in it and docs/ reaches a file."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.readme_models import supported_models_table

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SETUP_COMMANDS = [
    "pip install -e '.[gemma]' && hybridserve generate",
    "pip install -e '.[test,serve,gemma,ray]' && python -m pytest -q -n 2",
]
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_holds_the_generated_supported_models_table() -> None:
    assert supported_models_table() in README.read_text()


def test_readme_is_at_most_10_kib() -> None:
    assert README.stat().st_size <= 10_240


def test_readme_starts_with_the_two_setup_commands() -> None:
    blocks = [b.strip() for b in _FENCE.findall(README.read_text())]
    assert blocks[:2] == SETUP_COMMANDS


def test_relative_links_in_readme_and_docs_reach_files() -> None:
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken
