"""The server's sqlite store: migrations, transactions, cancellation."""

from __future__ import annotations

import sqlite3

import pytest
import trio

from llmgw.server.store import MIGRATIONS, Store, StoreError, open_store, schema_version


async def test_new_database_is_migrated_to_the_latest_version(tmp_path):
    """A new state dir gets a WAL database at the newest schema version."""
    store = open_store(tmp_path / "state")
    try:
        assert await store.run(schema_version) == len(MIGRATIONS)
        mode = await store.run(lambda c: c.execute("PRAGMA journal_mode").fetchone()[0])
        assert mode == "wal"
    finally:
        store.close()


async def test_reopening_keeps_data(tmp_path):
    """Data written before a restart is there after it; migrations do not run twice."""
    store = open_store(tmp_path)
    await store.write(lambda c: Store.set_setting(c, "revision", 7))
    store.close()
    again = open_store(tmp_path)
    try:
        assert await again.run(lambda c: Store.get_setting(c, "revision")) == 7
    finally:
        again.close()


async def test_failed_write_changes_nothing(tmp_path):
    """A write that raises half-way is rolled back whole."""
    store = open_store(tmp_path)

    def half(conn: sqlite3.Connection) -> None:
        Store.set_setting(conn, "a", 1)
        raise RuntimeError("boom")

    try:
        with pytest.raises(RuntimeError):
            await store.write(half)
        assert await store.run(lambda c: Store.get_setting(c, "a")) is None
    finally:
        store.close()


async def test_newer_schema_is_refused(tmp_path):
    """A database from a newer llmgw is refused with what to do, not silently used."""
    conn = sqlite3.connect(tmp_path / "state.db")
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this llmgw knows"):
        open_store(tmp_path)


async def test_concurrent_writes_all_land(tmp_path):
    """Many tasks writing at once all commit (no 'database is locked')."""
    store = open_store(tmp_path)

    async def add(i: int) -> None:
        await store.write(lambda c: Store.add_event(c, "test", f"s{i}", "m"))

    try:
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(add, i)
        count = await store.run(lambda c: c.execute("SELECT count(*) FROM events").fetchone()[0])
        assert count == 50
    finally:
        store.close()


async def test_catalog_revisions_stored_before_authors_migrate_with_no_author(tmp_path):
    """A catalog stored by an llmgw that did not record authors keeps its text, with an empty author."""
    conn = sqlite3.connect(tmp_path / "state.db")
    for script in MIGRATIONS[:3]:
        conn.executescript(script)
    conn.execute("INSERT INTO catalog (revision, text, applied_at) VALUES (1, 'models: {}', 5.0)")
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    store = open_store(tmp_path)
    try:
        rows = await store.run(lambda c: c.execute("SELECT revision, text, author FROM catalog").fetchall())
        assert rows == [(1, "models: {}", "")]
    finally:
        store.close()
