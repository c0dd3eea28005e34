"""The leader lease's queries on PostgreSQL: the ``leader`` row, the ``servers`` list, their notifications.

:class:`~llmgw.server.ha.lease.Lease` decides when to take, renew, check and
let go of the lease; these functions are its SQL, each run on the lease's own
connection (or, for :func:`lease_for_write`, in the write's transaction).
Times are on the database's clock (:data:`DB_NOW`), so no server's own clock
decides. Rows read are ``(holder, address, epoch, held for, expires in)``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CHANNEL",
    "DB_NOW",
    "check_in",
    "lock_lease",
    "take_lease",
    "listen",
    "forget_servers_older_than",
    "renew_lease",
    "lease_for_write",
    "let_go",
    "leave",
    "read_lease",
    "control_servers_rows",
]

#: the channel a leader that lets go notifies on
CHANNEL = "llmgw_leader"
#: now on the database's clock, as seconds since 1970 (clock_timestamp: not frozen at the transaction's start)
DB_NOW = "extract(epoch from clock_timestamp())::float8"
_LEASE_ROW = (
    f"SELECT holder, address, epoch, {DB_NOW} - acquired_at, expires_at - {DB_NOW} FROM leader WHERE id = 1"
)


def check_in(conn: Any, holder: str, address: str) -> None:
    """Say this server is up (``ctl servers``); not a write of the cluster's state, so not fenced.

    An older instance at the same address (killed, then this one started in its place) leaves the list.
    """
    conn.execute("DELETE FROM servers WHERE address = %s AND holder <> %s", (address, holder))
    conn.execute(
        "INSERT INTO servers (holder, address, started_at, seen_at)"
        f" VALUES (%s, %s, {DB_NOW}, {DB_NOW})"
        " ON CONFLICT (holder) DO UPDATE SET seen_at = excluded.seen_at",
        (holder, address),
    )


def lock_lease(conn: Any) -> tuple:
    """The lease row, locked for this transaction (waits a second at most for another's lock).

    On a new database every server starting now inserts the row (one insert lands, the others wait for it), so
    there is always a row to lock: two servers can never both find the table empty and both take epoch 1.
    A row with no holder is a lease never taken.
    """
    conn.execute("SET LOCAL lock_timeout = '1s'")
    row = conn.execute(f"{_LEASE_ROW} FOR UPDATE").fetchone()
    if row is None:
        conn.execute(
            "INSERT INTO leader (id, holder, address, epoch, acquired_at, renewed_at, expires_at)"
            " VALUES (1, '', '', 0, 0, 0, 0) ON CONFLICT (id) DO NOTHING"
        )
        row = conn.execute(f"{_LEASE_ROW} FOR UPDATE").fetchone()
    return row


def take_lease(conn: Any, holder: str, address: str, epoch: int, duration: float) -> None:
    """Write the row (locked by :func:`lock_lease`) as ``holder``'s lease of ``epoch`` for ``duration`` s."""
    conn.execute(
        f"UPDATE leader SET holder = %s, address = %s, epoch = %s, acquired_at = {DB_NOW},"
        f" renewed_at = {DB_NOW}, expires_at = {DB_NOW} + %s WHERE id = 1",
        (holder, address, epoch, duration),
    )


def listen(conn: Any) -> None:
    """Be told when a leader lets go (:data:`CHANNEL`)."""
    conn.execute(f"LISTEN {CHANNEL}")


def forget_servers_older_than(conn: Any, seconds: float) -> None:
    """Drop from ``ctl servers`` the servers that did not check in for ``seconds``."""
    conn.execute(f"DELETE FROM servers WHERE seen_at < {DB_NOW} - %s", (seconds,))


def renew_lease(conn: Any, holder: str, epoch: int, duration: float) -> bool:
    """Extend ``holder``'s lease of ``epoch`` by ``duration`` from now; False when it is no longer theirs."""
    row = conn.execute(
        f"UPDATE leader SET renewed_at = {DB_NOW}, expires_at = {DB_NOW} + %s"
        f" WHERE id = 1 AND holder = %s AND epoch = %s AND expires_at > {DB_NOW} RETURNING epoch",
        (duration, holder, epoch),
    ).fetchone()
    return row is not None


def lease_for_write(conn: Any) -> tuple | None:
    """``(holder, epoch, expires in)`` of the lease, held ``FOR SHARE`` until the write's transaction ends."""
    query = f"SELECT holder, epoch, expires_at - {DB_NOW} FROM leader WHERE id = 1 FOR SHARE"
    return conn.execute(query).fetchone()


def let_go(conn: Any, holder: str, epoch: int) -> None:
    """End ``holder``'s lease of ``epoch`` now, and wake the standbys."""
    conn.execute(
        f"UPDATE leader SET expires_at = {DB_NOW} WHERE id = 1 AND holder = %s AND epoch = %s",
        (holder, epoch),
    )
    conn.execute(f"NOTIFY {CHANNEL}")


def leave(conn: Any, holder: str) -> None:
    """Take this server off ``ctl servers``."""
    conn.execute("DELETE FROM servers WHERE holder = %s", (holder,))


def read_lease(conn: Any) -> tuple | None:
    """The lease row now (None when no server ever led)."""
    return conn.execute(_LEASE_ROW).fetchone()


def control_servers_rows(conn: Any) -> list[tuple]:
    """Every server that checked in: ``(address, leads, seen ago, up for, epoch, held for, expires in)``."""
    query = (
        f"SELECT s.address, l.holder = s.holder AND l.expires_at > {DB_NOW}, {DB_NOW} - s.seen_at,"
        f" {DB_NOW} - s.started_at, l.epoch, {DB_NOW} - l.acquired_at, l.expires_at - {DB_NOW}"
        " FROM servers s LEFT JOIN leader l ON l.id = 1 ORDER BY s.address"
    )
    return conn.execute(query).fetchall()
