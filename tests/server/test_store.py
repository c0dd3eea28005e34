"""The server's stores, sqlite and PostgreSQL: migrations, transactions, cancellation."""

from __future__ import annotations

import sqlite3

import pytest
import trio

from llmgw.server.persist.sqlite import MIGRATIONS, Store, StoreError, open_store, schema_version


async def test_new_database_is_migrated_to_the_latest_version(tmp_path):
    """A new state dir gets a WAL database at the newest schema version."""
    store = open_store(tmp_path / "state")
    try:
        assert await store.run(schema_version) == len(MIGRATIONS)
        mode = await store.run(lambda c: c.execute("PRAGMA journal_mode").fetchone()[0])
        assert mode == "wal"
    finally:
        store.close()


async def test_reopening_keeps_data(open_test_store):
    """Data written before a restart is there after it; migrations do not run twice."""
    store = open_test_store()
    await store.write(lambda c: Store.set_setting(c, "revision", 7))
    store.close()
    again = open_test_store()
    try:
        assert await again.run(lambda c: Store.get_setting(c, "revision")) == 7
    finally:
        again.close()


async def test_failed_write_changes_nothing(open_test_store):
    """A write that raises half-way is rolled back whole."""
    store = open_test_store()

    def half(conn) -> None:
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


async def test_concurrent_writes_all_land(open_test_store):
    """Many tasks writing at once all commit (no 'database is locked')."""
    store = open_test_store()

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


async def test_cancelled_caller_leaves_no_transaction_half_done(open_test_store):
    """A caller cancelled while its write runs waits for it: the write lands whole, and the next one works."""
    store = open_test_store()
    started = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def slow(conn) -> None:
        Store.set_setting(conn, "a", 1)
        trio.from_thread.run_sync(started.set, trio_token=token)
        conn.execute("SELECT pg_sleep(0.3)" if open_test_store.kind == "postgresql" else "SELECT 1")
        Store.set_setting(conn, "b", 2)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.write, slow)
            await started.wait()
            nursery.cancel_scope.cancel()
        await store.write(lambda c: Store.set_setting(c, "c", 3))
        values = await store.run(lambda c: [Store.get_setting(c, k) for k in "abc"])
        assert values == [1, 2, 3]
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


async def test_newer_postgresql_schema_is_refused(pg_url):
    """A PostgreSQL database migrated by a newer llmgw is refused with what to do."""
    from llmgw.server.persist.postgres import open_pg_store

    open_pg_store(pg_url).close()
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE llmgw_schema SET version = %s", (len(MIGRATIONS) + 1,))
    with pytest.raises(StoreError, match="newer than this llmgw knows"):
        open_pg_store(pg_url)


async def test_postgresql_times_keep_their_fractions(pg_url):
    """Timestamps round-trip to the microsecond in PostgreSQL (sqlite's REAL is a double there too)."""
    from llmgw.server.persist import cluster as persist
    from llmgw.server.persist.postgres import open_pg_store

    store = open_pg_store(pg_url)
    try:
        await store.write(lambda c: Store.add_event(c, "test", "s", "m", at=1764745000.123456))
        listed = await store.run(lambda c: persist.recent_events(c, 0, 10))
        assert listed.events[0].at == 1764745000.123456
    finally:
        store.close()


async def test_servers_migrating_one_database_at_once_take_turns(pg_url):
    """Two servers starting on a new database together both open it, and the schema is migrated once."""
    from llmgw.server.persist.postgres import open_pg_store, schema_version

    stores = []

    async def open_one() -> None:
        stores.append(await trio.to_thread.run_sync(open_pg_store, pg_url))

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(open_one)
        versions = [await s.run(schema_version) for s in stores]
        assert versions == [len(MIGRATIONS)] * 3
    finally:
        for s in stores:
            s.close()


@pytest.mark.parametrize(
    "url, expected",
    [
        ("postgresql://u:secret@db/llmgw", "holds a password"),
        ("mysql://u@db/llmgw", "expected postgresql://"),
        ("postgresql://u@db/llmgw?bogus=1", "not a valid postgresql:// URL"),
    ],
)
def test_bad_store_urls_are_refused_naming_the_flag(url, expected):
    """A --store URL with a password, of another database, or unknown options is refused, naming --store."""
    from llmgw.server.persist.postgres import check_store_url

    with pytest.raises(StoreError, match=expected) as caught:
        check_store_url(url)
    assert str(caught.value).startswith("--store: ") and "secret" not in str(caught.value)


def test_unreachable_postgresql_is_a_clear_error(tmp_path):
    """A server pointed at a database that does not answer says where and why, without the password."""
    from llmgw.server.persist.postgres import open_pg_store
    from llmgw.testing.processes import free_port

    secret = tmp_path / "pw"
    secret.write_text("hunter2\n")
    url = f"postgresql://llmgw@127.0.0.1:{free_port()}/llmgw"
    with pytest.raises(StoreError, match="cannot connect to PostgreSQL") as caught:
        open_pg_store(url, secret)
    assert url in str(caught.value) and "hunter2" not in str(caught.value)


async def test_a_dropped_postgresql_connection_is_a_store_error_and_the_next_write_reconnects(pg_url):
    """The backend of the store's connection is killed (a restart, an admin): the write in flight fails as
    a StoreError naming the store (a 503 to callers, not a 500); the next write lands on a new connection."""
    import psycopg

    from llmgw.server.persist.postgres import open_pg_store

    store = open_pg_store(pg_url)
    try:
        await store.write(lambda c: Store.set_setting(c, "a", 1))
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        with pytest.raises(StoreError) as dropped:
            await store.write(lambda c: Store.set_setting(c, "a", 2))
        assert str(dropped.value).startswith(f"{store.path}: "), dropped.value
        await store.write(lambda c: Store.set_setting(c, "a", 3))
        assert await store.run(lambda c: Store.get_setting(c, "a")) == 3
    finally:
        store.close()
