"""Fixtures for the server's tests: each store the server can keep its state in."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmgw.server.persist.sqlite import open_store


@pytest.fixture(params=["sqlite", "postgresql"])
def open_test_store(request: pytest.FixtureRequest, tmp_path) -> Callable:
    """Opens a store of each kind (again after a close: same data): sqlite in tmp_path, a new PostgreSQL db.

    ``open_test_store.kind`` says which; ``open_test_store.url`` is the PostgreSQL URL (None for sqlite).
    """
    if request.param == "sqlite":
        opener = lambda: open_store(tmp_path / "state")  # noqa: E731
        opener.url = None
    else:
        from llmgw.server.persist.postgres import open_pg_store

        url = request.getfixturevalue("pg_url")
        opener = lambda: open_pg_store(url)  # noqa: E731
        opener.url = url
    opener.kind = request.param
    return opener
