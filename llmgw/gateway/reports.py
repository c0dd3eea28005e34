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

import trio

from llmgw.gateway.balancer import Upstream
from llmgw.net.client import ConnectionPool, HttpClientError
from llmgw.serverlist import ServerList, leader_hint
from llmgw.wire import SuspectReport, to_json

__all__ = ["SuspectReporter", "SUSPECT_PATH"]

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
        body = json.dumps(to_json(record)).encode()
        headers = [("content-type", "application/json"), ("accept", "application/json")]
        why = None
        with trio.move_on_after(self.timeout) as scope:
            for _ in range(len(self.servers) + 1):
                server = self.servers.current
                try:
                    response = await self.pool.request(
                        "POST", server + path, headers=headers, body=body, limit=65536
                    )
                except HttpClientError as exc:
                    why = f"{server}: {exc}"
                    self.servers.failed(server)
                    continue
                if response.status < 300:
                    self.delivered += 1
                    return True
                text = (response.content or b"")[:200].decode(errors="replace")
                try:
                    answer = json.loads(response.content or b"")
                except ValueError:
                    answer = None
                standby, leader = leader_hint(response.status, dict(response.headers), answer)
                if standby:  # only the leader records reports
                    why = f"{server} is a standby (leader: {leader or 'none yet'})"
                    self.servers.not_leader(server, leader)
                    continue
                why = f"HTTP {response.status}: {text}"
                break
        if scope.cancelled_caught:
            why = f"no answer within {self.timeout:g} s"
        log.warning("could not report %s to the server: %s", about, why)
        return False
