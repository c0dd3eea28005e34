"""The house plan holds: few top-level modules, none over 500 lines, a README that maps the tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: what may sit directly in llmgw/ besides the subsystem packages
MAX_TOP_LEVEL_MODULES = 12
MAX_MODULE_LINES = 500


def shipped_modules() -> list[Path]:
    """Every module of the core, the built-in plugins and the engine distributions (not tests)."""
    roots = [REPO / "llmgw", REPO / "plugins", *sorted(REPO.glob("llmgw-engine-*/llmgw_engine_*"))]
    return sorted(p for root in roots for p in root.rglob("*.py") if "tests" not in p.parts)


def test_few_top_level_modules():
    """llmgw/ holds at most 12 modules; everything else lives in a subsystem package."""
    modules = sorted(p.name for p in (REPO / "llmgw").glob("*.py") if not p.name.startswith("_build"))
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, f"llmgw/ has {len(modules)} modules: {modules}"


@pytest.mark.parametrize("path", shipped_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_over_500_lines(path):
    """A module of more than 500 lines holds two jobs: split it by job."""
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(REPO)} has {lines} lines"


def test_readme_layout_names_every_package():
    """README's Layout table names every subsystem package of llmgw/, and every path it names exists."""
    readme = (REPO / "README.md").read_text()
    layout = readme[readme.index("## Layout") : readme.index("## Tests")]
    first_cells = [line.split("|")[1] for line in layout.splitlines() if line.startswith("| `")]
    named = {path for cell in first_cells for path in re.findall(r"`([\w./*-]+/)`", cell)}
    packages = {f"llmgw/{p.name}/" for p in (REPO / "llmgw").iterdir() if (p / "__init__.py").exists()}
    assert packages <= named, f"README's Layout table lacks {sorted(packages - named)}"
    for path in named:
        assert list(REPO.glob(path.rstrip("/"))), f"README's Layout table names {path}, which does not exist"
