"""Declared dependencies: real lower bounds, and engines bounded to the core's 0.x minor version."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_VERSIONS = REPO / "scripts" / "min-versions"


def _projects() -> dict[str, dict]:
    files = [REPO / "pyproject.toml", *sorted(REPO.glob("llmgw-engine-*/pyproject.toml"))]
    files.append(REPO / "_template" / "pyproject.toml")
    return {str(f.relative_to(REPO)): tomllib.loads(f.read_text())["project"] for f in files}


def test_every_engine_requires_the_core_within_its_minor_version():
    """Each engine (and the template) requires llmgw>=X,<0.N+1, a range the core in this tree is in."""
    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    major, minor = (int(part) for part in core.split(".")[:2])
    for where, project in _projects().items():
        if where == "pyproject.toml":
            continue
        [requirement] = [r for r in project["dependencies"] if re.match(r"llmgw\b(?!-)", r)]
        found = re.fullmatch(r"llmgw>=([\d.]+),<(\d+)\.(\d+)", requirement)
        assert found, f"{where}: {requirement!r} must be llmgw>=OLDEST,<0.NEXT_MINOR (llmgw is 0.x)"
        lowest = tuple(int(p) for p in found[1].split("."))
        assert lowest <= tuple(int(p) for p in core.split(".")), f"{where}: asks for a core newer than {core}"
        assert (int(found[2]), int(found[3])) == (major, minor + 1), (
            f"{where}: {requirement!r}: the upper bound must be the next minor version of the core ({core})"
        )


def test_every_requirement_has_a_lower_bound_min_versions_reads():
    """scripts/min-versions turns every declared requirement into NAME==LOWEST (none is unbounded)."""
    done = subprocess.run(
        [sys.executable, str(MIN_VERSIONS), "--print-constraints"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines and all(re.fullmatch(r"[a-z0-9-]+==[\d.]+", line) for line in lines), lines
    assert {"cryptography==44", "attrs==23.2", "hatchling==1.25"} <= set(lines)
