"""Telling the server what only the gateway sees: a replica it found stalled, the models' activity, the
routes it holds.

:meth:`SuspectReporter.report` queues a :class:`~llmgw.wire.SuspectReport`
(never waits: it is called from the stall watch); :meth:`SuspectReporter.run`
posts each to ``POST /v1/gateway/suspect`` on the server, with the gateway's
certificate, through the routes feed's connection pool: to the server it uses
now, moving on (as the routes feed does) when it cannot be reached or is a
standby, which names the leader. A report that cannot be delivered is logged
and dropped: the agent's canary finds a hung engine without it.

:class:`HeldReporter` posts :class:`~llmgw.wire.RoutesHeld` (the routes generation
this process routes by) to ``POST /v1/gateway/routes-held`` when a new table
arrives and every :data:`HELD_INTERVAL` seconds: the leader keeps a retired
replica running until every gateway routes without it
(:mod:`llmgw.server.controllers.stopping`).
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

import trio

from llmgw.gateway.balancer import Upstream
from llmgw.net.client import ClientResponse, ConnectionPool, HttpClientError
from llmgw.serverlist import ServerList, leader_hint
from llmgw.wire import RoutesHeld, RouteTable, SuspectReport, to_json

__all__ = ["HELD_INTERVAL", "HELD_PATH", "HeldReporter", "SuspectReporter", "SUSPECT_PATH", "post_to_leader"]

log = logging.getLogger("llmgw.gateway")

#: the server's endpoint for gateway reports
SUSPECT_PATH = "/v1/gateway/suspect"
#: the server's endpoint for the routes a gateway process holds
HELD_PATH = "/v1/gateway/routes-held"
#: seconds between two reports of the routes held when none arrived (the server forgets a process
#: after :data:`llmgw.server.state.gateways.GATEWAY_TTL`)
HELD_INTERVAL = 2.0
_QUEUED = 64


class _ToLeader:
    """What the reporters share: the connection pool, a server list of their own (reports go to the
    leader, wherever the routes feed reads from), and how long one report may take.

    :param pool: the connection pool to the server (its TLS context holds the gateway's certificate).
    :param server: the server's base URL (several: comma-separated, as ``--server`` takes them).
    :param timeout: seconds one report may take.
    """

    def __init__(self, pool: ConnectionPool, server: str, *, timeout: float = 5.0) -> None:
        self.pool = pool
        #: the servers; reports go to the current one (the leader, once a standby named it)
        self.servers = ServerList.parse(server, schemes=("http", "https"))
        self.timeout = timeout

    async def _to_leader(self, path: str, record: object) -> str | None:
        """POST ``record`` to ``path`` on the leader; None when it accepted it, else why not."""
        response, _, why = await post_to_leader(self.pool, self.servers, path, record, within=self.timeout)
        if response is not None and response.status < 300:
            return None
        if response is not None:
            why = f"HTTP {response.status}: {(response.content or b'')[:200].decode(errors='replace')}"
        return why


class SuspectReporter(_ToLeader):
    """Reports stalled replicas to the server, one at a time, in the background (see :class:`_ToLeader`)."""

    def __init__(self, pool: ConnectionPool, server: str, *, timeout: float = 5.0) -> None:
        super().__init__(pool, server, timeout=timeout)
        self._send, self._receive = trio.open_memory_channel[SuspectReport](_QUEUED)
        #: reports the server accepted (for tests)
        self.delivered = 0

    def report(self, replica: Upstream, reason: str) -> None:
        """Queue a report that ``replica`` stalled; dropped (logged) when too many wait already."""
        try:
            self._send.send_nowait(SuspectReport(replica.name, reason[:2000]))
        except trio.WouldBlock:
            log.warning("not reporting replica %s: %d reports wait already", replica.name, _QUEUED)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver queued reports until cancelled; started at once."""
        task_status.started()
        async for report in self._receive:
            await self._deliver(report)

    async def _deliver(self, report: SuspectReport) -> None:
        await self.post(SUSPECT_PATH, report, f"replica {report.replica}")

    async def post(self, path: str, record: object, about: str) -> bool:
        """POST ``record`` (a :mod:`llmgw.wire` record) to ``path`` on the leader, within :attr:`timeout`.

        Called for each queued suspect report, and by the activity reports of
        :class:`~llmgw.gateway.demand.Demand`. A failure is logged (naming ``about``), never raised.

        :returns: whether the server accepted it.
        """
        why = await self._to_leader(path, record)
        if why is None:
            self.delivered += 1
            return True
        log.warning("could not report %s to the server: %s", about, why)
        return False


class HeldReporter(_ToLeader):
    """Tells the leader which routes generation this gateway process routes by (see :class:`_ToLeader`)."""

    def __init__(self, pool: ConnectionPool, server: str, *, timeout: float = 5.0) -> None:
        super().__init__(pool, server, timeout=timeout)
        #: this process among the gateway's (the server keeps it under the certificate's name)
        self.process = secrets.token_hex(8)
        #: the generation of the table in force; None before the first
        self.generation: int | None = None
        #: the generation the leader last accepted from this process
        self.delivered: int | None = None
        self._arrived = trio.Event()
        self._failing = False

    def routes_changed(self, table: RouteTable) -> None:
        """A new routes table is in force: report its generation at once. Called by the routes watcher."""
        if table.generation != self.generation:
            self.generation = table.generation
            self._arrived.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Report at once on each new table, and every :data:`HELD_INTERVAL` seconds; until cancelled."""
        task_status.started()
        while True:
            with trio.move_on_after(HELD_INTERVAL):
                await self._arrived.wait()
            self._arrived = trio.Event()
            if self.generation is not None:
                await self._post(self.generation)

    async def _post(self, generation: int) -> None:
        why = await self._to_leader(HELD_PATH, RoutesHeld(self.process, generation))
        if why is None:
            if self._failing:
                log.info("the leader hears again which routes this gateway holds (generation %d)", generation)
            self._failing, self.delivered = False, generation
            return
        if not self._failing:  # once per outage: every HELD_INTERVAL would flood the log
            log.warning(
                "cannot tell the leader which routes this gateway holds: %s; it stops replicas that left the "
                "routes after a bounded wait instead",
                why,
            )
        self._failing = True


async def post_to_leader(
    pool: ConnectionPool, servers: ServerList, path: str, record: object, *, within: float, limit: int = 65536
) -> tuple[ClientResponse | None, Any, str]:
    """POST ``record`` (a :mod:`llmgw.wire` record) to ``path`` on the leader among ``servers``.

    Goes to the current server, moving on when one cannot be reached or is a standby (to the leader it
    names), at most once per server and once more, within ``within`` seconds in all. Called by the
    gateway's reports and its key-rate leases.

    :returns: the first answer that is not a standby's (any status), its JSON (None if not JSON), and "";
        or None, None and why no server answered.
    """
    body = json.dumps(to_json(record)).encode()
    headers = [("content-type", "application/json"), ("accept", "application/json")]
    why = "no server to ask"
    with trio.move_on_after(within):
        for _ in range(len(servers) + 1):
            server = servers.current
            try:
                response = await pool.request("POST", server + path, headers=headers, body=body, limit=limit)
            except HttpClientError as exc:
                why = f"{server}: {exc}"
                servers.failed(server)
                continue
            try:
                answer = json.loads(response.content or b"")
            except ValueError:
                answer = None
            standby, leader = leader_hint(response.status, dict(response.headers), answer)
            if not standby:
                return response, answer, ""
            why = f"{server} is a standby (leader: {leader or 'none yet'})"
            servers.not_leader(server, leader)
        return None, None, why
    return None, None, f"no answer within {within:g} s"
