"""The gateways' routes in hand: which routes generation each gateway process last said it routes by.

A gateway process posts a :class:`~llmgw.wire.RoutesHeld` to the leader when a
new routes table reaches it and every :data:`~llmgw.gateway.reports.HELD_INTERVAL`
seconds. A gateway may read its routes from a standby, or from a server that went
silent (paused, cut off) while it waits out its poll: for those seconds it sends
new requests to replicas the leader has already taken out of the routes. So a
replica retired while ready keeps running (:mod:`llmgw.server.controllers.stopping`)
until every process heard from within :data:`GATEWAY_TTL` holds a table without it.

Kept in the leader's memory only. A new leader has heard from no gateway yet: for
its first :data:`GATEWAY_TTL` seconds (:meth:`GatewayBook.unsure`) it lets a retired
replica go only once it expects a report from each gateway that might route to it,
and at most after the linger bound.
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

    def __init__(self, started: float | None = None) -> None:
        #: process -> what it last said
        self.processes: dict[str, HeldRoutes] = {}
        #: when this server began to hear reports (it began to lead); None: it knows every gateway
        self.started = started

    def unsure(self, now: float) -> bool:
        """Whether a gateway alive now may not have reported to this server yet: within
        :data:`GATEWAY_TTL` of :attr:`started`. Called by the stopping controller while a replica lingers."""
        return self.started is not None and now - self.started < GATEWAY_TTL

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
