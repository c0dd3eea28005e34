"""The cluster's state: every record the control plane keeps, and the verbs that alone change a replica.

:class:`ClusterState` holds what the server knows (the catalog, every node and
what its agent last observed, every replica, the manifests, the events not
stored yet) and what changed since it was last stored (the dirty sets). The
edges write their inputs through its input methods (``sync``, ``apply_catalog``, ...);
the controllers (:mod:`llmgw.server.controllers`) decide and change replicas only
through its verbs: ``start_attempt``, ``fail``, ``mark_ready``, ``retire``,
``take_back``, ``place`` and ``remove``. It does no I/O and reads no clock: callers pass ``now``.
The reconciler runs the controllers; what the state shows is in :mod:`llmgw.server.views`.
"""

from __future__ import annotations

import attrs

from llmgw.models import Catalog, NodeFacts
from llmgw.scheduler import Replica, Unplaced
from llmgw.server.state.adapters import AdapterBook
from llmgw.server.state.autoscale import ScaleBook, ScaleDecision, ScaleDirection, ScaleMemory
from llmgw.server.state.events import EventLog
from llmgw.server.state.gateways import GatewayBook
from llmgw.server.state.records import (
    DEFAULT_SETTINGS,
    Event,
    EventKind,
    Launch,
    NodeRecord,
    ReplicaRecord,
    ReplicaState,
    Settings,
)
from llmgw.server.state.rollouts import RolloutBook
from llmgw.server.state.silence import SilenceWatch
from llmgw.server.state.stopping import StopOrder
from llmgw.weights import Manifest, catalog_sources
from llmgw.wire import DesiredShard, GatewayActivity, ObservedShard, SyncRequest
from llmgw.wire.causes import FailureCause

__all__ = ["ClusterState", "KEEP", "where", "NodeRecord", "ReplicaRecord", "Settings", "Event"]

#: :meth:`ClusterState.start_attempt`'s ``reason`` when the replica's reason stays as it is
KEEP = object()


class ClusterState:
    """What the server knows; see the module docstring."""

    def __init__(self, settings: Settings = DEFAULT_SETTINGS, *, revision: int = 1) -> None:
        self.settings = settings
        self.catalog = Catalog()
        self.catalog_text = ""
        self.catalog_revision = 0
        self.catalog_applied_at = 0.0
        #: the admin certificate's name that applied the catalog in force (stored with its revision)
        self.catalog_author = ""
        self.nodes: dict[str, NodeRecord] = {}
        self.replicas: dict[str, ReplicaRecord] = {}
        self.unplaced: tuple[Unplaced, ...] = ()
        #: moves with every change of what some node should run
        self.revision = revision
        #: moves with every change of which replicas are ready (the gateway's routes), or of the keys
        self.routes_revision = 1
        #: moves with every change of which replicas are ready; stored (``RouteTable.generation``)
        self.routes_generation = 0
        self.event_log = EventLog()
        self.dirty_nodes: set[str] = set()
        self.dirty_replicas: set[str] = set()
        self.dirty_catalog = False
        #: node id -> the shards it should run, as last built (:func:`llmgw.server.views.cluster.desired`)
        self.desired_cache: dict[str, tuple[DesiredShard, ...]] | None = None
        #: replica id -> (what its shards were built from, the shards): reused while that is unchanged
        self.shards_memo: dict[str, tuple[tuple, list]] = {}
        #: retired replicas lingering until gateways let go; workers held until their rank 0 is gone
        self.stopping, self.gateways = StopOrder(), GatewayBook()
        #: every model's rollout of outdated replicas
        self.rollouts = RolloutBook()
        #: the next attempt number; persisted so a restart never reuses one
        self.next_attempt = 1
        #: whether something the scheduler reads changed since its last run
        self.schedule_wanted = True
        #: moves whenever what ``ctl replicas`` shows may have changed (its answer is cached per version)
        self.view_version = 0
        #: node id -> the revision at which what it should run last changed
        self.node_revisions: dict[str, int] = {}
        #: the revision at which the sources agents must check last changed (wakes every node)
        self.sources_revision = revision
        #: the settings rows as last stored (only changed ones are written)
        self.saved_settings: dict[str, object] = {}
        #: the mass-silence episode under way, if any (the nodes controller's memory)
        self.silence = SilenceWatch()
        #: the stored manifest of every distributable source (its size is what a copy takes on disk)
        self.manifests: dict[str, Manifest] = {}
        #: when the scheduler last ran (replicas without a place are tried again every ``unplaced_retry``)
        self.scheduled_at = 0.0
        self._wanted_commands: tuple[Catalog, dict[str, tuple[object, ...]]] | None = None
        #: the autoscaler's memory of each autoscaled model, and the load agents send; the adapters' book
        self.autoscale, self.adapters = ScaleBook(), AdapterBook()

    def new_attempt(self) -> int:
        """A fresh attempt number."""
        attempt, self.next_attempt = self.next_attempt, self.next_attempt + 1
        return attempt

    # -- queries the controllers and the views share ---------------------------------------------

    @property
    def spared(self) -> frozenset[str]:
        """Silent nodes not declared lost: too many went silent at once (the nodes controller)."""
        return self.silence.spared

    def launch_of(self, record: ReplicaRecord) -> Launch | None:
        """What ``record``'s current attempt runs: its recorded launch, or (none recorded) the catalog's."""
        return record.launch if record.launch is not None else Launch.of(self.catalog, record.placement.model)

    def is_outdated(self, record: ReplicaRecord) -> bool:
        """Whether ``record`` runs another command than the catalog in force now asks for its model."""
        cache = self._wanted_commands
        if cache is None or cache[0] is not self.catalog:
            commands = {name: Launch.of(self.catalog, name) for name in self.catalog.models}
            cache = self._wanted_commands = (self.catalog, {k: v.command for k, v in commands.items() if v})
        wanted = cache[1].get(record.placement.model)
        launch = self.launch_of(record)
        return wanted is not None and launch is not None and launch.command != wanted

    def ready_timeout_of(self, record: ReplicaRecord) -> float:
        """Seconds ``record``'s rank 0 may take to be ready: its profile's, or the server's setting."""
        launch = self.launch_of(record)
        return (launch.profile.ready_timeout if launch is not None else None) or self.settings.ready_timeout

    def sources_to_check(self) -> tuple[str, ...]:
        """Every source in the catalog, models' and adapters', for agents to report on (and publish)."""
        return catalog_sources(self.catalog)

    def node_revision(self, node_id: str) -> int:
        """The revision at which what ``node_id`` should run (or check) last changed."""
        return max(self.node_revisions.get(node_id, 0), self.sources_revision)

    def ready_ids(self) -> frozenset[str]:
        """The ids of the ready replicas (the routes)."""
        return frozenset(r.id for r in self.replicas.values() if r.state == ReplicaState.READY)

    # -- inputs from the edges -------------------------------------------------------------------

    def apply_catalog(self, catalog: Catalog, text: str, now: float, author: str = "") -> None:
        """Make ``catalog`` the desired state (already validated); ``author`` applied it."""
        self.catalog = catalog
        self.autoscale.forget(catalog)
        self.catalog_text = text
        self.catalog_author = author
        self.catalog_revision += 1
        self.catalog_applied_at = now
        self.dirty_catalog = True
        self.schedule_wanted = True
        # wake every long-poll: agents must learn the new sources to check
        self.revision += 1
        self.sources_revision = self.revision
        by = f" by {author}" if author else ""
        self.record_event(now, EventKind.CATALOG, f"revision {self.catalog_revision}", f"catalog applied{by}")

    def sync(self, request: SyncRequest, now: float) -> bool:
        """Record what a node's agent reported: facts, observed shards, revision.

        Called for every agent sync; costs O(the node's own shards) and
        schedules nothing.

        :returns: whether the reconciler should look at the cluster again (the
            node is new or back, what the scheduler reads of it changed, or a
            shard of it changed state); False for a plain heartbeat.
        """
        node = self.nodes.get(request.node_id)
        wanted = False
        if node is None:
            node = NodeRecord(
                node_id=request.node_id,
                address=request.address,
                facts=request.facts,
                port_range=request.port_range,
                first_seen=now,
                last_seen=now,
            )
            self.nodes[node.node_id] = node
            self.dirty_nodes.add(node.node_id)
            self.schedule_wanted = wanted = True
            self.record_event(now, EventKind.NODE, node.node_id, f"registered from {request.address}")
        elif node.lost:
            self.record_event(now, EventKind.NODE, node.node_id, "is back after being lost")
        if (message := node.note_agent(request, now)) is not None:
            self.record_event(now, EventKind.NODE, node.node_id, message)
            wanted = True
        if (node.address, node.facts, node.port_range) != (
            request.address,
            request.facts,
            request.port_range,
        ):
            self.dirty_nodes.add(node.node_id)
            if (node.address, node.port_range, _placement_facts(node.facts)) != (
                request.address,
                request.port_range,
                _placement_facts(request.facts),
            ):
                self.schedule_wanted = wanted = True
        node.address = request.address
        node.facts = request.facts
        node.port_range = request.port_range
        node.last_seen = now
        if node.lost:
            node.lost = False
            self.dirty_nodes.add(node.node_id)
            self.schedule_wanted = wanted = True
        checked = frozenset(request.checked_sources)
        if checked != node.checked_sources:
            node.checked_sources = checked
            wanted = True
        observed = {shard.key: shard for shard in request.observed}
        if not node.reported or _states(observed) != _states(node.observed):
            wanted = True
        if observed != node.observed:
            self.view_version += 1
        node.agent_revision = request.revision
        node.observed = observed
        self.autoscale.record_loads(request.load, now)
        node.reported = True
        return wanted

    def note_manifest(self, manifest: Manifest) -> None:
        """The first manifest of a source was stored: placing now knows how much disk a copy takes."""
        self.manifests[manifest.source] = manifest
        self.schedule_wanted = True

    def record_certificate(self, node_id: str, serial: int, not_after: float) -> None:
        """Remember the certificate a node synced with: ctl nodes warns when it expires or is revoked."""
        node = self.nodes[node_id]
        if (node.cert_serial, node.cert_not_after) != (serial, not_after):
            node.cert_serial, node.cert_not_after = serial, not_after
            self.dirty_nodes.add(node_id)

    def set_cordon(self, node_id: str, cordoned: bool, now: float, *, drain: bool = False) -> None:
        """Cordon (no new replicas), uncordon, or start draining a node."""
        node = self.nodes[node_id]
        node.cordoned = cordoned or drain
        node.draining = drain or (node.draining and cordoned)
        self.dirty_nodes.add(node_id)
        self.schedule_wanted = True
        action = "drain started" if drain else ("cordoned" if cordoned else "uncordoned")
        self.record_event(now, EventKind.NODE, node_id, action)

    # -- the nodes' verbs ------------------------------------------------------------------------

    def fence_node(self, node_id: str, reason: str, now: float) -> bool:
        """Declare ``node_id`` lost at once, whatever its last sync: its certificate was revoked or expired.

        Called by the server when the revocation list names the node's
        certificate or refuses its sync, and by the nodes controller when a
        recorded certificate expired; the next reconcile moves its replicas
        elsewhere (out of the routes meanwhile), as for any lost node. It stays
        lost until a sync is accepted again.

        :returns: whether anything changed (False: unknown node, or already lost).
        """
        node = self.nodes.get(node_id)
        if node is None or node.lost:
            return False
        self.declare_lost(node_id, now, f"lost at once: {reason}; its replicas are rebuilt elsewhere")
        return True

    def declare_lost(self, node_id: str, now: float, message: str) -> None:
        """Mark ``node_id`` lost (its replicas are placed elsewhere at the next schedule) and say why."""
        self.nodes[node_id].lost = True
        self.schedule_wanted = True
        self.dirty_nodes.add(node_id)
        self.record_event(now, EventKind.NODE, node_id, message)

    def forget_progress(self, node_id: str, why: str) -> None:
        """Drop the staging progress a lost or silent node last reported (its rate and ETA went stale)."""
        self.view_version += self.nodes[node_id].forget_progress(why)

    def end_drain(self, node_id: str, now: float) -> None:
        """A draining node has no replica left: the drain is over (the node stays cordoned)."""
        self.nodes[node_id].draining = False
        self.dirty_nodes.add(node_id)
        self.record_event(now, EventKind.NODE, node_id, "drained: no replica left; still cordoned")

    # -- the replicas' verbs: the only code that changes a replica --------------------------------

    def place(self, placement: Replica, launch: Launch | None, now: float, what: str) -> ReplicaRecord:
        """Record a replica the scheduler placed anew (``what``: ``placed``, ``replacement for ...``)."""
        record = ReplicaRecord(placement, self.new_attempt(), started_at=now, launch=launch)
        self.replicas[placement.id] = record
        self.dirty_replicas.add(placement.id)
        self.record_event(now, EventKind.REPLICA, placement.id, f"{what} on {where(placement)}")
        return record

    def start_attempt(
        self,
        record: ReplicaRecord,
        now: float,
        event: str | None,
        *,
        placement: Replica | None = None,
        launch: Launch | None = None,
        renumber: bool = True,
        reason: str | None | object = KEEP,
        back: bool = False,
        forget_failure: bool = False,
    ) -> None:
        """Start ``record`` (again) as a new attempt: its shards are handed out anew at the next revision.

        Called when a failed replica's backoff has passed (``renumber`` False:
        the failure gave it its new number), when the scheduler placed it
        again (``placement``), when its agent restarted, and when a rollout
        restarts it on a new command (``launch``; a replica in backoff then
        only changes what it will rebuild on; ``back``: a paused rollout puts it
        back on what it ran before). ``reason`` replaces the one ``ctl
        replicas`` shows unless :data:`KEEP`; ``forget_failure``: the agent's
        going ended the attempt, not the replica. ``event`` is recorded for
        ``ctl events`` unless None.
        """
        if placement is not None:
            record.placement = placement
        if launch is not None:
            if back:
                record.rolled_from = None
            elif record.launch is not None and record.launch != launch:
                record.rolled_from = record.launch
            record.launch = launch
            record.consecutive_failures = 0
        if launch is None or record.state != ReplicaState.BACKOFF:
            if renumber:
                record.attempt = self.new_attempt()
            record.state = ReplicaState.STARTING
            record.started_at = now
            record.sent_revision = 0
            record.ready_since = None
        if reason is not KEEP:
            record.reason = reason  # type: ignore[assignment]
        if forget_failure:
            record.failed_at = None
        self.dirty_replicas.add(record.id)
        if event is not None:
            self.record_event(now, EventKind.REPLICA, record.id, event)

    def fail(self, record: ReplicaRecord, now: float, cause: FailureCause, reason: str) -> None:
        """``record``'s attempt failed for ``cause`` (``reason`` for people): tear it down, rebuild after a
        backoff that doubles with each failure in a row. Called by the health controller."""
        record.failures, record.consecutive_failures, record.failed_at = (
            record.failures + 1,
            record.consecutive_failures + 1,
            now,
        )
        record.attempt = self.new_attempt()
        delay = min(
            self.settings.backoff_max, self.settings.backoff_base * 2 ** (record.consecutive_failures - 1)
        )
        record.state = ReplicaState.BACKOFF
        record.not_before = now + delay
        record.ready_since = None
        record.reason = reason
        record.cause = cause
        self.dirty_replicas.add(record.id)
        teardown = f"tearing down every shard, rebuild in {delay:.1f} s (failure {record.failures})"
        message = f"failed: {reason}; {teardown}"
        self.event_log.record(Event(now, EventKind.REPLICA, record.id, message, cause))

    def take_back(self, record: ReplicaRecord) -> None:
        """Uncount ``record``'s last failure: its agent's going caused it, not the replica."""
        record.failures = max(0, record.failures - 1)
        record.consecutive_failures = max(0, record.consecutive_failures - 1)
        self.dirty_replicas.add(record.id)

    def mark_ready(self, record: ReplicaRecord, now: float) -> None:
        """Every shard of ``record`` runs and rank 0 passes its health check: it serves."""
        record.state = ReplicaState.READY
        record.ready_since = now
        record.reason = None
        record.cause = None
        self.dirty_replicas.add(record.id)
        self.record_event(
            now, EventKind.REPLICA, record.id, f"ready on {', '.join(record.placement.node_ids)}"
        )

    def note_staging(self, record: ReplicaRecord, now: float) -> None:
        """``record``'s shards still copy their weights: its ready timeout counts from the copy's end."""
        record.started_at = now

    def mark_stable(self, record: ReplicaRecord) -> None:
        """``record`` has been ready for ``stable_after``: its failures in a row are forgiven."""
        if record.consecutive_failures:
            record.consecutive_failures = 0
            self.dirty_replicas.add(record.id)

    def retire(self, original: str, replacement: ReplicaRecord, now: float, message: str) -> None:
        """``replacement`` is ready: stop the replica it replaces (a drain's move, a rollout's surge)."""
        self.stopping.left(original, self.replicas.pop(original).attempt)
        self.autoscale.loads.pop(original, None)
        self.dirty_replicas.add(original)
        replacement.placement = attrs.evolve(replacement.placement, replaces=None)
        self.dirty_replicas.add(replacement.id)
        self.schedule_wanted = True
        self.record_event(now, EventKind.REPLICA, original, message)

    def remove(self, replica_id: str, now: float, message: str | None) -> None:
        """Stop ``replica_id`` for good (a scale-down, a model removed, a paused rollout's replacement)."""
        self.stopping.left(replica_id, self.replicas.pop(replica_id).attempt)
        self.autoscale.loads.pop(replica_id, None)
        self.dirty_replicas.add(replica_id)
        if message is not None:
            self.record_event(now, EventKind.REPLICA, replica_id, message)

    def note_unplaced(self, unplaced: tuple[Unplaced, ...], now: float) -> None:
        """Record what the scheduler could not place; one event per model and reason newly unplaced."""
        new = [item for item in unplaced if item not in self.unplaced]
        self.unplaced = unplaced
        groups: dict[tuple[str, str], list[Unplaced]] = {}
        for item in new:
            groups.setdefault((item.model, item.reason), []).append(item)
        for (model, reason), items in groups.items():
            if len(items) == 1:
                self.record_event(now, EventKind.REPLICA, items[0].id, f"cannot be placed: {reason}")
            else:
                first, last = items[0].id, items[-1].id
                message = f"{len(items)} replicas ({first} … {last}) cannot be placed: {reason}"
                self.record_event(now, EventKind.MODEL, model, message)

    def scale(self, decision: ScaleDecision, memory: ScaleMemory, now: float) -> None:
        """Keep the autoscaler's ``decision`` for a model; a change is scheduled and is an event."""
        if self.autoscale.keep(decision, memory):
            self.record_event(now, EventKind.AUTOSCALE, decision.model, decision.describe())
        self.schedule_wanted = self.schedule_wanted or decision.direction != ScaleDirection.HOLD

    def note_activity(self, activity: GatewayActivity, now: float) -> bool:
        """Keep what a gateway saw of the models whose ``min`` is 0 (``POST /v1/gateway/activity``).

        :returns: whether one of them, at zero replicas, is held at the gateway (decide now).
        """
        return self.autoscale.record_activity(activity, self.catalog, now)

    def scaled_catalog(self) -> Catalog:
        """The catalog with each autoscaled model's replicas at the autoscaler's count: what to schedule."""
        return self.autoscale.scaled(self.catalog, (r.placement for r in self.replicas.values()))

    # -- the scheduler's marks -------------------------------------------------------------------

    def want_schedule(self) -> None:
        """Something the scheduler reads changed: the next pass schedules."""
        self.schedule_wanted = True

    def note_scheduled(self, now: float) -> None:
        """A schedule is made now from the state as it is (the pass runs it)."""
        self.schedule_wanted = False
        self.scheduled_at = now

    def publish(self, changed: frozenset[str]) -> None:
        """What ``changed`` nodes should run moved: a new revision, and the new attempts learn theirs."""
        self.revision += 1
        for node_id in changed:
            self.node_revisions[node_id] = self.revision
        for record in self.replicas.values():
            if record.sent_revision == 0:
                record.sent_revision = self.revision
                self.dirty_replicas.add(record.id)

    # -- events ----------------------------------------------------------------------------------

    def take_events(self) -> list[Event]:
        """The events recorded since the last call (for the server to persist)."""
        return self.event_log.take()

    def record_event(self, now: float, kind: str, subject: str, message: str) -> None:
        """Add an event for ``ctl events``; it is stored at the next flush (see :class:`EventLog`)."""
        self.event_log.record(Event(now, kind, subject, message))


def where(placement: Replica) -> str:
    """Where ``placement``'s shards run, for events: node, rank, GPUs, port."""
    return ", ".join(
        f"{s.node_id} (r{s.rank}, GPUs {','.join(map(str, s.gpus)) or '-'}, port {s.port})"
        for s in placement.shards
    )


def _placement_facts(facts: NodeFacts) -> tuple[object, ...]:
    """What the scheduler reads of a node's facts: not the GPUs' free memory, which moves all the time."""
    gpus = tuple((g.index, g.uuid, g.memory_total_mib) for g in facts.gpus)
    return (gpus, facts.fabrics, facts.engines, facts.model_sources, facts.problems)


def _states(observed: dict[str, ObservedShard]) -> dict[str, tuple[object, ...]]:
    return {key: (shard.state, shard.exit_code, shard.detail) for key, shard in observed.items()}
