"""Telling the server what only the gateway sees: a replica it found stalled, the models' activity.

:meth:`SuspectReporter.report` queues a :class:`~llmgw.wire.SuspectReport`
(never waits: it is called from the stall watch); :meth:`SuspectReporter.run`
posts each to ``POST /v1/gateway/suspect`` on the server, with the gateway's
certificate, through the routes feed's connection pool: to the server it uses
now, moving on (as the routes feed does) when it cannot be reached or is a
standby, which names the leader. A report that cannot be delivered is logged
and dropped: the agent's canary finds a hung engine without it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import trio

from llmgw.gateway.balancer import Upstream
from llmgw.net.client import ClientResponse, ConnectionPool, HttpClientError
from llmgw.serverlist import ServerList, leader_hint
from llmgw.wire import SuspectReport, to_json

__all__ = ["SuspectReporter", "SUSPECT_PATH", "post_to_leader"]

log = logging.getLogger("llmgw.gateway")

#: the server's endpoint for gateway reports
SUSPECT_PATH = "/v1/gateway/suspect"
_QUEUED = 64


class SuspectReporter:
    """Reports stalled replicas to the server, one at a time, in the background.

    :param pool: the connection pool to the server (its TLS context holds the gateway's certificate).
    :param server: the server's base URL (several: comma-separated, as ``--server`` takes them).
    :param timeout: seconds one report may take.
    """

    def __init__(self, pool: ConnectionPool, server: str, *, timeout: float = 5.0) -> None:
        self.pool = pool
        #: the servers; reports go to the current one (the leader, once a standby named it)
        self.servers = ServerList.parse(server, schemes=("http", "https"))
        self.timeout = timeout
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
        response, _, why = await post_to_leader(self.pool, self.servers, path, record, within=self.timeout)
        if response is not None and response.status < 300:
            self.delivered += 1
            return True
        if response is not None:
            why = f"HTTP {response.status}: {(response.content or b'')[:200].decode(errors='replace')}"
        log.warning("could not report %s to the server: %s", about, why)
        return False


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
