"""Shared test setup for the llmgw core.

How tests are written here (after trio-websocket's rules):

- Tests are trio tests (pytest-trio ``trio_mode``); trio fixtures are function-scoped, and work
  that outlives a call runs in the ``nursery`` fixture (or a nursery the fixture owns).
- Nothing sleeps and hopes: wait on a condition by a deadline the caller owns,
  ``with trio.fail_after(10): await wait_for(ready, "the replica to be ready", processes)``
  (``llmgw.testing.processes``; it fails naming the condition, with the processes' stderr),
  ``trio.testing.wait_all_tasks_blocked()`` or memory streams. Test helpers take no ``timeout=``;
  plain (non-trio) code, which has no cancel scope, passes ``wait_until`` its seconds.
- A test may wait a fixed time only to show that something does NOT happen in that window,
  and its docstring says so.
- Time-driven logic (breaker, backoff, long-polls, lost nodes, health and ready timeouts) runs
  under ``autojump_clock``, with an in-memory stand-in where a socket would be (see the
  ``*_clock.py`` tests); the code reads trio's clock or takes one. Tests with real processes
  or sockets keep the real clock.
- Servers bind port 0 on 127.0.0.x and report the port they got.
- Every test that starts a process ends its whole process group, even when it fails.
- pytest-timeout gives every test an absolute deadline (pyproject: ``timeout``).
- One-sentence docstrings that say what a user would check.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture
def llmgw_exe() -> str:
    """The installed ``llmgw`` console script of this environment."""
    from llmgw.dev.cluster import program

    return program("llmgw")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment without plugin-selection variables, for subprocesses."""
    for name in ("LLMGW_LOAD_PLUGINS", "LLMGW_TRACE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    return dict(os.environ)


class TestPki:
    """A CA in a temporary directory, with a server certificate for 127.0.0.1 and clients on demand."""

    def __init__(self, root: Path) -> None:
        from llmgw import pki

        self.root = root
        self.ca = pki.init_ca(root / "ca")
        self.server = pki.issue_server(self.ca, ["127.0.0.1", "localhost"], out=root / "server")
        self._issued: dict[tuple[str, str], object] = {}

    def client(self, role: str, name: str):
        """An issued ``node``, ``admin`` or ``gateway`` certificate (``pki.Issued``), made once."""
        from llmgw import pki

        key = (role, name)
        if key not in self._issued:
            issue = {"node": pki.issue_node, "admin": pki.issue_admin, "gateway": pki.issue_gateway}[role]
            self._issued[key] = issue(self.ca, name, out=self.root / f"{role}-{name}")
        return self._issued[key]

    def context(self, role: str, name: str):
        """A client SSL context presenting that certificate and trusting the CA."""
        from llmgw import pki

        issued = self.client(role, name)
        return pki.client_ssl_context(issued.cert_path, issued.key_path, self.ca.cert_path)

    def server_config(self, state_dir: Path, **changes):
        """A ``ServerConfig`` on 127.0.0.1 port 0 with this CA's server certificate and CRL.

        Defaults: ``lost_after`` 30 s, long-polls of 0.5 s; ``changes`` replace any field.
        """
        from llmgw.server.main import ServerConfig
        from llmgw.server.state.cluster import Settings

        fields = dict(
            state_dir=state_dir,
            cert=self.server.cert_path,
            key=self.server.key_path,
            ca=self.ca.cert_path,
            host="127.0.0.1",
            port=0,
            crl=self.ca.crl_path,
            settings=Settings(lost_after=30),
            poll_timeout=0.5,
        )
        return ServerConfig(**{**fields, **changes})


@pytest.fixture
def test_pki(tmp_path: Path) -> TestPki:
    """A fresh CA with a server certificate for 127.0.0.1."""
    return TestPki(tmp_path / "pki")


# A throwaway PostgreSQL cluster (session) and a new database per test: see llmgw.testing.postgres.
from llmgw.testing.postgres import pg_url, postgres_cluster  # noqa: E402, F401
