"""Shared test setup for the llmgw core.

How tests are written here (after trio-websocket's rules):

- Tests are trio tests (pytest-trio ``trio_mode``); trio fixtures are function-scoped.
- Nothing sleeps and hopes: wait on a condition with a deadline
  (``llmgw.testing.processes``), ``trio.testing.wait_all_tasks_blocked()`` or
  memory streams, and fail loudly, with the process's stderr, when it passes.
- Heartbeat and timeout logic runs under ``autojump_clock``.
- Servers bind port 0 on 127.0.0.x and report the port they got.
- Every test that starts a process ends its whole process group, even when it fails.
- pytest-timeout gives every test an absolute deadline (pyproject: ``timeout``).
- One-sentence docstrings that say what a user would check.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture
def llmgw_exe() -> str:
    """The installed ``llmgw`` console script of this environment."""
    exe = Path(sys.executable).with_name("llmgw")
    found = str(exe) if exe.exists() else shutil.which("llmgw")
    assert found, "the llmgw console script is not installed; run ./run test"
    return found


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment without plugin-selection variables, for subprocesses."""
    for name in ("LLMGW_LOAD_PLUGINS", "LLMGW_TRACE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    return dict(os.environ)
