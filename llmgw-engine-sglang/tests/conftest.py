"""Where the real help texts are: ``../shared/engine-help/`` beside the repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: the repository root: tests/ -> llmgw-engine-sglang/ -> root
REPO_ROOT = Path(__file__).resolve().parents[2]
#: real ``--help`` output of each engine version, kept outside the repository;
#: ``LLMGW_ENGINE_HELP_DIR`` points elsewhere
HELP_DIR = Path(os.environ.get("LLMGW_ENGINE_HELP_DIR") or REPO_ROOT.parent / "shared" / "engine-help")


@pytest.fixture(scope="session")
def help_dir() -> Path:
    """The folder of real help texts; the test is skipped when it is absent."""
    if not HELP_DIR.is_dir():
        pytest.skip(
            f"the real engine help texts are not here: {HELP_DIR} is absent "
            "(they live in ../shared/engine-help beside the repository; set LLMGW_ENGINE_HELP_DIR)"
        )
    return HELP_DIR
