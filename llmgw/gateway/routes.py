"""The gateway's routes: what the server's feed says, and the task that keeps watching it.

The server answers ``GET /v1/routes?revision=N&wait=1`` when its routes
revision differs from N, or after its poll timeout, with a
:class:`~llmgw.wire.RouteTable`::

    {"revision": 7,
     "models": ["embed", "llama"],                       # every served name in the catalog
     "routes": {"llama": [{"replica": "llama-0", "url": "http://10.0.0.5:21000"}]},
     "keys": {"<sha256 hex of an API key>": "<key name>"}}   # null before keys exist

:class:`RoutesWatcher` long-polls it for as long as the gateway runs. While the
server cannot be reached, the last routes stay in force: the outage is logged
once when it starts and once when it ends, and :meth:`RoutesWatcher.age`
(the ``llmgw_gateway_routes_age_seconds`` metric) keeps growing.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable

import trio

from llmgw.net.client import ConnectionPool, HttpClientError
from llmgw.serverlist import ServerList, leader_hint
from llmgw.wire import RouteTable, WireError, error_message, from_json

__all__ = ["RoutesError", "RoutesWatcher"]

log = logging.getLogger("llmgw.gateway")


class RoutesError(ValueError):
    """The routes feed answered something other than a routes document (an error status, not JSON)."""


class RoutesWatcher:
    """Long-polls the server's routes feed and hands every new table to ``on_update``.

    :param pool: the connection pool to the server (with its TLS context and client certificate).
    :param server: the server's base URL, ``https://host:7443``.
    :param on_update: called with each table whose revision differs from the last.
    :param request_timeout: seconds one poll may take, long-poll wait included.
    :param retry_interval: seconds between attempts while the server cannot be reached.
    """

    def __init__(
        self,
        pool: ConnectionPool,
        server: str,
        on_update: Callable[[RouteTable], None],
        *,
        request_timeout: float = 30.0,
        retry_interval: float = 0.5,
    ) -> None:
        self.pool = pool
        #: the servers (``server`` may list several, comma-separated); polls go to ``servers.current``
        self.servers = ServerList.parse(server, schemes=("http", "https"))
        self.on_update = on_update
        self.request_timeout = request_timeout
        self.retry_interval = retry_interval
        #: the last table received, None until the first answer
        self.table: RouteTable | None = None
        #: a table received held an API key: with none now, every key was revoked
        self.had_keys = False
        #: trio time of the last answer from the server
        self.last_success: float | None = None
        #: trio time the current outage began; None while the feed answers
        self.outage_since: float | None = None
        #: the longest long-poll answered unchanged (None: none yet), and the limit of the last unanswered
        self._longest_wait: float | None = None
        self._timed_out = request_timeout
        #: the server the last poll went to (after a failure ``self.server`` has moved on to the next)
        self._polled: str | None = None
        self._started = trio.current_time()

    @property
    def server(self) -> str:
        """The server polled now."""
        return self.servers.current

    @property
    def up(self) -> bool:
        """Whether the last poll of the feed succeeded."""
        return self.last_success is not None and self.outage_since is None

    def age(self) -> float:
        """Seconds since the server last answered (since the watcher started, before any answer)."""
        since = self.last_success if self.last_success is not None else self._started
        return trio.current_time() - since

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll the feed until cancelled; started at once, before the first answer."""
        task_status.started()
        wait = False
        while True:
            try:
                table = await self._poll(wait)
            except (HttpClientError, RoutesError, WireError, trio.TooSlowError) as exc:
                self._failed(exc)
                wait = False  # after an outage, ask for the current table at once
                await trio.sleep(self.retry_interval * random.uniform(0.8, 1.2))
                continue
            self._answered(table)
            wait = True

    def poll_limit(self) -> float:
        """Seconds the next long-poll may take before its server counts as hung: twice the server's poll
        timeout (5 s by default; the table says it, else the longest long-poll answered unchanged so far)
        plus 2 s, so a paused server is left in about 12 s; never more than :attr:`request_timeout`.
        The leader keeps a replica that left the routes running about that long for such a gateway."""
        waits = [w for w in (self._longest_wait, self.table and self.table.poll_timeout) if w]
        if not waits:
            return self.request_timeout
        return min(self.request_timeout, 2 * max(waits) + 2.0)

    async def _poll(self, wait: bool) -> RouteTable:
        revision = self.table.revision if self.table is not None else 0
        server = self._polled = self.server
        url = f"{server}/v1/routes?revision={revision}&wait={1 if wait else 0}"
        limit = self.poll_limit() if wait else self.request_timeout
        began = trio.current_time()
        try:
            with trio.fail_after(limit):  # the pool's read timeout covers a silent server too
                response = await self.pool.request("GET", url, headers=[("accept", "application/json")])
        except (HttpClientError, trio.TooSlowError) as exc:
            if isinstance(exc, trio.TooSlowError):
                self._timed_out = limit
            self.servers.failed(server)
            raise
        took = trio.current_time() - began
        if response.status != 200:
            try:
                body = json.loads(response.content or b"")
            except ValueError:
                body = None
            standby, leader = leader_hint(response.status, dict(response.headers), body)
            if standby:
                self.servers.not_leader(server, leader)
                leading = leader or "none yet"
                raise RoutesError(f"{server} is a standby (leader: {leading}); next: {self.server}")
            raise RoutesError(f"the server answered {response.status}: {_error_message(response.content)}")
        try:
            data = response.json()
        except ValueError:
            raise RoutesError("the server's answer is not JSON") from None
        table = from_json(data, RouteTable)
        if wait and table.revision == revision:  # nothing changed: the server waited its poll timeout
            self._longest_wait = took if self._longest_wait is None else max(self._longest_wait, took)
        return table

    def _answered(self, table: RouteTable) -> None:
        now = trio.current_time()
        if self.outage_since is not None:
            log.warning(
                "routes feed at %s answers again after %.1fs; routes revision %d",
                self.server,
                now - self.outage_since,
                table.revision,
            )
            self.outage_since = None
        self.last_success = now
        previous = self.table
        if previous is None or table != previous:
            self.table = table
            self.had_keys = self.had_keys or bool(table.keys)
            log.info("routes revision %d: %s", table.revision, table.summary())
            self.on_update(table)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, trio.TooSlowError):
            reason = f"no answer within {self._timed_out:g}s"
        else:
            reason = str(exc) or type(exc).__name__
        if self.outage_since is not None:
            log.debug("routes feed still unreachable: %s", reason)
            return
        self.outage_since = trio.current_time()
        failed = self._polled or self.server
        if self.table is None:
            log.warning("cannot read routes from %s: %s; retrying (no routes yet)", failed, reason)
        else:
            log.warning(
                "cannot read routes from %s: %s; serving from the last routes (revision %d) until it answers",
                failed,
                reason,
                self.table.revision,
            )


def _error_message(body: bytes | None) -> str:
    try:
        message = error_message(json.loads(body or b""))
    except ValueError:
        message = None
    return message or (body or b"").decode(errors="replace")[:200]
