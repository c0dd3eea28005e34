"""The server's HTTP API: the agent sync call, the admin API, the routes feed.

Every request arrives over mutual TLS; who is calling is read from the
client certificate's role (:mod:`llmgw.pki`), never from the request. A node
may only sync as itself; admin endpoints take admin certificates only; the
routes feed and gateway reports (``POST /v1/gateway/suspect``) take admin or
gateway certificates.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote, unquote

import attrs
import trio

from llmgw.engine import Engine
from llmgw.models import NodeFacts
from llmgw.net.server import InvalidJSON, Request, Response
from llmgw.pki import Identity, IdentityError, RevocationList, Role, peer_identity
from llmgw.server.http.catalog import CatalogEndpoints
from llmgw.server.http.replies import InvalidCatalog, Refused, answer, error, query_int
from llmgw.server.http.servers import control_servers
from llmgw.server.http.weights import WeightsEndpoints
from llmgw.server.persist.cluster import (
    add_api_key,
    load_api_keys,
    recent_events,
    revoke_api_key,
)
from llmgw.server.persist.sqlite import Store, StoreError
from llmgw.server.reconciler import Reconciler
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import EventKind
from llmgw.server.views import cluster as views
from llmgw.server.views.models import model_list
from llmgw.wire import (
    ApiKey,
    CreatedKey,
    CreateKey,
    EngineInfo,
    EngineList,
    KeyList,
    RevokedKey,
    SuspectRecorded,
    SuspectReport,
    SyncReply,
    SyncRequest,
    WireError,
    from_json,
)

__all__ = ["ServerApp"]

log = logging.getLogger("llmgw.server")

#: seconds between two looks at the revocation list (one ``stat`` each)
REVOCATION_CHECK = 0.2

Handler = Callable[[Request, Identity, dict[str, str]], Awaitable[Response]]


class ServerApp(CatalogEndpoints, WeightsEndpoints):
    """The request handler of ``llmgw server``, and the reconciler's loop."""

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
        self._route("POST", r"/v1/admin/rollouts/(?P<model>[^/]+)/undo", admin, self._undo_rollout)
        self._route("GET", r"/v1/admin/events", admin, self._get_events)
        self._route("GET", r"/v1/admin/servers", admin, self._get_servers)
        self._route("GET", r"/v1/admin/engines", admin, self._get_engines)
        self._route("GET", r"/v1/admin/keys", admin, self._list_keys)
        self._route("POST", r"/v1/admin/keys", admin, self._create_key)
        self._route("DELETE", r"/v1/admin/keys/(?P<name>[^/]+)", admin, self._revoke_key)
        self._weights_routes(self._route)
        #: node id -> (the facts it last sent, as JSON and as read): see _read_sync
        self._facts: dict[str, tuple[Any, NodeFacts]] = {}
        #: node id -> (what its last sync answer was made from, the answer)
        self._replies: dict[str, tuple[tuple, Response]] = {}
        self._replica_list: tuple[int, Response] | None = None
        #: replica id -> (when a gateway report on it was last recorded, reports folded since)
        self._suspects: dict[str, list] = {}
        #: API key name -> (sha256 hex of the secret, created at, revoked at or None)
        self.keys: dict[str, tuple[str, float, float | None]] = {}
        #: the server's metrics (:class:`llmgw.server.metrics.ServerMetrics`), set by the server
        self.metrics: Any = None

    async def load_keys(self) -> None:
        """Read the API keys from the store; called once at start."""
        self.keys = await self.store.run(load_api_keys)

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
        enough that the routes drop a revoked node well within a second of ``ca revoke``.
        """
        while True:
            await self._reload_revocations()
            await trio.sleep(interval)

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

    # -- agents --------------------------------------------------------------

    async def _sync(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        began = time.perf_counter()
        sync = self._read_sync(request.json(), identity.name)
        if sync.node_id != identity.name:
            message = (
                f"node certificate for {identity.name!r} cannot sync as node {sync.node_id!r}; "
                "a node syncs under the id its certificate was issued for"
            )
            log.warning("refused sync: certificate CN %r claims node id %r", identity.name, sync.node_id)
            self.cluster.record_event(
                self.clock(),
                EventKind.REFUSAL,
                sync.node_id,
                f"sync refused: certificate is for {identity.name!r}",
            )
            async with self._lock:
                await self.reconciler.save()
            raise Refused(403, message)
        if self.cluster.sync(sync, self.clock()):
            self.reconciler.request()
        self.cluster.record_certificate(sync.node_id, identity.serial, identity.not_after.timestamp())
        if self.metrics is not None:
            self.metrics.sync_duration.observe(time.perf_counter() - began)
        if sync.wait:
            await self.reconciler.wait_node(sync.node_id, sync.revision, self.poll_timeout)
        return self._sync_reply(sync.node_id)

    def _read_sync(self, data: Any, node: str) -> SyncRequest:
        """The sync request in ``data``, its facts reused when they are the ones ``node`` sent last.

        Facts change rarely and are most of a sync's body: structuring them
        again for every heartbeat would be most of a sync's cost.
        """
        facts = data.get("facts") if isinstance(data, dict) else None
        known = self._facts.get(node)
        if known is None or facts != known[0]:
            sync = from_json(data, SyncRequest)
            self._facts[node] = (facts, sync.facts)
            return sync
        sync = from_json({**data, "facts": {"node_id": node, "agent_version": ""}}, SyncRequest)
        return attrs.evolve(sync, facts=known[1])

    def _sync_reply(self, node_id: str) -> Response:
        """The sync answer for ``node_id``, encoded once per revision of what it says."""
        shards = views.desired_for(self.cluster, node_id)
        stage = self.cluster.rollouts.stage_sources().get(node_id, ())
        key = (self.cluster.revision, self.cluster.sources_revision, shards, stage)
        cached = self._replies.get(node_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        reply = SyncReply(
            revision=self.cluster.revision,
            shards=shards,
            check_sources=self.cluster.sources_to_check(),
            stage_sources=stage,
            lost_after=self.cluster.settings.lost_after,
            disk_headroom=self.cluster.settings.disk_headroom,
        )
        response = answer(reply)
        self._replies[node_id] = (key, response)
        return response

    async def _get_models(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        return answer(model_list(self.cluster))

    async def _get_routes(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        known = query_int(request.query.get("revision", "0"), "revision")
        if request.query.get("wait") == "1":
            await self.reconciler.wait_routes(known, self.poll_timeout)
        keys = {sha: name for name, (sha, _, revoked) in self.keys.items() if revoked is None}
        return answer(views.route_table(self.cluster, keys))

    async def _gateway_suspect(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        """A gateway found a replica stalled: an event for the operator, nothing torn down.

        The gateway's word alone changes no replica: the agent's liveness canary (every few
        seconds on rank 0, judged on the engine's token counters) decides whether it is hung.
        Reports on one replica are one event per :data:`SUSPECT_EVENT_WINDOW` seconds, with a count.
        """
        report = from_json(request.json(), SuspectReport)
        record = self.cluster.replicas.get(report.replica)
        state = record.state if record is not None else "unknown"
        now = self.clock()
        seen = self._suspects.get(report.replica)
        if seen is not None and now - seen[0] < SUSPECT_EVENT_WINDOW:
            seen[1] += 1
            return answer(SuspectRecorded(report.replica, state), 202)
        folded = f" ({seen[1]} more reports since the last event)" if seen is not None and seen[1] else ""
        if len(self._suspects) >= 10_000:
            self._suspects.clear()
        self._suspects[report.replica] = [now, 0]
        log.warning("gateway %s reports replica %s stalled: %s", identity.name, report.replica, report.reason)
        message = (
            f"gateway {identity.name} found it stalled: {report.reason}{folded}; "
            "the agent's liveness canary decides whether it is hung"
        )
        self.cluster.record_event(now, EventKind.GATEWAY, report.replica, message)
        if not self.read_only:
            async with self._lock:
                await self.reconciler.save()
        return answer(SuspectRecorded(report.replica, state), 202)

    # -- admin ---------------------------------------------------------------

    async def _get_nodes(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        revoked = self.revocations.is_revoked if self.revocations is not None else (lambda serial: False)
        return answer(views.node_list(self.cluster, self.clock(), revoked))

    async def _node_action(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        node_id, action = params["node"], params["action"]
        async with self._lock:
            self._known_node(node_id)
            self.cluster.set_cordon(node_id, action != "uncordon", self.clock(), drain=action == "drain")
            await self.commit()
        return answer(views.drain_status(self.cluster, node_id))

    async def _declare_lost(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        """``ctl nodes lost NODE``: the operator says the node is gone, whatever the server suspects."""
        node_id = params["node"]
        async with self._lock:
            self._known_node(node_id)
            self.cluster.fence_node(node_id, f"declared lost by {identity.name}", self.clock())
            await self.commit()
        return answer(views.drain_status(self.cluster, node_id))

    async def _get_drain(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        return answer(views.drain_status(self.cluster, self._known_node(params["node"])))

    def _known_node(self, node_id: str) -> str:
        """``node_id``, or a 404 that lists the nodes there are."""
        if node_id not in self.cluster.nodes:
            known = ", ".join(sorted(self.cluster.nodes)) or "none"
            raise Refused(404, f"no node {node_id!r} (nodes: {known})")
        return node_id

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

    # -- API keys ----------------------------------------------------------

    async def _list_keys(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        keys = tuple(
            ApiKey(name, created, revoked) for name, (_, created, revoked) in sorted(self.keys.items())
        )
        return answer(KeyList(keys))

    async def _create_key(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        name = from_json(request.json(), CreateKey).name
        if not _KEY_NAME.fullmatch(name):
            raise Refused(400, f"name: expected {KEY_NAME_RULE}, got {name!r}")
        secret = "llmgw-" + secrets.token_urlsafe(32)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        now = self.clock()
        async with self._lock:
            if name in self.keys:
                state = "revoked" if self.keys[name][2] is not None else "in use"
                raise Refused(409, f"an API key named {name!r} exists ({state}); choose another name")
            await self.store.write(lambda conn: add_api_key(conn, name, digest, now, identity.name))
            self.keys[name] = (digest, now, None)
            self._routes_changed()
        return answer(CreatedKey(name, secret), 201)

    async def _revoke_key(self, request: Request, identity: Identity, params: dict[str, str]) -> Response:
        name = params["name"]
        now = self.clock()
        async with self._lock:
            if name not in self.keys:
                known = ", ".join(sorted(self.keys)) or "none"
                raise Refused(404, f"no API key named {name!r} (keys: {known})")
            digest, created, revoked = self.keys[name]
            if revoked is None:
                await self.store.write(lambda conn: revoke_api_key(conn, name, now, identity.name))
                self.keys[name] = (digest, created, now)
                self._routes_changed()
        return answer(RevokedKey(name, self.keys[name][2]))

    def _routes_changed(self) -> None:
        self.cluster.routes_revision += 1
        self.reconciler.routes_changed()


#: seconds within which gateway reports on one replica are counted into one event
SUSPECT_EVENT_WINDOW = 60.0

#: what an API key name may be; ``ctl keys create --help`` says the same
KEY_NAME_RULE = "1-63 of a-z, 0-9, '.', '_', '-', starting with a letter or digit"
_KEY_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


def _decoded_path(raw: str) -> str:
    """``raw`` with each segment percent-decoded once, then re-escaped alike.

    Routes match the result, so ``/v1/admin/%6Beys`` is ``/v1/admin/keys`` and a
    segment holding ``%2F`` stays one segment; the handler gets each captured
    segment decoded (``unquote``), never decoded twice.
    """
    return "/".join(quote(unquote(part, errors="strict"), safe="") for part in raw.split("/"))
