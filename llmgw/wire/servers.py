"""The admin API's servers document (``GET /v1/admin/servers``, ``ctl servers``): who leads, who stands by.

Read and written through :mod:`llmgw.wire`'s converter (``to_json``, ``from_json``).
"""

from __future__ import annotations

import attrs

__all__ = ["ControlServer", "ControlServers"]


@attrs.frozen
class ControlServer:
    """One ``llmgw server`` process sharing the store; times are seconds on the database's clock."""

    address: str
    #: ``leader`` or ``standby``
    role: str
    #: since it last checked in (standbys every fifth of the lease, the leader every third)
    seen_ago: float
    #: since it started
    up_for: float
    #: the leader's fencing epoch, how long ago it took the lease, and when the lease runs out
    epoch: int | None = None
    lease_age: float | None = None
    expires_in: float | None = None


@attrs.frozen
class ControlServers:
    """Every server of the control plane: several on PostgreSQL, none listed on sqlite (one server)."""

    #: ``postgresql`` or ``sqlite``
    store: str
    servers: tuple[ControlServer, ...] = ()
