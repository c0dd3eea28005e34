"""The reconciler: the controllers run in a fixed order, what changed is persisted, who waits is woken.

One pass is :func:`begin` (the nodes controller, the health controller on
every replica, the autoscaler, drains, rollouts, then the placement plan), the schedule, and
:func:`finish` (the placement applied, the stopping order, the revisions that
wake long-polls). The controllers decide on the state and change it only
through its verbs (:class:`~llmgw.server.state.cluster.ClusterState`); none
imports another: what one needs of another (a rollout's launch for a new
placement) is passed in here.

Syncs only record what agents report (:meth:`ClusterState.sync`); when that
matters, they :meth:`Reconciler.request` a run. Requests are coalesced (many
changes, one run), and the loop also runs on a timer (lost nodes, backoff,
timeouts). A run judges replicas on the event loop (cheap), computes a
schedule, when one is needed, in a worker thread (the admin API, the routes
feed and syncs keep answering meanwhile), applies it, writes what changed
to the store, and wakes only the long-polls whose answer changed: a node's
sync when its own shards changed, the routes feed when the routes did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from llmgw.scheduler import ScheduleResult
from llmgw.server.controllers import adapters, autoscaler, placement, stopping
from llmgw.server.controllers.health.judge import judge
from llmgw.server.controllers.nodes.drain import drain_moves
from llmgw.server.controllers.nodes.lost import detect_lost
from llmgw.server.controllers.rollout.rollouts import launch_for
from llmgw.server.controllers.rollout.rollouts import step as step_rollouts
from llmgw.server.persist.cluster import restore_changes, take_changes, write_changes
from llmgw.server.persist.sqlite import Store
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import EventKind
from llmgw.server.views.cluster import desired
from llmgw.wire import AdapterState, DesiredShard

__all__ = ["Reconciler", "begin", "finish", "reconcile"]

log = logging.getLogger("llmgw.server")

#: the state's desired shards and ready replicas as :func:`begin` found them, for :func:`finish`
_Before = tuple[dict[str, tuple[DesiredShard, ...]], frozenset[str]]


def reconcile(state: ClusterState, now: float) -> bool:
    """Move the cluster one step toward the catalog: :func:`begin`, the schedule, :func:`finish`.

    The server runs the three steps itself (the schedule off the event
    loop); tests and tools call this.

    :returns: whether what some node should run changed (the revision moved).
    """
    plan, before = begin(state, now)
    return bool(finish(state, now, before, plan.run() if plan is not None else None))


def begin(state: ClusterState, now: float) -> tuple[placement.SchedulePlan | None, _Before]:
    """The first half of a pass: the controllers in their order; say whether to schedule.

    Declares lost nodes, judges each replica's current attempt (ready,
    failed, rebuilt after backoff), advances drains and rollouts. Costs
    O(nodes + replicas); never schedules.

    :returns: the schedule to run before :func:`finish` (None when nothing the
        scheduler reads changed, or placing waits for agents to check the
        catalog's sources), and what :func:`finish` compares with.
    """
    before = (desired(state), state.ready_ids())
    detect_lost(state, now)
    for record in list(state.replicas.values()):
        judge(state, record, now)
    if _waiting_for_sources(state, now):
        return None, before
    autoscaler.step(state, now)
    moves = drain_moves(state, now)
    rolls = step_rollouts(state, now)
    return placement.plan(state, now, moves, rolls), before


def finish(
    state: ClusterState, now: float, before: _Before, result: ScheduleResult | None = None
) -> frozenset[str]:
    """The second half of a pass: apply the schedule's ``result`` (if any), order the stops, publish.

    Moves the revision when what some node should run changed, and the
    routes revision and generation when the set of ready replicas changed.

    :returns: the ids of the nodes whose shards changed (their long-polls wake).
    """
    if result is not None:
        placement.apply(state, now, result, launch_for)
    if result is not None or state.dirty_replicas or state.dirty_nodes or state.dirty_catalog:
        state.view_version += 1
    shards_before, ready_before = before
    if state.ready_ids() != ready_before:
        state.routes_revision += 1
        state.routes_generation += 1
    order, events = state.stopping, state.event_log
    generation, bound = state.routes_generation, state.settings.linger_max
    lingering = stopping.linger(shards_before, ready_before, order.take_retired(), generation, now, bound)
    for attempt, record in lingering.items():
        order.linger(attempt, record)
    for attempt, why in stopping.let_go(order, state.gateways, state.nodes, now):
        order.let_go(attempt, why, now, events)
    for attempt, workers in stopping.hold(shards_before, state.replicas, order, state.revision, now).items():
        order.hold(attempt, workers)
    for attempt, why in stopping.release(order, state.nodes, now):
        order.release(attempt, why, now, events)
    state.desired_cache = None
    after = desired(state)
    changed = (
        frozenset(
            node_id
            for node_id in shards_before.keys() | after.keys()
            if shards_before.get(node_id, ()) != after.get(node_id, ())
        )
        | state.rollouts.take_stage_changed()
        | apply_adapters(state, adapters.step(state, now), now)
    )
    if changed:
        state.publish(changed)
    return changed


def apply_adapters(state: ClusterState, intents: list[adapters.Intent], now: float) -> frozenset[str]:
    """Apply the adapter controller's ``intents``: the book changes, events are recorded, the replicas
    whose adapters changed are marked for the store (their rows hold them: a standby routes them, a new
    leader keeps them), the routes revision moves when what the feed says of adapters changed. Called by
    :func:`finish` every pass.

    :returns: the nodes whose agents should hear at once (a replica's rank 0 has adapters to load or unload).
    """
    book = state.adapters
    nodes: set[str] = set()
    routes = False

    def rank0(replica: str) -> None:
        record = state.replicas.get(replica)
        if record is not None:
            nodes.add(record.placement.rank0.node_id)

    for intent in intents:
        if not isinstance(intent, adapters.Satisfied) and intent.replica in state.replicas:
            # what a replica should keep and has loaded is stored with its row (persist/adapters.py)
            state.dirty_replicas.add(intent.replica)
        if isinstance(intent, adapters.Forget):
            routes = routes or bool(book.routed.get(intent.replica))
            book.forget(intent.replica)
        elif isinstance(intent, adapters.Adopt):
            book.adopt(intent.replica, intent.attempt, intent.adapters, intent.loaded)
            if intent.adapters:
                routes = routes or bool(intent.loaded)
                rank0(intent.replica)
            for name in sorted(intent.adapters):  # a new leader keeps what its agent holds
                message = f"kept on replica {intent.replica}: its agent holds it (adopted)"
                state.record_event(now, EventKind.ADAPTER_LOADED, f"{intent.model}/{name}", message)
        elif isinstance(intent, adapters.Ended):
            seen = intent.observed
            if not book.ended(intent.replica, seen, intent.model, now):
                continue
            took = f" in {seen.seconds:.2f} s" if seen.seconds is not None else ""
            if seen.state == AdapterState.FAILED:
                routes = True
                rank0(intent.replica)
                cause = seen.cause.value if seen.cause is not None else "unknown"
                why = f"{cause}: {seen.detail}" if seen.detail else cause
                message = f"load on replica {intent.replica} failed{took} ({why})"
                state.record_event(now, EventKind.ADAPTER_FAILED, f"{intent.model}/{seen.name}", message)
            book.finished.append((intent.model, seen))
        elif isinstance(intent, adapters.Routed):
            routes = True
            book.route(intent.replica, intent.loaded)
            for name in sorted(intent.added):
                seen = book.observed.get(intent.replica, {}).get(name)
                took = f" in {seen.seconds:.2f} s" if seen is not None and seen.seconds is not None else ""
                message = f"loaded on replica {intent.replica}{took}"
                if intent.at_start:  # its engine started with it: a load, with no time of its own
                    book.use(intent.model, name).loads += 1
                    message = f"loaded at start on replica {intent.replica}"
                state.record_event(now, EventKind.ADAPTER_LOADED, f"{intent.model}/{name}", message)
            for name in sorted(intent.removed):
                book.counted.discard((intent.replica, state.replicas[intent.replica].attempt, name))
                message = f"unloaded from replica {intent.replica}"
                state.record_event(now, EventKind.ADAPTER_UNLOADED, f"{intent.model}/{name}", message)
        elif isinstance(intent, adapters.Load):
            if intent.evict is not None:  # out of the routes in this pass, before its agent unloads it
                book.unload(intent.replica, intent.evict)
                book.route(intent.replica, book.routed.get(intent.replica, frozenset()) - {intent.evict})
                routes = True
                message = f"unloaded from replica {intent.replica} for {intent.adapter} (least recently used)"
                state.record_event(now, EventKind.ADAPTER_UNLOADED, f"{intent.model}/{intent.evict}", message)
            book.load(intent.replica, intent.attempt, intent.model, intent.adapter, intent.source, now)
            rank0(intent.replica)
        else:
            book.wanted.pop((intent.model, intent.adapter), None)
    book.expire_wants(now)
    if routes:
        state.routes_revision += 1
    return frozenset(nodes)


def _waiting_for_sources(state: ClusterState, now: float) -> bool:
    """Whether placing should wait: a live node has not yet checked the catalog's sources."""
    if now - state.catalog_applied_at >= state.settings.source_wait:
        return False
    sources = set(state.sources_to_check())
    return any(
        not node.lost and node.reported and not sources <= node.checked_sources
        for node in state.nodes.values()
    )


#: seconds a sync waits for the store write in flight before it is answered 503
WRITTEN_LIMIT = 5.0


class Reconciler:
    """Runs the reconcile passes for the server; see the module docstring."""

    def __init__(
        self,
        cluster: ClusterState,
        store: Store,
        *,
        clock: Callable[[], float] = time.time,
        min_gap: float = 0.05,
    ) -> None:
        self.cluster = cluster
        self.store = store
        self.clock = clock
        #: the shortest time between two runs asked for by requests (they coalesce meanwhile)
        self.min_gap = min_gap
        #: held by whoever changes the cluster's desired state and reconciles it (admin actions, runs)
        self.lock = trio.Lock()
        self._wanted = trio.Event()
        self._node_waiters: dict[str, trio.Event] = {}
        self._routes_waiter = trio.Event()
        # what the long-polls were last woken for
        self._sources_seen = cluster.sources_revision
        self._routes_seen = cluster.routes_revision
        #: how many runs finished
        self.runs = 0
        #: the server's metrics (:class:`llmgw.server.metrics.ServerMetrics`), if any
        self.metrics: Any = None
        #: set when the store write in flight ends (None: no write in flight)
        self._writing: trio.Event | None = None
        #: why the last store write failed (None: it landed); decisions it held are not stored yet
        self.write_failed: str | None = None

    def request(self) -> None:
        """Ask for a run soon (coalesced with every other request until it starts)."""
        self._wanted.set()

    async def reconcile(self) -> None:
        """Run once now: judge, schedule (in a thread, when needed), persist, wake. Hold :attr:`lock`.

        Shielded: a client that drops its request must not leave the cluster
        reconciled in memory but not stored.
        """
        with trio.CancelScope(shield=True):
            began = time.perf_counter()
            now = self.clock()
            plan, before = begin(self.cluster, now)
            result = None
            if plan is not None:
                started = time.perf_counter()
                result = await trio.to_thread.run_sync(plan.run)
                log.debug(
                    "scheduled %d nodes, %d replicas in %.1f ms",
                    len(plan.nodes),
                    len(plan.placements),
                    (time.perf_counter() - started) * 1000,
                )
            changed = finish(self.cluster, now, before, result)
            ended, self.cluster.adapters.finished = self.cluster.adapters.finished, []
            if self.metrics is not None and ended:
                self.metrics.adapters_ended(ended)
            # Routes name what agents reported ready (observations, not decisions): gateways may have
            # them before the store does, so a slow write does not keep them on a dead replica.
            if self.cluster.routes_revision != self._routes_seen:
                self.routes_changed()
            await self.save()
            if self.cluster.sources_revision != self._sources_seen:
                self._sources_seen = self.cluster.sources_revision
                self.wake_all_nodes()
            for node_id in changed:
                self._wake_node(node_id)
            self.runs += 1
            if self.metrics is not None:
                self.metrics.reconciled(time.perf_counter() - began)

    async def save(self) -> None:
        """Write what changed in the cluster to the store (nothing when nothing changed)."""
        changes = take_changes(self.cluster, self.clock())
        if not changes:
            return
        began = time.perf_counter()
        writing = self._writing = trio.Event()
        try:
            await self.store.write(lambda conn: write_changes(conn, changes))
        except BaseException as exc:
            restore_changes(self.cluster, changes)
            self.write_failed = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if self.metrics is not None and isinstance(exc, Exception):
                self.metrics.store_written(time.perf_counter() - began, exc)
            raise
        else:
            self.write_failed = None
        finally:
            writing.set()
            if self._writing is writing:
                self._writing = None
        if self.metrics is not None:
            self.metrics.store_written(time.perf_counter() - began)

    @property
    def write_in_flight(self) -> bool:
        """Whether a store write is under way (its decisions are not stored yet)."""
        return self._writing is not None

    async def written(self, limit: float = WRITTEN_LIMIT) -> str | None:
        """Wait (``limit`` seconds at most) until no store write is in flight; say whether all landed.

        Called before a sync is answered: an agent acts only on decisions the store holds, so a
        leader whose writes fail (its store down, or it was fenced by a newer leader) makes no
        agent start or stop anything the next leader would not know of.

        :returns: None when the last write landed; else why not (the caller answers 503).
        """
        with trio.move_on_after(limit):
            while self._writing is not None:
                await self._writing.wait()
            return self.write_failed
        return f"a write to the store took over {limit:g} s"

    async def run(
        self,
        interval: float = 1.0,
        *,
        on_tick: Callable[[], Awaitable[None]] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Reconcile when asked and every ``interval`` seconds; runs until cancelled.

        ``on_tick`` is awaited after each timed run, without the lock, (the server reloads its
        revocation list there). Calls ``task_status.started()`` after the
        first run.
        """
        async with self.lock:
            await self.reconcile()
        task_status.started()
        next_tick = trio.current_time() + interval
        while True:
            with trio.move_on_at(next_tick):
                await self._wanted.wait()
                await trio.sleep(self.min_gap)
            self._wanted = trio.Event()
            async with self.lock:
                await self.reconcile()
            if trio.current_time() >= next_tick:
                next_tick = trio.current_time() + interval
                if on_tick is not None:
                    await on_tick()

    # -- long-polls ----------------------------------------------------------

    async def wait_node(self, node_id: str, known: int, seconds: float) -> None:
        """Wait up to ``seconds`` until what ``node_id`` should run changed after revision ``known``."""
        cluster = self.cluster
        with trio.move_on_after(seconds):
            while known <= cluster.revision and cluster.node_revision(node_id) <= known:
                waiter = self._node_waiters.get(node_id)
                if waiter is None:
                    waiter = self._node_waiters[node_id] = trio.Event()
                await waiter.wait()

    async def wait_routes(self, known: int, seconds: float) -> None:
        """Wait up to ``seconds`` until the routes feed moved past revision ``known``."""
        with trio.move_on_after(seconds):
            while self.cluster.routes_revision == known:
                await self._routes_waiter.wait()

    def routes_changed(self) -> None:
        """Wake the routes feed's long-polls (after the routes or the API keys changed)."""
        self._routes_seen = self.cluster.routes_revision
        self._routes_waiter.set()
        self._routes_waiter = trio.Event()

    def _wake_node(self, node_id: str) -> None:
        waiter = self._node_waiters.pop(node_id, None)
        if waiter is not None:
            waiter.set()

    def wake_all_nodes(self) -> None:
        """Wake every node's long-poll (the sources to check changed)."""
        waiters, self._node_waiters = self._node_waiters, {}
        for waiter in waiters.values():
            waiter.set()
