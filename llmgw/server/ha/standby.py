"""A standby's answers: the admin API's reads and the routes feed, from the store as the leader last wrote it.

While another server leads, a standby (PostgreSQL store) holds a read-only
view: the cluster loaded from the store as a restarting server loads it
(:func:`~llmgw.server.persist.cluster.load_cluster`, the API keys), read in one
REPEATABLE READ transaction together with the change feed's revision (table
``feed``, moved by every write of the leader in that write's transaction).
It follows the feed from a connection of its own: ``LISTEN llmgw_changes``
wakes it when a write of the leader commits (a hint only: nothing is lost
when a notification is), and it reads the revision every :data:`POLL`
seconds anyway. When the revision moved it reads a new view, parsing again
only the rows whose stored text changed. A standby that
lost its connection resumes from the revision its view holds: the view is
read whole, so nothing written meanwhile is missed (after a failure it reads
anew whatever the revision says: a crashed database may have lost its last
commits under asynchronous commit, and numbered new ones alike).

What it answers from the view: ``GET`` under ``/v1/admin/`` (nodes,
replicas, events, servers, keys, catalog, rollouts, drains, engines), ``POST
/v1/admin/catalog/diff`` (it changes nothing), and the routes feed (with its
long-poll), each answer carrying :data:`STANDBY_HEADER`. What the agents
alone report (each shard's PID, state, log) is not stored, so a standby shows
shards as ``unknown``: only the leader knows them. Everything else (admin
writes, agent syncs, gateway reports) gets 503 ``not_leader`` naming the
leader, and clients move there. Writes are not forwarded: the leader
authorizes each request by the client certificate of its own TLS connection,
which a forwarding standby would replace with its own.

A view the standby could not check for :attr:`StandbyView.stale_after`
seconds (the store unreachable) is not served: 503 ``not_leader``, so
gateways and ``ctl`` move on to another server. An admin read that asks for
it (:data:`~llmgw.serverlist.STALE_OK_HEADER`: ``ctl`` does once no server
answered) is answered from that view all the same, its header saying how
long ago the view was last checked and that the store is unreachable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode

import attrs
import trio

from llmgw.engine import Engine
from llmgw.errors import CatalogError
from llmgw.net.server import Request, Response
from llmgw.pki import IdentityError, RevocationList, Role, peer_identity
from llmgw.server.http.api import ServerApp
from llmgw.server.http.keys import active_keys
from llmgw.server.persist.cluster import load_api_keys, load_cluster
from llmgw.server.persist.postgres import FEED_CHANNEL, PgStore, feed_revision
from llmgw.server.state.cluster import Settings
from llmgw.server.views.cluster import route_table
from llmgw.serverlist import STALE_OK_HEADER, STANDBY_HEADER, STORE_HEADER, STORE_UNREACHABLE
from llmgw.wire import RouteTable

__all__ = ["POLL", "STANDBY_HEADER", "StandbyView", "View"]

log = logging.getLogger("llmgw.server")

#: seconds between two reads of the feed's revision when no notification came
POLL = 1.0
#: the shortest time between two reloads of the view (a burst of writes is one reload)
MIN_GAP = 0.1

#: what a standby answers from its view: (method, path prefix or whole path)
_READS = (("GET", "/v1/admin/"), ("GET", "/v1/routes"), ("POST", "/v1/admin/catalog/diff"))


@attrs.frozen
class View:
    """The cluster as the store held it at one revision of the change feed."""

    revision: int
    #: answers the reads: a server app over the loaded cluster, whose reconciler never runs
    app: ServerApp


class _Memo:
    """What each stored text was read as, kept from one view to the next: a reload parses what changed.

    Called from the store's thread only, one load at a time.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple, Any] = {}
        self._used: dict[tuple, Any] = {}

    def __call__(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key in self._used:
            return self._used[key]
        value = self._kept.pop(key) if key in self._kept else make()
        self._used[key] = value
        return value

    def rotate(self) -> None:
        """A load ended: keep what it used, forget the rest (rows gone or changed)."""
        self._kept, self._used = self._used, {}


def _no_refusal() -> Response:
    raise AssertionError("StandbyView.refusal was not set")


@attrs.define(eq=False)
class StandbyView:
    """A standby's view of the store and its answers; see the module docstring.

    Set :attr:`refusal` before answering: the answer to what a standby does not answer (503
    ``not_leader`` naming the leader; :func:`~llmgw.server.ha.lease.lead_when_elected` sets it, and
    :attr:`leader`).

    :param poll: seconds between two reads of the feed's revision without a notification.
    :param stale_after: seconds after the last successful look at the feed past which the view is not served.
    """

    store: PgStore
    engines: Mapping[str, Engine]
    settings: Settings
    revocations: RevocationList | None = attrs.field(default=None, kw_only=True)
    poll_timeout: float = attrs.field(default=5.0, kw_only=True)
    poll: float = attrs.field(default=POLL, kw_only=True)
    stale_after: float = attrs.field(default=6.0, kw_only=True)
    refusal: Callable[[], Response] = attrs.field(default=_no_refusal, init=False)
    #: the leader's URL as this server last read the lease (None: none known); named in answers
    leader: Callable[[], str | None] = attrs.field(default=lambda: None, init=False)
    #: the view answered from; None until the first is read (and while this server leads)
    view: View | None = attrs.field(default=None, init=False)
    #: trio time of the last successful read of the feed's revision
    checked_at: float | None = attrs.field(default=None, init=False)
    #: how many views were read (tests and logs)
    reloads: int = attrs.field(default=0, init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _routes: tuple[RouteTable, int] | None = attrs.field(default=None, init=False)
    _bad_revision: int | None = attrs.field(default=None, init=False)
    _memo: _Memo = attrs.field(factory=_Memo, init=False)

    # -- following the feed ----------------------------------------------------

    async def follow(
        self, *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep the view current until cancelled; ``started`` with the scope that cancels it.

        Called by :func:`~llmgw.server.ha.lease.lead_when_elected` while this server is a standby.
        Store errors are logged once, then retried every :attr:`poll` seconds; the view ages meanwhile.
        """
        with trio.CancelScope() as scope:
            task_status.started(scope)
            listener: list[Any] = []  # this call's own connection, closed when it ends
            failing: str | None = None
            try:
                while True:
                    try:
                        revision = await trio.to_thread.run_sync(self._look, listener)
                        looked = trio.current_time()
                        # after a failure, read anew whatever the revision: a database that crashed
                        # may have lost its last commits (asynchronous commit) and counted them again
                        if self.view is None or revision != self.view.revision or failing is not None:
                            if not await self._reload(revision):  # the view ages: clients move on
                                await trio.sleep(self.poll)
                                continue
                            self.checked_at = looked
                            await trio.sleep(MIN_GAP)
                        else:
                            self.checked_at = looked
                    except Exception as exc:
                        _close(listener)
                        reason = str(exc).strip()
                        if failing is None:
                            held = f"revision {self.view.revision}" if self.view else "none yet"
                            log.warning("standby: cannot follow the store (%s); view held: %s", reason, held)
                        failing = reason
                        await trio.sleep(self.poll)
                        continue
                    if failing is not None:
                        log.warning("standby: the store answers again; view at revision %d", revision)
                        failing = None
            finally:
                _close(listener)

    def _look(self, listener: list[Any]) -> int:
        """The feed's revision: at once on a new connection (resuming), else after a notification or poll."""
        if not listener:
            conn = self.store.connect()
            listener.append(conn)
            conn.execute(f"LISTEN {FEED_CHANNEL}")  # before reading: no commit after the read goes unnoticed
        else:
            conn = listener[0]
            for _ in conn.notifies(timeout=self.poll, stop_after=1):
                pass
        return feed_revision(conn)

    async def _reload(self, seen: int) -> bool:
        """Read the view anew; False when the stored state cannot be read here (logged once per revision)."""
        engines, settings, memo = self.engines, self.settings, self._memo

        def read(conn: Any) -> tuple[int, Any, dict]:
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            revision = feed_revision(conn)
            try:
                cluster = load_cluster(conn, settings, engines, time.time(), memo=memo)
            finally:
                memo.rotate()
            return revision, cluster, load_api_keys(conn)

        try:
            revision, cluster, keys = await self.store.run(read)
        except CatalogError as exc:
            if self._bad_revision != seen:
                log.warning("standby: cannot read the stored state at revision %d: %s", seen, exc)
            self._bad_revision = seen
            return False
        app = ServerApp(
            cluster,
            self.store,
            self.engines,
            revocations=self.revocations,
            poll_timeout=self.poll_timeout,
            read_only=True,
        )
        app.keys = keys
        table = attrs.evolve(route_table(cluster, *active_keys(keys), self.engines), revision=0)
        if self._routes is None or self._routes[0] != table:
            # as the leader numbers them: milliseconds, so a gateway moving between servers sees a change
            previous = self._routes[1] if self._routes else 0
            self._routes = (table, max(previous + 1, int(time.time() * 1000)))
        cluster.routes_revision = self._routes[1]
        self.view = View(revision, app)
        self.reloads += 1
        log.debug("standby: view at revision %d (%d nodes, %d replicas)", revision, len(cluster.nodes),
                  len(cluster.replicas))  # fmt: skip
        self._changed.set()
        self._changed = trio.Event()
        return True

    def clear(self) -> None:
        """Forget the view (this server leads now; a later standby spell reads a new one)."""
        self.view = None
        self.checked_at = None
        self._changed.set()
        self._changed = trio.Event()

    # -- answering -----------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        """A standby's answer: a read from the view (with :data:`STANDBY_HEADER`), else the refusal."""
        view = self.view
        fresh = self._fresh()
        stale_ok = request.header(STALE_OK_HEADER) == "1" and request.path.startswith("/v1/admin/")
        if view is None or not (fresh or stale_ok) or not _is_read(request) or _from_node(request):
            return self.refusal()
        if request.path == "/v1/routes" and request.query.get("wait") == "1":
            await self._wait_routes(request.query.get("revision", ""))
            view = self.view
            if view is None or not self._fresh():
                return self.refusal()
            request = attrs.evolve(
                request, target=f"{request.path}?{urlencode({**request.query, 'wait': '0'})}"
            )
        response = await view.app.handle(request)
        # the view is current as of the last look at the feed, however long ago it was read
        checked = trio.current_time() - (self.checked_at or trio.current_time())
        note = f"revision {view.revision}, checked {checked:.1f} s ago"
        if (leader := self.leader()) is not None:
            note += f", leader {leader}"
        marks = ((STANDBY_HEADER, note),) + (() if fresh else ((STORE_HEADER, STORE_UNREACHABLE),))
        return attrs.evolve(response, headers=(*response.headers, *marks))

    async def _wait_routes(self, known: str) -> None:
        """Wait up to the poll timeout until the view's routes revision is not ``known``."""
        with trio.move_on_after(self.poll_timeout):
            while self.view is not None and str(self.view.app.cluster.routes_revision) == known:
                await self._changed.wait()

    def _fresh(self) -> bool:
        return self.checked_at is not None and trio.current_time() - self.checked_at <= self.stale_after


def _is_read(request: Request) -> bool:
    path = request.path
    return any(
        request.method == method and (path.startswith(prefix) if prefix.endswith("/") else path == prefix)
        for method, prefix in _READS
    )


def _from_node(request: Request) -> bool:
    """Whether a node certificate sent ``request`` (agents go to the leader); the app judges bad ones."""
    try:
        return peer_identity(request.peer_cert_der).role is Role.NODE
    except IdentityError:
        return False


def _close(listener: list[Any]) -> None:
    while listener:
        listener.pop().close()
