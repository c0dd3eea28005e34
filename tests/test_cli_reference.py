"""docs/cli.md is the commands' own --help, kept current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cli_reference_is_current():
    """docs/cli.md matches every command's --help; regenerate it with scripts/cli_reference.py."""
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "cli_reference.py"), "--print"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert (REPO / "docs" / "cli.md").read_text() == result.stdout, (
        "docs/cli.md is out of date: run .venv/bin/python scripts/cli_reference.py and commit it"
    )
