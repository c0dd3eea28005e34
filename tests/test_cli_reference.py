"""docs/cli.md is the commands' own --help, kept current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cli_reference.py"


def test_cli_reference_is_current():
    """docs/cli.md matches every command's --help; regenerate it with scripts/cli_reference.py."""
    spec = importlib.util.spec_from_file_location("cli_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.DOCS.read_text() == module.render(), (
        "docs/cli.md is out of date: run .venv/bin/python scripts/cli_reference.py and commit it"
    )
