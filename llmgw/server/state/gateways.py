"""The gateways' routes in hand: which routes generation each gateway process last said it routes by.

A gateway process posts a :class:`~llmgw.wire.RoutesHeld` to the leader when a
new routes table reaches it and every :data:`~llmgw.gateway.reports.HELD_INTERVAL`
seconds. A gateway may read its routes from a standby, or from a server that went
silent (paused, cut off) while it waits out its poll: for those seconds it sends
new requests to replicas the leader has already taken out of the routes. So a
replica retired while ready keeps running (:mod:`llmgw.server.controllers.stopping`)
until every process heard from within :data:`GATEWAY_TTL` holds a table without it.

Kept in the leader's memory only: a new leader hears from every live gateway
within one interval, and waits at most the linger bound for one it has not.
"""

from __future__ import annotations

import attrs

__all__ = ["GATEWAY_TTL", "GatewayBook", "HeldRoutes"]

#: seconds after its last report a gateway process is taken for gone (it reports every 2 s)
GATEWAY_TTL = 7.0


@attrs.frozen
class HeldRoutes:
    """What one gateway process last said: the generation it routes by, when it said it."""

    generation: int
    seen: float


class GatewayBook:
    """Every gateway process heard from lately, by its ``name/token``."""

    def __init__(self) -> None:
        #: process -> what it last said
        self.processes: dict[str, HeldRoutes] = {}

    def note(self, process: str, generation: int, now: float) -> None:
        """Keep what ``process`` said (``POST /v1/gateway/routes-held``) and forget processes gone quiet."""
        self.processes[process] = HeldRoutes(generation, now)
        if len(self.processes) > 64:
            self.processes = {p: h for p, h in self.processes.items() if now - h.seen < GATEWAY_TTL}

    def behind(self, generation: int, now: float) -> list[str]:
        """The processes heard from within :data:`GATEWAY_TTL` that route by a table older than
        ``generation`` (sorted): a replica that left the routes at ``generation`` may still get their
        requests. Called by the stopping controller on every pass while a retired replica lingers."""
        return sorted(
            p for p, h in self.processes.items() if h.generation < generation and now - h.seen < GATEWAY_TTL
        )
