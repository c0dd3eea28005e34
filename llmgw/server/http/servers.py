"""``GET /v1/admin/servers``: the control plane's servers as the store knows them (``llmgw ctl servers``)."""

from __future__ import annotations

from typing import Any

from llmgw.server.ha.lease import DB_NOW
from llmgw.server.persist.postgres import PgStore
from llmgw.wire.servers import ControlServer, ControlServers

__all__ = ["control_servers"]


async def control_servers(store: Any) -> ControlServers:
    """Every server that checked in recently, the leader first; on sqlite, none (one server, no election)."""
    if not isinstance(store, PgStore):
        return ControlServers("sqlite")
    query = (
        f"SELECT s.address, l.holder = s.holder AND l.expires_at > {DB_NOW}, {DB_NOW} - s.seen_at,"
        f" {DB_NOW} - s.started_at, l.epoch, {DB_NOW} - l.acquired_at, l.expires_at - {DB_NOW}"
        " FROM servers s LEFT JOIN leader l ON l.id = 1 ORDER BY s.address"
    )
    rows = await store.run(lambda conn: conn.execute(query).fetchall())
    servers = [
        ControlServer(address, "leader", seen, up, epoch, age, expires)
        if leads
        else ControlServer(address, "standby", seen, up)
        for address, leads, seen, up, epoch, age, expires in rows
    ]
    servers.sort(key=lambda s: s.role != "leader")
    return ControlServers("postgresql", tuple(servers))
