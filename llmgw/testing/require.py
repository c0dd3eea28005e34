"""Prerequisites a machine may lack: tests skip saying what is missing, or fail where CI requires them.

A test that needs root, OpenSSH or promtool calls :func:`require`; on a
developer's machine without it the test is skipped with the reason, and where
the named ``LLMGW_REQUIRE_*`` variable is ``1`` (``.ci/run`` sets them all) it
fails instead, so that a CI run is never green with those tests left out.
"""

from __future__ import annotations

import os

import pytest

__all__ = ["REQUIRE_ROOT", "REQUIRE_SSHD", "require"]

#: the tests that mount filesystems (disk room, eviction) fail instead of skipping when not root
REQUIRE_ROOT = "LLMGW_REQUIRE_ROOT"
#: onboarding's end-to-end tests fail instead of skipping without OpenSSH and root
REQUIRE_SSHD = "LLMGW_REQUIRE_SSHD"


def require(present: bool, env: str, message: str) -> None:
    """Called at a test's start (or in its fixture) with whether a prerequisite is ``present``; returns when
    it is, else skips the test saying ``message``, or fails it when ``$env`` is ``1``."""
    if present:
        return
    if os.environ.get(env) == "1":
        pytest.fail(f"{message}, and {env}=1 requires it")
    pytest.skip(message)
