"""Hatch build hook of the llmgw distribution: record the commit it is built from.

Writes ``llmgw/_build_info.py`` (``COMMIT = "<40 hex>[-dirty]"``) into every
wheel and sdist, never into the source tree; :mod:`llmgw.version` reads it.

- In a git work tree: ``HEAD``, with ``-dirty`` when the tree has changes.
- In an unpacked sdist (no ``.git``; how ``python -m build`` makes the wheel):
  the ``llmgw/_build_info.py`` the sdist carries is kept as it is.
- Editable installs get nothing: :mod:`llmgw.version` asks git at run time.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

TARGET = "llmgw/_build_info.py"


class BuildInfoHook(BuildHookInterface):
    """Adds ``llmgw/_build_info.py`` with the commit to the artifact."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        self._written: str | None = None
        if self.target_name == "wheel" and version == "editable":
            return
        root = Path(self.root)
        commit = _git_commit(root)
        if commit is None:
            if (root / TARGET).is_file():
                return  # an unpacked sdist: its record says where it came from
            commit = "unknown"
        fd, path = tempfile.mkstemp(prefix="llmgw-build-info-", suffix=".py")
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(
                '"""Written by hatch_build.py when this distribution was built; not in the source tree."""'
                "\n\n"
                f"COMMIT = {json.dumps(commit)}\n"
            )
        self._written = path
        build_data["force_include"][path] = TARGET

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if self._written:
            os.unlink(self._written)


def _git_commit(root: Path) -> str | None:
    if not (root / ".git").exists():
        return None
    try:
        top, head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        if Path(top).resolve() != root.resolve():
            return None
        changes = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if changes.strip() else "")
