"""Meta-tests: every hook is documented with its real signature and has a test."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from llmgw import hookspecs

REPO = Path(__file__).resolve().parents[1]
HOOKS = sorted(name for name, obj in vars(hookspecs).items() if name.startswith("llmgw_") and callable(obj))


def signature_text(name: str) -> str:
    """``def name(arg: Type) -> Result`` as written in the docs."""
    spec = getattr(hookspecs, name)
    sig = inspect.signature(spec)
    params = ", ".join(
        f"{p.name}: {p.annotation}" if p.annotation is not inspect.Parameter.empty else p.name
        for p in sig.parameters.values()
    )
    return f"def {name}({params}) -> {sig.return_annotation}"


def test_there_are_hooks():
    """The hookspec module defines the engine, discovery and provisioner hooks."""
    assert {
        "llmgw_register_engines",
        "llmgw_discover_gpus",
        "llmgw_discover_adapters",
        "llmgw_register_provisioners",
    } <= set(HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_its_signature(name):
    """docs/plugins.md shows each hook with its exact signature."""
    docs = (REPO / "docs" / "plugins.md").read_text()
    assert signature_text(name) in docs, f"docs/plugins.md lacks `{signature_text(name)}`"


@pytest.mark.parametrize("name", HOOKS)
def test_hookspec_docstring_says_when_and_what(name):
    """Each hookspec's docstring says when it is called and what it returns."""
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert "Called" in doc, f"{name}: say when and by which process it is called"
    assert ":returns:" in doc, f"{name}: document what it returns, including None"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_has_a_test(name):
    """Each hook has a test named test_hook_<name> somewhere in the test suites."""
    pattern = re.compile(rf"def test_hook_{name}\b")
    sources = [p.read_text() for p in REPO.glob("tests/**/*.py")]
    sources += [p.read_text() for p in REPO.glob("llmgw-engine-*/tests/**/*.py")]
    assert any(pattern.search(s) for s in sources), f"write a test named test_hook_{name}"


def test_every_engine_name_is_documented():
    """docs/engines.md's table names every attribute and method an engine author may set or override."""
    from llmgw.engine import Engine

    names = {name for name in vars(Engine) if not name.startswith("_")} | set(Engine.__annotations__)
    docs = (REPO / "docs" / "engines.md").read_text()
    missing = sorted(name for name in names if f"`{name}" not in docs)
    assert not missing, f"docs/engines.md does not document Engine.{', Engine.'.join(missing)}"
    assert len(names) == 25, f"the Engine API has {len(names)} names; update docs/engines.md's count"
