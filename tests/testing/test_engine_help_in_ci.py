"""Without the real engine help texts, the engine tests skip on a developer's machine and fail in CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.testing.processes import run_pytest

ENGINE = Path(__file__).resolve().parents[2] / "llmgw-engine-vllm"


@pytest.mark.parametrize(("ci", "outcome"), [("", "1 skipped"), ("true", "1 error")])
def test_missing_help_texts_skip_or_fail_in_ci(tmp_path, ci, outcome):
    """An engine's test that needs the texts, run with them missing: skipped, or an error when CI=true."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env |= {"LLMGW_ENGINE_HELP_DIR": str(tmp_path / "absent"), "CI": ci}
    only = ["-k", "test_engine_check_passes"]
    not_this = ["--deselect", "tests/test_vllm.py::TestVllmContract::test_engine_check_passes[0.34.0]"]
    result = run_pytest(ENGINE, *only, *not_this, env=env)
    assert outcome in result.stdout, result.stdout + result.stderr
    assert "the real engine help texts are not here" in result.stdout
    assert result.returncode == (1 if ci else 0)
    if ci:
        assert "CI must have them" in result.stdout
