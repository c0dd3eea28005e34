"""Building a release folder in tests with ``scripts/release``, on machines with or without a package index.

Every build uses ``--no-isolation``: the build backend (hatchling) is a test dependency of llmgw, so no
index is asked for it. The folder also carries the wheels of the dependencies, which ``pip download``
takes from the index pip is configured with (or its ``--find-links``). Where no index answers, that part
cannot be done: the test is skipped saying so, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: what pip says when no index (or link) offers a dependency at all
_NO_INDEX = "(from versions: none)"


def build_release(
    *args: str, cwd: Path = REPO, script: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``scripts/release --no-isolation ARGS`` in ``cwd`` with this Python; the finished process.

    Skips the test (fails it in CI) when the dependency wheels cannot be fetched for want of an index.
    """
    script = cwd / "scripts" / "release"
    done = subprocess.run(
        [str(script), "--no-isolation", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=900,
        check=False,
    )
    if (
        done.returncode != 0
        and "fetching the dependency wheels failed" in done.stderr
        and _NO_INDEX in done.stderr
    ):
        message = (
            "no package index answers here, so the release cannot carry its dependencies' wheels:\n"
            + done.stderr[-1500:]
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return done
