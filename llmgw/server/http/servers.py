"""``GET /v1/admin/servers``: the control plane's servers as the store knows them (``llmgw ctl servers``)."""

from __future__ import annotations

from typing import Any

from llmgw.server.persist.lease import control_servers_rows
from llmgw.server.persist.postgres import PgStore
from llmgw.wire.servers import ControlServer, ControlServers

__all__ = ["control_servers"]


async def control_servers(store: Any) -> ControlServers:
    """Every server that checked in recently, the leader first; on sqlite, none (one server, no election)."""
    if not isinstance(store, PgStore):
        return ControlServers("sqlite")
    rows = await store.run(control_servers_rows)
    servers = [
        ControlServer(address, "leader", seen, up, epoch, age, expires)
        if leads
        else ControlServer(address, "standby", seen, up)
        for address, leads, seen, up, epoch, age, expires in rows
    ]
    servers.sort(key=lambda s: s.role != "leader")
    return ControlServers("postgresql", tuple(servers))
