"""The server's state in sqlite: one WAL connection, reached from trio.

Every call goes through one worker thread at a time
(``trio.CapacityLimiter(1)``) and is never abandoned: a cancelled caller waits
for its query to finish, so no abandoned thread shares the connection with
the next transaction (a race seen under agent long-polls); writes
begin with ``BEGIN IMMEDIATE`` so a read-then-write never fails half-way with
"database is locked". The schema is versioned: :data:`MIGRATIONS` runs in
order, each once, and a database newer than this code is refused.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import trio

from llmgw.errors import LlmgwError

__all__ = ["Store", "StoreError", "MIGRATIONS", "open_store"]

T = TypeVar("T")

#: Schema migrations, in order; entry N brings the schema to version N + 1.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE catalog (
        revision INTEGER PRIMARY KEY,
        text TEXT NOT NULL,
        data TEXT NOT NULL,
        applied_at REAL NOT NULL
    );
    CREATE TABLE nodes (
        node_id TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        facts TEXT NOT NULL,
        port_range TEXT NOT NULL,
        cordoned INTEGER NOT NULL DEFAULT 0,
        draining INTEGER NOT NULL DEFAULT 0,
        lost INTEGER NOT NULL DEFAULT 0,
        cert_serial TEXT,
        cert_not_after REAL,
        first_seen REAL NOT NULL,
        last_seen REAL NOT NULL
    );
    CREATE TABLE replicas (
        replica_id TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        placement TEXT NOT NULL,
        attempt INTEGER NOT NULL DEFAULT 0,
        failures INTEGER NOT NULL DEFAULT 0,
        consecutive_failures INTEGER NOT NULL DEFAULT 0,
        sent_revision INTEGER NOT NULL DEFAULT 0,
        state TEXT NOT NULL,
        reason TEXT,
        changed_at REAL NOT NULL
    );
    CREATE TABLE observed (
        node_id TEXT NOT NULL,
        shard_key TEXT NOT NULL,
        data TEXT NOT NULL,
        seen_at REAL NOT NULL,
        PRIMARY KEY (node_id, shard_key)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        kind TEXT NOT NULL,
        subject TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE TABLE settings (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    """,
    """
    CREATE TABLE api_keys (
        name TEXT PRIMARY KEY,
        sha256 TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        revoked_at REAL
    );
    """,
    # Dead storage: observed shards are never stored (agents report them again
    # after a restart), and the catalog is reloaded from its text.
    """
    DROP TABLE observed;
    ALTER TABLE catalog DROP COLUMN data;
    """,
    # Who applied each catalog revision: the admin certificate's name.
    """
    ALTER TABLE catalog ADD COLUMN author TEXT NOT NULL DEFAULT '';
    """,
    # What each replica's current attempt runs (JSON of its Launch); NULL in older rows: the catalog's.
    """
    ALTER TABLE replicas ADD COLUMN launch TEXT;
    """,
    # Model manifests (files, sizes, sha256) per distributable source: made once by the first holder.
    """
    CREATE TABLE manifests (
        source TEXT PRIMARY KEY,
        digest TEXT NOT NULL,
        manifest TEXT NOT NULL,
        made_by TEXT NOT NULL,
        made_at REAL NOT NULL
    );
    """,
    # Several servers on PostgreSQL: who leads (one row, id 1), under which fencing epoch, until when
    # (seconds since 1970 on the database's clock), and every server's last check-in (ctl servers).
    # Unused on sqlite, where the one server leads.
    """
    CREATE TABLE leader (
        id INTEGER PRIMARY KEY,
        holder TEXT NOT NULL,
        address TEXT NOT NULL,
        epoch INTEGER NOT NULL,
        acquired_at REAL NOT NULL,
        renewed_at REAL NOT NULL,
        expires_at REAL NOT NULL
    );
    CREATE TABLE servers (
        holder TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        started_at REAL NOT NULL,
        seen_at REAL NOT NULL
    );
    """,
    # The change feed (PostgreSQL): one revision, moved in the transaction of every write of the leader;
    # standbys reload their read-only view when it moved, and resume from it after a reconnect.
    """
    CREATE TABLE feed (
        id INTEGER PRIMARY KEY,
        revision BIGINT NOT NULL
    );
    INSERT INTO feed (id, revision) VALUES (1, 0);
    """,
    # Each API key's limits (JSON of llmgw.wire.KeyLimits); NULL: unlimited, as every key made before.
    """
    ALTER TABLE api_keys ADD COLUMN limits TEXT;
    """,
    # What each API key used per UTC day and model, as the gateways report it (budgets, ctl keys usage).
    """
    CREATE TABLE key_usage (
        key_name TEXT NOT NULL,
        day TEXT NOT NULL,
        model TEXT NOT NULL,
        requests BIGINT NOT NULL,
        prompt_tokens BIGINT NOT NULL,
        completion_tokens BIGINT NOT NULL,
        PRIMARY KEY (key_name, day, model)
    );
    """,
    # The LoRA adapters of each replica's current attempt (JSON, persist/adapters.py): the adapters the
    # leader asked it to keep and those the routes feed says it has loaded. A standby routes them; a new
    # leader keeps them (its agents unload nothing). NULL: none, as every row stored before.
    """
    ALTER TABLE replicas ADD COLUMN adapters TEXT;
    """,
)


class StoreError(LlmgwError):
    """The state database cannot be used as it is."""


class Store:
    """The server's sqlite database. Build it with :func:`open_store`."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn
        self._limiter = trio.CapacityLimiter(1)

    # -- running queries ---------------------------------------------------

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` in the store's worker thread and return its result.

        ``fn`` must not begin transactions itself; use :meth:`write` for writes.
        A cancelled caller waits for the query to finish.
        """
        return await self._in_thread(lambda: fn(self._conn))

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(conn)`` inside one ``BEGIN IMMEDIATE`` transaction.

        Committed when ``fn`` returns, rolled back when it raises: a write is
        all or nothing. Returns what ``fn`` returned.
        """

        def transaction() -> T:
            with _immediate(self._conn):
                return fn(self._conn)

        return await self._in_thread(transaction)

    async def _in_thread(self, work: Callable[[], T]) -> T:
        # Not abandoned on cancel: an abandoned thread would go on using the
        # one connection while the next caller starts a transaction on it.
        # The server's queries are small; a cancel waits for the one running.
        async with self._limiter:
            return await trio.to_thread.run_sync(work)

    def close(self) -> None:
        """Close the connection; called once when the server stops."""
        self._conn.close()

    # -- events ------------------------------------------------------------

    @staticmethod
    def add_event(
        conn: sqlite3.Connection, kind: str, subject: str, message: str, *, at: float | None = None
    ) -> None:
        """Record what the server decided and why (inside a :meth:`write`)."""
        conn.execute(
            "INSERT INTO events (at, kind, subject, message) VALUES (?, ?, ?, ?)",
            (time.time() if at is None else at, str(kind), subject, message),
        )

    @staticmethod
    def get_setting(conn: sqlite3.Connection, key: str, default: Any = None) -> Any:
        """A JSON value from the settings table, or ``default``."""
        row = conn.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    @staticmethod
    def set_setting(conn: sqlite3.Connection, key: str, value: Any) -> None:
        """Store a JSON value in the settings table (inside a :meth:`write`)."""
        conn.execute(
            "INSERT INTO settings (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value)),
        )


@contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def ping(conn: Any) -> None:
    """A query that reads nothing: it answers when the store does (``/health``)."""
    conn.execute("SELECT 1").fetchone()


def schema_version(conn: sqlite3.Connection) -> int:
    """The database's schema version (``PRAGMA user_version``)."""
    return conn.execute("PRAGMA user_version").fetchone()[0]


def open_store(state_dir: str | Path) -> Store:
    """Open (creating if needed) ``state.db`` under ``state_dir`` and migrate it.

    Called once by ``llmgw server`` at start, before it listens.

    :raises StoreError: the database is newer than this llmgw, or unreadable.
    """
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / "state.db"
    try:
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA synchronous=NORMAL")
        version = schema_version(conn)
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path}: cannot open the state database: {exc}") from None
    if version > len(MIGRATIONS):
        conn.close()
        raise StoreError(
            f"{path}: schema version {version} is newer than this llmgw knows "
            f"({len(MIGRATIONS)}); upgrade llmgw or point --state-dir elsewhere"
        )
    for target in range(version + 1, len(MIGRATIONS) + 1):
        with _immediate(conn):
            for statement in _statements(MIGRATIONS[target - 1]):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {target}")
    return Store(path, conn)


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
