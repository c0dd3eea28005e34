"""The control plane's view of the cluster, and the reconciler that moves it.

:class:`Cluster` holds what the server knows (the catalog, every node and
what its agent last observed, every replica) and decides, in
:meth:`Cluster.reconcile`, what each node should run. It does no I/O and
reads no clock: callers pass ``now``, so tests drive it step by step. The
server persists what changed (:attr:`Cluster.dirty`) and wakes long-polls
when :attr:`Cluster.revision` moves. What it shows (the shards each node
should run, the routes feed, the admin API's status views) is in
:mod:`llmgw.server.views`; the records it keeps are in :mod:`llmgw.server.records`.
"""

from __future__ import annotations

import attrs

from llmgw.models import Catalog
from llmgw.scheduler import Unplaced, schedule
from llmgw.server.records import DEFAULT_SETTINGS, Event, NodeRecord, ReplicaRecord, Settings
from llmgw.server.views import ClusterViews
from llmgw.wire import DesiredShard, ObservedShard, SyncRequest

__all__ = ["Cluster", "NodeRecord", "ReplicaRecord", "Settings", "Event"]


class Cluster(ClusterViews):
    """What the server knows and decides; see the module docstring."""

    def __init__(self, settings: Settings = DEFAULT_SETTINGS, *, revision: int = 1) -> None:
        self.settings = settings
        self.catalog = Catalog()
        self.catalog_text = ""
        self.catalog_revision = 0
        self.catalog_applied_at = 0.0
        self.nodes: dict[str, NodeRecord] = {}
        self.replicas: dict[str, ReplicaRecord] = {}
        self.unplaced: tuple[Unplaced, ...] = ()
        #: moves with every change of what some node should run
        self.revision = revision
        #: moves with every change of which replicas are ready (the gateway's routes)
        self.routes_revision = 1
        self.events: list[Event] = []
        self.dirty_nodes: set[str] = set()
        self.dirty_replicas: set[str] = set()
        self.dirty_catalog = False
        self._desired_cache: dict[str, tuple[DesiredShard, ...]] | None = None
        #: the next attempt number; persisted so a restart never reuses one
        self.next_attempt = 1
        #: silent nodes not declared lost: too many went silent at once (see :meth:`_detect_lost`)
        self.spared: frozenset[str] = frozenset()
        #: the nodes the events of the current episode named
        self._announced: frozenset[str] = frozenset()

    def new_attempt(self) -> int:
        """A fresh attempt number."""
        attempt, self.next_attempt = self.next_attempt, self.next_attempt + 1
        return attempt

    # -- inputs --------------------------------------------------------------

    def apply_catalog(self, catalog: Catalog, text: str, now: float) -> None:
        """Make ``catalog`` the desired state (already validated)."""
        self.catalog = catalog
        self.catalog_text = text
        self.catalog_revision += 1
        self.catalog_applied_at = now
        self.dirty_catalog = True
        # wake every long-poll: agents must learn the new sources to check
        self.revision += 1
        self.record_event(now, "catalog", f"revision {self.catalog_revision}", "catalog applied")

    def sync(self, request: SyncRequest, now: float) -> None:
        """Record what a node's agent reported: facts, observed shards, revision."""
        node = self.nodes.get(request.node_id)
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
            self.record_event(now, "node", node.node_id, f"registered from {request.address}")
        elif node.lost:
            self.record_event(now, "node", node.node_id, "is back after being lost")
        if (node.address, node.facts, node.port_range) != (
            request.address,
            request.facts,
            request.port_range,
        ):
            self.dirty_nodes.add(node.node_id)
        node.address = request.address
        node.facts = request.facts
        node.port_range = request.port_range
        node.last_seen = now
        if node.lost:
            node.lost = False
            self.dirty_nodes.add(node.node_id)
        node.agent_revision = request.revision
        node.observed = {shard.key: shard for shard in request.observed}
        node.checked_sources = frozenset(request.checked_sources)
        node.reported = True

    def record_certificate(self, node_id: str, serial: int, not_after: float) -> None:
        """Remember the certificate a node synced with: ctl nodes warns when it expires or is revoked."""
        node = self.nodes[node_id]
        if (node.cert_serial, node.cert_not_after) != (serial, not_after):
            node.cert_serial, node.cert_not_after = serial, not_after
            self.dirty_nodes.add(node_id)

    def fence_node(self, node_id: str, reason: str, now: float) -> bool:
        """Declare ``node_id`` lost at once, whatever its last sync: its certificate was revoked or expired.

        Called by the server when the revocation list names the node's
        certificate or refuses its sync; the next reconcile moves its replicas
        elsewhere (out of the routes meanwhile), as for any lost node. It stays
        lost until a sync is accepted again.

        :returns: whether anything changed (False: unknown node, or already lost).
        """
        node = self.nodes.get(node_id)
        if node is None or node.lost:
            return False
        node.lost = True
        self.dirty_nodes.add(node_id)
        self.record_event(now, "node", node_id, f"lost at once: {reason}; its replicas are rebuilt elsewhere")
        return True

    def set_cordon(self, node_id: str, cordoned: bool, now: float, *, drain: bool = False) -> None:
        """Cordon (no new replicas), uncordon, or start draining a node."""
        node = self.nodes[node_id]
        node.cordoned = cordoned or drain
        node.draining = drain or (node.draining and cordoned)
        self.dirty_nodes.add(node_id)
        action = "drain started" if drain else ("cordoned" if cordoned else "uncordoned")
        self.record_event(now, "node", node_id, action)

    # -- the reconciler ------------------------------------------------------

    def reconcile(self, now: float) -> bool:
        """Move the cluster one step toward the catalog.

        Called after every sync, catalog change and admin action, and on a
        timer (lost nodes, backoff). Declares lost nodes, judges each
        replica's current attempt from what agents observed, tears down and
        schedules rebuilds, advances drains, and places what the catalog
        asks for.

        :returns: whether what some node should run changed (the revision moved).
        """
        before = self.desired()
        ready_before = self._ready_ids()
        self._detect_lost(now)
        for record in list(self.replicas.values()):
            self._judge(record, now)
        if not self._waiting_for_sources(now):
            self._schedule(now, self._drain_moves(now))
        self._desired_cache = None
        changed = self.desired() != before
        if changed:
            self.revision += 1
            for record in self.replicas.values():
                if record.sent_revision == 0:
                    record.sent_revision = self.revision
                    self.dirty_replicas.add(record.id)
        if self._ready_ids() != ready_before:
            self.routes_revision += 1
        return changed

    def _waiting_for_sources(self, now: float) -> bool:
        """Whether placing should wait: a live node has not yet checked the catalog's sources."""
        if now - self.catalog_applied_at >= self.settings.source_wait:
            return False
        sources = set(self.sources_to_check())
        return any(
            not node.lost and node.reported and not sources <= node.checked_sources
            for node in self.nodes.values()
        )

    def _detect_lost(self, now: float) -> None:
        """Declare lost the nodes silent for ``lost_after``, unless too many went silent at once.

        A node whose recorded certificate expired is lost at once. When a node
        is due to be declared lost while more than ``max_lost_fraction`` of the
        nodes not lost (and at least two) are late (no sync for half of
        ``lost_after``: they stopped syncing within the same window), the server
        suspects its own network rather than them: it declares none of them
        lost (:attr:`spared`), keeps their replicas and says so in one event.
        The episode ends when one of them syncs again; then every node still
        silent is judged as usual. An operator may declare spared nodes lost
        meanwhile (``ctl nodes lost``), which does not end it.
        """
        for node in list(self.nodes.values()):
            if not node.lost and node.cert_not_after and now >= node.cert_not_after:
                self.fence_node(node.node_id, f"its certificate {node.cert_serial or 0:x} expired", now)
        limit = self.settings.lost_after
        live = [node for node in self.nodes.values() if not node.lost]
        quiet = {node.node_id: now - node.last_seen for node in live}
        silent = {node_id: seconds for node_id, seconds in quiet.items() if seconds > limit}
        late = [node_id for node_id, seconds in quiet.items() if seconds > limit / 2]
        if self.spared:
            returned = sorted(n for n in self.spared if n in quiet and n not in silent)
            self.spared = frozenset(n for n in self.spared if n in silent)
            if returned:
                self.spared = frozenset()
                message = f"syncs are back ({', '.join(returned)}): silent nodes are declared lost again"
                self.record_event(now, "cluster", "nodes", message)
            elif self.spared:
                self._spare(silent, late, len(live), now)
                return
        if silent and len(late) >= 2 and len(late) > self.settings.max_lost_fraction * len(live):
            self._spare(silent, late, len(live), now)
            return
        for node_id, seconds in sorted(silent.items()):
            self.nodes[node_id].lost = True
            self.dirty_nodes.add(node_id)
            self.record_event(
                now, "node", node_id, f"lost: no sync for {seconds:.0f} s (limit {limit:.0f} s)"
            )

    def _spare(self, silent: dict[str, float], late: list[str], live: int, now: float) -> None:
        """Keep the ``silent`` nodes out of the lost; an event names the late nodes not named yet."""
        if not self.spared:
            self._announced = frozenset()
        self.spared = self.spared | set(silent)
        new = sorted(set(late) - self._announced)
        if not new:
            return
        if self._announced:
            message = f"also stopped syncing: {', '.join(new)}; still none is declared lost"
        else:
            fraction = self.settings.max_lost_fraction
            message = (
                f"{len(late)} of {live} nodes stopped syncing together ({', '.join(new)}): more than "
                f"{fraction:.0%} at once looks like the server's own network, so none is declared lost and "
                "their replicas stay until syncs return; `llmgw ctl nodes lost NODE...` declares one lost"
            )
        self._announced = self._announced | set(new)
        self.record_event(now, "cluster", "nodes", message)

    def _judge(self, record: ReplicaRecord, now: float) -> None:
        if record.state == "backoff":
            if now >= record.not_before:
                record.state = "starting"
                record.started_at = now
                record.sent_revision = 0
                record.reason = None
                self.dirty_replicas.add(record.id)
                self.record_event(now, "replica", record.id, f"rebuilding after {record.failures} failures")
            return
        observed: list[ObservedShard | None] = []
        for node_id, key in record.shard_keys():
            node = self.nodes.get(node_id)
            if node is None or node.lost:
                return  # the scheduler moves replicas off lost nodes
            if not node.reported:
                return  # after a server restart: wait for the agent to say what runs
            shard = node.observed.get(key)
            if shard is None and record.sent_revision and node.agent_revision >= record.sent_revision:
                self._fail(record, now, f"shard {key} is gone from {node_id} (its agent restarted?)")
                return
            if shard is not None and shard.state in ("exited", "unhealthy"):
                detail = f": {shard.detail}" if shard.detail else ""
                code = f" with code {shard.exit_code}" if shard.exit_code is not None else ""
                self._fail(record, now, f"shard r{shard.rank} on {node_id} {shard.state}{code}{detail}")
                return
            observed.append(shard)
        if record.state == "ready":
            if any(s is None or s.state not in ("running", "ready") for s in observed):
                self._fail(record, now, "a shard stopped running")
            elif record.ready_since is not None and now - record.ready_since >= self.settings.stable_after:
                if record.consecutive_failures:
                    record.consecutive_failures = 0
                    self.dirty_replicas.add(record.id)
            return
        all_up = all(s is not None and s.state in ("running", "ready") for s in observed)
        if all_up and observed[0] is not None and observed[0].state == "ready":
            record.state = "ready"
            record.ready_since = now
            record.reason = None
            self.dirty_replicas.add(record.id)
            self.record_event(now, "replica", record.id, f"ready on {', '.join(record.placement.node_ids)}")
        elif now - record.started_at > self.settings.ready_timeout:
            self._fail(record, now, f"not ready within {self.settings.ready_timeout:.0f} s")

    def _fail(self, record: ReplicaRecord, now: float, reason: str) -> None:
        record.failures += 1
        record.consecutive_failures += 1
        record.attempt = self.new_attempt()
        delay = min(
            self.settings.backoff_max, self.settings.backoff_base * 2 ** (record.consecutive_failures - 1)
        )
        record.state = "backoff"
        record.not_before = now + delay
        record.ready_since = None
        record.reason = reason
        self.dirty_replicas.add(record.id)
        self.record_event(
            now,
            "replica",
            record.id,
            f"failed: {reason}; tearing down every shard, rebuild in {delay:.1f} s "
            f"(failure {record.failures})",
        )

    def _drain_moves(self, now: float) -> list[str]:
        """Replica ids to move off draining nodes now: one at a time per node."""
        moves = []
        replacing = {r.placement.replaces for r in self.replicas.values() if r.placement.replaces}
        for node in sorted(self.nodes.values(), key=lambda n: n.node_id):
            if not node.draining:
                continue
            on_node = sorted(
                r.id
                for r in self.replicas.values()
                if node.node_id in r.placement.node_ids and not r.placement.replaces
            )
            for replica_id in on_node:
                replacement = self._replacement_of(replica_id)
                if replacement is not None and replacement.state == "ready":
                    self._retire(replica_id, replacement, now)
            on_node = [i for i in on_node if i in self.replicas]
            if not on_node:
                if not any(node.node_id in r.placement.node_ids for r in self.replicas.values()):
                    node.draining = False
                    self.dirty_nodes.add(node.node_id)
                    self.record_event(now, "node", node.node_id, "drained: no replica left; still cordoned")
                continue
            if not any(i in replacing for i in on_node):
                moves.append(on_node[0])
        return moves

    def _replacement_of(self, replica_id: str) -> ReplicaRecord | None:
        return next((r for r in self.replicas.values() if r.placement.replaces == replica_id), None)

    def _retire(self, replica_id: str, replacement: ReplicaRecord, now: float) -> None:
        del self.replicas[replica_id]
        self.dirty_replicas.add(replica_id)
        replacement.placement = attrs.evolve(replacement.placement, replaces=None)
        self.dirty_replicas.add(replacement.id)
        self.record_event(
            now, "replica", replica_id, f"moved: {replacement.id} is ready, stopping the original"
        )

    def _schedule(self, now: float, moves: list[str]) -> None:
        result = schedule(
            [node.view() for node in self.nodes.values()],
            self.catalog,
            [record.placement for record in self.replicas.values()],
            replace=moves,
        )
        for removal in result.removed:
            if removal.replica.id in self.replicas:
                del self.replicas[removal.replica.id]
                self.dirty_replicas.add(removal.replica.id)
                self.record_event(now, "replica", removal.replica.id, f"removed: {removal.reason}")
        for placement in result.placements:
            record = self.replicas.get(placement.id)
            if record is not None and record.placement == placement:
                continue
            if record is None:
                record = ReplicaRecord(placement=placement, attempt=self.new_attempt(), started_at=now)
                self.replicas[placement.id] = record
                what = f"replacement for {placement.replaces}" if placement.replaces else "placed"
            else:
                record.placement = placement
                record.attempt = self.new_attempt()
                record.state = "starting"
                record.started_at = now
                record.sent_revision = 0
                record.ready_since = None
                what = "placed again"
            self.dirty_replicas.add(placement.id)
            where = ", ".join(
                f"{s.node_id} (r{s.rank}, GPUs {','.join(map(str, s.gpus)) or '-'}, port {s.port})"
                for s in placement.shards
            )
            self.record_event(now, "replica", placement.id, f"{what} on {where}")
        if result.unplaced != self.unplaced:
            self._record_unplaced(now, [item for item in result.unplaced if item not in self.unplaced])
            self.unplaced = result.unplaced

    def _record_unplaced(self, now: float, new: list[Unplaced]) -> None:
        """One event per model and reason for replicas that newly cannot be placed, however many they are."""
        groups: dict[tuple[str, str], list[Unplaced]] = {}
        for item in new:
            groups.setdefault((item.model, item.reason), []).append(item)
        for (model, reason), items in groups.items():
            if len(items) == 1:
                self.record_event(now, "replica", items[0].id, f"cannot be placed: {reason}")
            else:
                first, last = items[0].id, items[-1].id
                message = f"{len(items)} replicas ({first} … {last}) cannot be placed: {reason}"
                self.record_event(now, "model", model, message)

    def _ready_ids(self) -> frozenset[str]:
        return frozenset(r.id for r in self.replicas.values() if r.state == "ready")

    def take_events(self) -> list[Event]:
        """The events recorded since the last call (for the server to persist)."""
        events, self.events = self.events, []
        return events

    def record_event(self, now: float, kind: str, subject: str, message: str) -> None:
        """Add an event for ``ctl events``; it is stored at the next flush."""
        self.events.append(Event(now, kind, subject, message))
