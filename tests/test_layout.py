"""The house plan holds: few top-level modules, none over 500 lines, a README that maps the tree."""

from __future__ import annotations

import ast
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


# -- how the modules depend on each other ---------------------------------------------------------

#: packages whose modules may hold SQL and import a store driver (llmgw/testing administers the
#: throwaway PostgreSQL servers of the tests, CREATE DATABASE included: it is not the server's state)
SQL_HOMES = ("llmgw/server/persist/", "llmgw/testing/")
STORE_DRIVERS = ("sqlite3", "psycopg")
SQL = re.compile(r"^\s*(SELECT\b|INSERT INTO\b|DELETE FROM\b|CREATE (TABLE|INDEX)\b|UPDATE \w+ SET\b)", re.I)
CONTROLLERS = "llmgw.server.controllers."
#: circles known and not yet broken, each for a reason (none now); the test fails on any other, and on one of
#: these that is gone (take it off the list)
KNOWN_CIRCLES: frozenset[tuple[str, ...]] = frozenset()


def core_modules() -> dict[str, Path]:
    """Every module of llmgw/, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((REPO / "llmgw").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The llmgw modules ``path`` imports, wherever the import is (``TYPE_CHECKING`` and functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            # `from pkg import name`: the submodule when there is one, else the package itself
            names = [n for n in names[:-1] if n in modules] or [node.module]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the llmgw modules it imports."""
    modules = core_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_in_llmgw():
    """No llmgw module imports, through others, one that imports it back (an import under
    ``TYPE_CHECKING`` counts: the two still know each other's insides)."""
    circles = {tuple(c) for c in import_circles(import_graph())}
    new = sorted(circles - KNOWN_CIRCLES)
    assert not new, "import circles:\n" + "\n".join(" <-> ".join(c) for c in new)
    gone = KNOWN_CIRCLES - circles
    assert not gone, f"no longer circles, take them off KNOWN_CIRCLES: {gone}"


def test_the_circle_check_sees_a_circle_made_under_type_checking():
    """The check itself: two modules that import each other, one only for type hints, are a circle."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert import_circles(graph) == [["a", "b"]]


def test_sql_and_store_drivers_live_in_the_persistence_package():
    """Only llmgw/server/persist/ imports sqlite3 or psycopg or writes SQL (and the tests' PostgreSQL
    harness): every other module asks it."""
    wrong = []
    for path in sorted((REPO / "llmgw").rglob("*.py")):
        where = str(path.relative_to(REPO))
        if where.startswith(SQL_HOMES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                drivers = [a.name for a in node.names if a.name.split(".")[0] in STORE_DRIVERS]
                wrong += [f"{where}: imports {name}" for name in drivers]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in STORE_DRIVERS:
                wrong.append(f"{where}: imports from {node.module}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.match(node.value):
                wrong.append(f"{where}:{node.lineno}: SQL {node.value[:40]!r}")
            elif isinstance(node, ast.JoinedStr):
                head = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
                if SQL.match(head):
                    wrong.append(f"{where}:{node.lineno}: SQL {head[:40]!r}")
    assert not wrong, "\n".join(wrong)


def test_no_controller_imports_another():
    """The controllers meet only in the state: none imports another (a module of its own package is fine)."""
    wrong = []
    for name, targets in import_graph().items():
        if not name.startswith(CONTROLLERS):
            continue
        own = name.removeprefix(CONTROLLERS).split(".")[0]
        for target in targets:
            if target.startswith(CONTROLLERS) and target.removeprefix(CONTROLLERS).split(".")[0] != own:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", shipped_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_names_its_concept_first(path):
    """A module's docstring opens with one line naming what it is (a phrase or a sentence, not a blank)."""
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    assert doc, f"{path.relative_to(REPO)} has no docstring"
    first = doc.splitlines()[0].strip()
    where = path.relative_to(REPO)
    assert first, f"{where}: the docstring begins with a blank line; the first names the concept"
    assert len(first.split()) >= 3, f"{where}: the docstring's first line {first!r} names nothing"
