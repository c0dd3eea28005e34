"""Fixtures the agent's tests share: a real server to sync with, and the process groups a test must end."""

from __future__ import annotations

import pytest

from llmgw.testing.agent import Server, kill_group


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A running server (``Server``) on 127.0.0.1, reading the CA's revocation list."""
    server = Server(nursery, test_pki, tmp_path / "server")
    await server.start()
    return server


@pytest.fixture
def groups():
    """Process groups to SIGKILL at the end of the test, whatever happened."""
    started: list[int] = []
    yield started
    for pgid in started:
        kill_group(pgid)
