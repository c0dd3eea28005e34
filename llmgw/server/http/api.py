"""The server's HTTP router: the route table, authentication and dispatch to one module per resource.

Each resource's handlers are a mixin of their own module (:mod:`.sync`, :mod:`.routes`, :mod:`.nodes`,
:mod:`.keys`, :mod:`.catalog`, :mod:`.weights`); the few read-only admin views (replicas, models, events,
servers, engines) are answered here.

Every request arrives over mutual TLS; who is calling is read from the
client certificate's role (:mod:`llmgw.pki`), never from the request. A node
may only sync as itself; admin endpoints take admin certificates only; the
routes feed and gateway reports (``POST /v1/gateway/suspect``, ``/v1/gateway/allowances``)
take admin or gateway certificates.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote, unquote

import trio

from llmgw.engine import Engine
from llmgw.models import NodeFacts
from llmgw.net.server import InvalidJSON, Request, Response
from llmgw.pki import Identity, IdentityError, RevocationList, Role, peer_identity
from llmgw.server.http.catalog import CatalogEndpoints
from llmgw.server.http.keys import KeysEndpoints
from llmgw.server.http.nodes import NodesEndpoints
from llmgw.server.http.replies import InvalidCatalog, Refused, answer, error, query_int
from llmgw.server.http.routes import RoutesEndpoints
from llmgw.server.http.servers import control_servers
from llmgw.server.http.sync import SyncEndpoints
from llmgw.server.http.weights import WeightsEndpoints
from llmgw.server.persist.cluster import recent_events
from llmgw.server.persist.sqlite import Store, StoreError
from llmgw.server.reconciler import Reconciler
from llmgw.server.state.allowances import Lender
from llmgw.server.state.budgets import Budgets
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import KeyRecord
from llmgw.server.views import cluster as views
from llmgw.server.views.models import model_list
from llmgw.wire import EngineInfo, EngineList, WireError

__all__ = ["ServerApp"]

log = logging.getLogger("llmgw.server")

#: seconds between two looks at the revocation list (one ``stat`` each)
REVOCATION_CHECK = 0.2

Handler = Callable[[Request, Identity, dict[str, str]], Awaitable[Response]]


class ServerApp(
    SyncEndpoints, RoutesEndpoints, NodesEndpoints, KeysEndpoints, CatalogEndpoints, WeightsEndpoints
):
    """The request handler of ``llmgw server`` (its route table and dispatch), and the reconciler's loop."""

    def __init__(
        self,
        cluster: ClusterState,
        store: Store,
        engines: Mapping[str, Engine],
        *,
        revocations: RevocationList | None = None,
        poll_timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
        read_only: bool = False,
    ) -> None:
        self.cluster = cluster
        #: a standby's view: it answers reads from what it loaded and never writes the store
        self.read_only = read_only
        self.store = store
        self.engines = engines
        self.revocations = revocations
        self.poll_timeout = poll_timeout
        self.clock = clock
        self.reconciler = Reconciler(cluster, store, clock=clock)
        self._lock = self.reconciler.lock
        self._routes: list[tuple[str, re.Pattern[str], frozenset[Role], Handler]] = []
        self._route("POST", r"/v1/agent/sync", {Role.NODE}, self._sync)
        self._route("GET", r"/v1/routes", {Role.ADMIN, Role.GATEWAY}, self._get_routes)
        self._route("POST", r"/v1/gateway/suspect", {Role.ADMIN, Role.GATEWAY}, self._gateway_suspect)
        self._route("POST", r"/v1/gateway/activity", {Role.ADMIN, Role.GATEWAY}, self._gateway_activity)
        self._route("POST", r"/v1/gateway/routes-held", {Role.ADMIN, Role.GATEWAY}, self._gateway_routes_held)
        self._route("POST", r"/v1/gateway/allowances", {Role.ADMIN, Role.GATEWAY}, self._gateway_allowances)
        admin = {Role.ADMIN}
        self._route("GET", r"/v1/admin/nodes", admin, self._get_nodes)
        self._route(
            "POST",
            r"/v1/admin/nodes/(?P<node>[^/]+)/(?P<action>cordon|uncordon|drain)",
            admin,
            self._node_action,
        )
        self._route("GET", r"/v1/admin/nodes/(?P<node>[^/]+)/drain", admin, self._get_drain)
        self._route("POST", r"/v1/admin/nodes/(?P<node>[^/]+)/lost", admin, self._declare_lost)
        self._route("GET", r"/v1/admin/replicas", admin, self._get_replicas)
        self._route("GET", r"/v1/admin/models", admin, self._get_models)
        self._route("GET", r"/v1/admin/catalog", admin, self._get_catalog)
        self._route("POST", r"/v1/admin/catalog", admin, self._apply_catalog)
        self._route("POST", r"/v1/admin/catalog/diff", admin, self._diff_catalog)
        self._route("GET", r"/v1/admin/catalog/history", admin, self._catalog_history)
        self._route("GET", r"/v1/admin/rollouts", admin, self._get_rollouts)
        self._route("GET", r"/v1/admin/autoscale", admin, self._get_autoscale)
        self._route("GET", r"/v1/admin/adapters", admin, self._get_adapters)
        self._route("POST", r"/v1/admin/rollouts/(?P<model>[^/]+)/undo", admin, self._undo_rollout)
        self._route("GET", r"/v1/admin/events", admin, self._get_events)
        self._route("GET", r"/v1/admin/servers", admin, self._get_servers)
        self._route("GET", r"/v1/admin/engines", admin, self._get_engines)
        self._route("GET", r"/v1/admin/keys", admin, self._list_keys)
        self._route("GET", r"/v1/admin/keys/usage", admin, self._keys_usage)
        self._route("POST", r"/v1/admin/keys", admin, self._create_key)
        self._route("PATCH", r"/v1/admin/keys/(?P<name>[^/]+)", admin, self._update_key)
        self._route("DELETE", r"/v1/admin/keys/(?P<name>[^/]+)", admin, self._revoke_key)
        self._weights_routes(self._route)
        #: node id -> (the facts it last sent, as JSON and as read): see _read_sync
        self._facts: dict[str, tuple[Any, NodeFacts]] = {}
        #: node id -> (what its last sync answer was made from, the answer)
        self._replies: dict[str, tuple[tuple, Response]] = {}
        self._replica_list: tuple[int, Response] | None = None
        #: replica id -> (when a gateway report on it was last recorded, reports folded since)
        self._suspects: dict[str, list] = {}
        #: API key name -> its record (hash of the secret, dates, limits)
        self.keys: dict[str, KeyRecord] = {}
        #: the fleet's buckets of the rate-limited keys (in memory: a new leader starts them empty)
        self.lender = Lender()
        #: every key's usage this month, read from the store when this server first lends
        self.budgets = Budgets()
        self._usage_lock = trio.Lock()
        #: the server's metrics (:class:`llmgw.server.metrics.ServerMetrics`), set by the server
        self.metrics: Any = None

    def _route(self, method: str, pattern: str, roles: set[Role], handler: Handler) -> None:
        self._routes.append((method, re.compile(f"^{pattern}$"), frozenset(roles), handler))

    # -- the reconciler loop -----------------------------------------------

    async def commit(self) -> None:
        """Reconcile now, persist what changed, and wake waiters. Call with the lock held."""
        await self.reconciler.reconcile()

    async def run_reconciler(self, interval: float = 1.0, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Reconcile when asked and every ``interval`` seconds (lost nodes, backoff); runs until cancelled."""
        await self.reconciler.run(interval, task_status=task_status)

    async def watch_revocations(self, interval: float = REVOCATION_CHECK) -> None:
        """Every ``interval`` seconds, reload the revocation list if it changed and fence revoked nodes.

        Started with the reconciler; runs until cancelled. A check is one ``stat``: frequent
        enough that the routes drop a revoked node well within a second of ``ca revoke``. It first
        fences, from the list as it stands, every node revoked while no server led (or while this one
        was a standby): a leader that starts does not wait for the list to change again.
        """
        if self.revocations is not None:
            self.revocations.refresh()
            await self.fence_revoked()
        while True:
            await trio.sleep(interval)
            await self._reload_revocations()

    async def fence_revoked(self) -> None:
        """Declare lost at once every node whose last certificate is revoked (``ClusterState.fence_node``).

        Called when the revocation list is reloaded and when a revoked node is
        refused; commits only when some node was fenced.
        """
        if self.revocations is None:
            return
        async with self._lock:
            now = self.clock()
            fenced = [
                self.cluster.fence_node(node.node_id, f"its certificate {node.cert_serial:x} is revoked", now)
                for node in list(self.cluster.nodes.values())
                if node.cert_serial is not None and self.revocations.is_revoked(node.cert_serial)
            ]
            if any(fenced):
                await self.commit()

    async def _reload_revocations(self) -> None:
        if self.revocations is not None and self.revocations.refresh():
            log.info("revocation list reloaded: %d revoked", len(self.revocations.serials))
            await self.fence_revoked()

    # -- dispatch ------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        """Answer one request: authenticate, route, and turn refusals into JSON errors."""
        try:
            identity = peer_identity(request.peer_cert_der)
        except IdentityError as exc:
            return error(401, f"client certificate refused: {exc}")
        if self.revocations is not None and self.revocations.is_revoked(identity.serial):
            log.warning("refused %s: certificate serial %s is revoked", identity, identity.serial_hex)
            if identity.role is Role.NODE:
                await self.fence_revoked()
            message = f"certificate {identity.serial_hex} of {identity.name} is revoked"
            return error(403, message, kind="revoked")
        try:
            path = _decoded_path(request.path)
        except UnicodeDecodeError:
            return error(400, f"path {request.path}: a %-escape is not UTF-8")
        path_matched = False
        for method, pattern, roles, handler in self._routes:
            match = pattern.match(path)
            if not match:
                continue
            path_matched = True
            if method != request.method:
                continue
            if identity.role not in roles:
                allowed = " or ".join(sorted(r.value for r in roles))
                log.warning(
                    "refused %s on %s %s: needs a %s certificate", identity, method, request.path, allowed
                )
                return error(
                    403,
                    f"{request.path} needs a {allowed} certificate; "
                    f"yours is a {identity.role.value} certificate ({identity.name})",
                )
            try:
                params = {name: unquote(value) for name, value in match.groupdict().items()}
                response = await handler(request, identity, params)
            except Refused as refused:
                response = error(refused.status, refused.message)
            except (InvalidJSON, WireError) as exc:
                response = error(400, str(exc))
            except InvalidCatalog as invalid:
                exc = invalid.error
                response = error(400, str(exc), kind="invalid_catalog", problems=exc.problems)
            except StoreError as unreachable:  # a read of the store itself (ctl servers) while it is down
                response = error(503, f"the store is unreachable: {unreachable}", kind="store_unreachable")
            if self.metrics is not None:
                self.metrics.answered(handler.__name__.lstrip("_"), response.status)
            return response
        if path_matched:
            return error(405, f"{request.method} is not allowed on {request.path}")
        return error(404, f"no such endpoint: {request.path}")

    async def _get_models(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        return answer(model_list(self.cluster))

    # -- admin ---------------------------------------------------------------

    async def _get_replicas(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        # thousands of replicas take a while to encode: once per change of what they show
        version = self.cluster.view_version
        if self._replica_list is None or self._replica_list[0] != version:
            self._replica_list = (version, answer(views.replica_list(self.cluster)))
        return self._replica_list[1]

    async def _get_events(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        since = query_int(request.query.get("since", "0"), "since")
        limit = min(query_int(request.query.get("limit", "200"), "limit"), 10_000)
        # events recorded since the reconciler last ran are stored first: a reader sees what already happened
        if not self.read_only:
            async with self._lock:
                await self.reconciler.save()
        return answer(await self.store.run(lambda conn: recent_events(conn, since, limit)))

    async def _get_servers(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        return answer(await control_servers(self.store))

    async def _get_engines(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        engines = tuple(
            EngineInfo(name, tuple(e.checked_versions), e.multi_node)
            for name, e in sorted(self.engines.items())
        )
        return answer(EngineList(engines))


def _decoded_path(raw: str) -> str:
    """``raw`` with each segment percent-decoded once, then re-escaped alike.

    Routes match the result, so ``/v1/admin/%6Beys`` is ``/v1/admin/keys`` and a
    segment holding ``%2F`` stays one segment; the handler gets each captured
    segment decoded (``unquote``), never decoded twice.
    """
    return "/".join(quote(unquote(part, errors="strict"), safe="") for part in raw.split("/"))
