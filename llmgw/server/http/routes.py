"""The gateways' side: the routes feed (long-polled), their reports (stalled replicas, activity, the
routes they hold), and the leases of their limited keys' rates with the usage counted against budgets.

Mixed into :class:`llmgw.server.http.api.ServerApp`, which routes ``GET /v1/routes``,
``POST /v1/gateway/suspect``, ``/v1/gateway/activity``, ``/v1/gateway/routes-held`` and
``/v1/gateway/allowances`` to it (admin or gateway certificates).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import attrs
import trio

from llmgw.engine import Engine
from llmgw.net.server import Request, Response
from llmgw.pki import Identity
from llmgw.server.http.keys import active_keys
from llmgw.server.http.replies import answer, query_int
from llmgw.server.persist.cluster import add_key_usage, key_usage_days
from llmgw.server.persist.sqlite import Store
from llmgw.server.reconciler import Reconciler
from llmgw.server.state.allowances import Lender
from llmgw.server.state.budgets import FLUSH_INTERVAL, Budgets
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import EventKind, KeyRecord
from llmgw.server.views import cluster as views
from llmgw.wire import (
    AllowanceRequest,
    GatewayActivity,
    RoutesHeld,
    SuspectRecorded,
    SuspectReport,
    from_json,
)

__all__ = ["SUSPECT_EVENT_WINDOW", "RoutesEndpoints"]

log = logging.getLogger("llmgw.server")

#: seconds within which gateway reports on one replica are counted into one event
SUSPECT_EVENT_WINDOW = 60.0


class RoutesEndpoints:
    """Handlers for ``/v1/routes`` and ``/v1/gateway/*``; each returns the JSON answer."""

    cluster: ClusterState
    clock: Callable[[], float]
    reconciler: Reconciler
    read_only: bool
    _lock: trio.Lock
    poll_timeout: float
    #: API key name -> its record (hash of the secret, dates, limits)
    keys: dict[str, KeyRecord]
    #: replica id -> (when a gateway report on it was last recorded, reports folded since)
    _suspects: dict[str, list]
    #: the fleet's buckets of the rate-limited keys
    lender: Lender
    #: engine name -> engine (which replicas continue a final assistant message)
    engines: Mapping[str, Engine]
    #: the keys' usage this month and the reports not stored yet, behind their lock
    budgets: Budgets
    _usage_lock: trio.Lock
    store: Store

    async def _get_routes(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        known = query_int(request.query.get("revision", "0"), "revision")
        if request.query.get("wait") == "1":
            await self.reconciler.wait_routes(known, self.poll_timeout)
        keys, limits = active_keys(self.keys)
        table = views.route_table(self.cluster, keys, limits, self.engines)
        return answer(attrs.evolve(table, poll_timeout=self.poll_timeout))

    async def _gateway_allowances(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        """A gateway process's demand per limited key and its keys' usage: what the fleet's buckets and seats
        lend it, and the keys spent (leader only). The usage is counted at once and stored every
        :data:`~llmgw.server.state.budgets.FLUSH_INTERVAL` seconds. Seats are held under the certificate's
        name and the process's own, so a gateway cannot speak for another's."""
        asked = from_json(request.json(), AllowanceRequest)
        limits = active_keys(self.keys)[1]
        now = self.clock()
        async with self._usage_lock:
            await self._load_budgets(now)
            self.budgets.add(asked.usage, now)
            if now - self.budgets.flushed >= FLUSH_INTERVAL:
                await self.flush_usage(now)
        holder = f"{identity.name}/{asked.gateway}"
        reply = self.lender.lend(limits, asked, self.clock(), holder)
        return answer(attrs.evolve(reply, spent=self.budgets.spent(limits, now)))

    async def _load_budgets(self, now: float) -> None:
        """Read this month's usage from the store when this server has not yet (it just began to lead, or
        the month turned). Called with the usage lock held."""
        month = self.budgets.stale(now)
        if month is not None:
            self.budgets.load(month, await self.store.run(lambda conn: key_usage_days(conn, month)))

    async def flush_usage(self, now: float) -> None:
        """Write the usage reported since the last write to the store (nothing when there is none). Called
        with the usage lock held; a failed write keeps the rows for the next one."""
        rows = self.budgets.pending(now)
        if not rows:
            return
        try:
            await self.store.write(lambda conn: add_key_usage(conn, rows))
        except BaseException:
            self.budgets.restore(rows)
            raise

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

    async def _gateway_activity(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        """A gateway process says when each model last had a request and how many it holds.

        Kept in memory for the autoscaler (models whose ``min`` is 0 go to zero when idle and wake on a
        request); a request held for a model at zero replicas has the autoscaler decide at once.
        Answers 202 with the report.
        """
        activity = from_json(request.json(), GatewayActivity)
        if self.read_only:
            return answer(activity, 202)
        if self.cluster.note_activity(activity, self.clock()):
            log.info("gateway %s holds requests for a model at zero replicas: waking it", identity.name)
            self.reconciler.request()
        if activity.adapters:
            catalog = self.cluster.catalog
            model_of = {catalog.served_name(name): name for name in catalog.models}
            if self.cluster.adapters.note_activity(model_of, activity.adapters, self.clock()):
                self.reconciler.request()  # a request waits for an adapter no replica has: load it now
        return answer(activity, 202)

    async def _gateway_routes_held(self, request: Request, identity: Identity, _: dict[str, str]) -> Response:
        """A gateway process says which routes generation it routes by (leader only; a standby ignores it).

        Kept in memory (:class:`~llmgw.server.state.gateways.GatewayBook`) under the certificate's name
        and the process's token, so a gateway cannot speak for another. When a retired replica lingers
        for gateways, a run is asked for at once: this report may be the last one it waited for.
        Answers 202 with the report.
        """
        held = from_json(request.json(), RoutesHeld)
        if self.read_only:
            return answer(held, 202)
        self.cluster.gateways.note(f"{identity.name}/{held.process}", held.generation, self.clock())
        if self.cluster.stopping.lingering:
            self.reconciler.request()
        return answer(held, 202)
