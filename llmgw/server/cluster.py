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

from llmgw.models import Catalog, NodeFacts
from llmgw.scheduler import ScheduleResult, Unplaced
from llmgw.server.agent_restart import left_agent, note_agent, start_again
from llmgw.server.drain import drain_moves
from llmgw.server.events import EventLog
from llmgw.server.plan import SchedulePlan
from llmgw.server.records import DEFAULT_SETTINGS, Event, NodeRecord, ReplicaRecord, Settings
from llmgw.server.rollout import Rollouts
from llmgw.server.silence import SilenceWatch
from llmgw.server.stopping import StopOrder
from llmgw.server.views import ClusterViews
from llmgw.weights import Manifest, agreeing_facts
from llmgw.wire import DesiredShard, ObservedShard, SyncRequest

#: seconds without a sync after which a node's staging progress (bytes, rate, ETA) is no longer shown
STALE_PROGRESS = 10.0

__all__ = ["Cluster", "NodeRecord", "ReplicaRecord", "Settings", "Event", "SchedulePlan"]


class Cluster(ClusterViews):
    """What the server knows and decides; see the module docstring."""

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
        #: moves with every change of which replicas are ready (the gateway's routes)
        self.routes_revision = 1
        self.event_log = EventLog()
        self.dirty_nodes: set[str] = set()
        self.dirty_replicas: set[str] = set()
        self.dirty_catalog = False
        self._desired_cache: dict[str, tuple[DesiredShard, ...]] | None = None
        #: workers of stopping multi-node replicas, held until their rank 0 is gone
        self.stopping = StopOrder()
        #: every model's rollout of outdated replicas
        self.rollouts = Rollouts()
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
        self._before: tuple[dict[str, tuple[DesiredShard, ...]], frozenset[str]] | None = None
        #: the mass-silence episode under way, if any (see :meth:`_detect_lost`)
        self.silence = SilenceWatch()
        #: the stored manifest of every distributable source (its size is what a copy takes on disk)
        self.manifests: dict[str, Manifest] = {}
        #: when the scheduler last ran (replicas without a place are tried again every ``unplaced_retry``)
        self.scheduled_at = 0.0

    def new_attempt(self) -> int:
        """A fresh attempt number."""
        attempt, self.next_attempt = self.next_attempt, self.next_attempt + 1
        return attempt

    # -- inputs --------------------------------------------------------------

    def apply_catalog(self, catalog: Catalog, text: str, now: float, author: str = "") -> None:
        """Make ``catalog`` the desired state (already validated); ``author`` applied it."""
        self.catalog = catalog
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
        self.record_event(now, "catalog", f"revision {self.catalog_revision}", f"catalog applied{by}")

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
            self.record_event(now, "node", node.node_id, f"registered from {request.address}")
        elif node.lost:
            self.record_event(now, "node", node.node_id, "is back after being lost")
        if (message := note_agent(node, request, now)) is not None:
            self.record_event(now, "node", node.node_id, message)
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
        self.schedule_wanted = True
        self.dirty_nodes.add(node_id)
        self.record_event(now, "node", node_id, f"lost at once: {reason}; its replicas are rebuilt elsewhere")
        return True

    def set_cordon(self, node_id: str, cordoned: bool, now: float, *, drain: bool = False) -> None:
        """Cordon (no new replicas), uncordon, or start draining a node."""
        node = self.nodes[node_id]
        node.cordoned = cordoned or drain
        node.draining = drain or (node.draining and cordoned)
        self.dirty_nodes.add(node_id)
        self.schedule_wanted = True
        action = "drain started" if drain else ("cordoned" if cordoned else "uncordoned")
        self.record_event(now, "node", node_id, action)

    # -- the reconciler ------------------------------------------------------

    def reconcile(self, now: float) -> bool:
        """Move the cluster one step toward the catalog: :meth:`begin`, the schedule, :meth:`finish`.

        The server runs the three steps itself (the schedule off the event
        loop); tests and tools call this.

        :returns: whether what some node should run changed (the revision moved).
        """
        plan = self.begin(now)
        return bool(self.finish(now, plan.run() if plan is not None else None))

    def begin(self, now: float) -> SchedulePlan | None:
        """The first step of a reconcile: judge what agents observed; say whether to schedule.

        Declares lost nodes, judges each replica's current attempt (ready,
        failed, rebuilt after backoff), advances drains and rollouts. Costs O(nodes +
        replicas); never schedules.

        :returns: the schedule to run before :meth:`finish`, or None when
            nothing the scheduler reads changed (or placing waits for agents
            to check the catalog's sources).
        """
        self._before = (self.desired(), self._ready_ids())
        self._detect_lost(now)
        for record in list(self.replicas.values()):
            self._judge(record, now)
        if self._waiting_for_sources(now):
            return None
        moves = drain_moves(self, now)
        rolls = self.rollouts.step(self, now)
        retry = bool(self.unplaced) and now - self.scheduled_at >= self.settings.unplaced_retry
        if not (self.schedule_wanted or moves or rolls or retry):
            return None
        self.schedule_wanted = False
        self.scheduled_at = now
        return SchedulePlan(
            # a node whose seed folder differs from the fleet's manifest does not hold that source
            nodes=tuple(
                attrs.evolve(node.view(), facts=agreeing_facts(node.facts, self.manifests))
                for node in self.nodes.values()
            ),
            catalog=self.catalog,
            placements=tuple(record.placement for record in self.replicas.values()),
            replace=tuple(moves),
            roll=tuple(rolls),
            launches=tuple(
                (r.id, r.launch)
                for r in self.replicas.values()
                if r.launch is not None and self.is_outdated(r)
            ),
            sizes=tuple((source, m.total_bytes) for source, m in sorted(self.manifests.items())),
            headroom=self.settings.disk_headroom,
        )

    def finish(self, now: float, result: ScheduleResult | None = None) -> frozenset[str]:
        """The last step of a reconcile: apply the schedule's ``result`` (if any) and publish.

        Moves :attr:`revision` when what some node should run changed, and
        :attr:`routes_revision` when the set of ready replicas changed.

        :returns: the ids of the nodes whose shards changed (their long-polls wake).
        """
        if result is not None:
            self._apply_schedule(now, result)
        if result is not None or self.dirty_replicas or self.dirty_nodes or self.dirty_catalog:
            self.view_version += 1
        before, ready_before = self._before if self._before is not None else ({}, frozenset())
        self._before = None
        self._order_stops(before, now)
        self._desired_cache = None
        after = self.desired()
        changed = frozenset(
            node_id
            for node_id in before.keys() | after.keys()
            if before.get(node_id, ()) != after.get(node_id, ())
        ) | self.rollouts.take_stage_changed()
        if changed:
            self.revision += 1
            for node_id in changed:
                self.node_revisions[node_id] = self.revision
            for record in self.replicas.values():
                if record.sent_revision == 0:
                    record.sent_revision = self.revision
                    self.dirty_replicas.add(record.id)
        if self._ready_ids() != ready_before:
            self.routes_revision += 1
        return changed

    def node_revision(self, node_id: str) -> int:
        """The revision at which what ``node_id`` should run (or check) last changed."""
        return max(self.node_revisions.get(node_id, 0), self.sources_revision)

    def _order_stops(self, before: dict[str, tuple[DesiredShard, ...]], now: float) -> None:
        """Hold the workers of multi-node replicas just retired; release those whose rank 0 is gone."""
        self.stopping.note(before, self.replicas, self.revision, now)
        for replica_id, message in self.stopping.settle(self.nodes, now):
            self.record_event(now, "replica", replica_id, message)

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

        The staging progress of a node lost, or silent for :data:`STALE_PROGRESS`, is dropped.

        A node whose recorded certificate expired is lost at once; the rest is
        :meth:`SilenceWatch.judge`. An operator may declare spared nodes lost
        (``ctl nodes lost``), which does not end the episode.
        """
        for node in list(self.nodes.values()):
            if not node.lost and node.cert_not_after and now >= node.cert_not_after:
                self.fence_node(node.node_id, f"its certificate {node.cert_serial or 0:x} expired", now)
        limit = self.settings.lost_after
        verdict = self.silence.judge(self.nodes.values(), limit, self.settings.max_lost_fraction, now)
        for message in verdict.messages:
            self.record_event(now, "cluster", "nodes", message)
        for node_id, seconds in verdict.lost:
            self.nodes[node_id].lost = True
            self.schedule_wanted = True
            self.dirty_nodes.add(node_id)
            message = f"lost: no sync for {seconds:.0f} s (limit {limit:.0f} s)"
            self.record_event(now, "node", node_id, message)
        for node in self.nodes.values():  # a staging shard reports every PROGRESS_EVERY: silent, it is stale
            if node.lost or now - node.last_seen > STALE_PROGRESS:
                stale = {k: s for k, s in node.observed.items() if s.staged is not None}
                if stale:
                    why = f"no progress known: {node.node_id} has not synced for over {STALE_PROGRESS:.0f} s"
                    node.observed |= {k: attrs.evolve(s, staged=None, detail=why) for k, s in stale.items()}
                    self.view_version += 1

    @property
    def spared(self) -> frozenset[str]:
        """Silent nodes not declared lost: too many went silent at once (see :meth:`_detect_lost`)."""
        return self.silence.spared

    def _judge(self, record: ReplicaRecord, now: float) -> None:
        if (left := left_agent(record, self.nodes)) is not None:
            return start_again(self, record, left, now)
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
        if any(s is not None and s.state == "staging" for s in observed):
            record.started_at = now  # copying the weights: the ready timeout counts from the copy's end
            return
        all_up = all(s is not None and s.state in ("running", "ready") for s in observed)
        if all_up and observed[0] is not None and observed[0].state == "ready":
            record.state = "ready"
            record.ready_since = now
            record.reason = None
            self.dirty_replicas.add(record.id)
            self.record_event(now, "replica", record.id, f"ready on {', '.join(record.placement.node_ids)}")
        elif now - record.started_at > (timeout := self.ready_timeout_of(record)):
            self._fail(record, now, f"not ready within {timeout:.0f} s")

    def _fail(self, record: ReplicaRecord, now: float, reason: str) -> None:
        record.failures, record.consecutive_failures, record.failed_at = (
            record.failures + 1, record.consecutive_failures + 1, now
        )
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

    def _apply_schedule(self, now: float, result: ScheduleResult) -> None:
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
                launch = self.rollouts.launch_for(self, placement)
                record = ReplicaRecord(placement, self.new_attempt(), started_at=now, launch=launch)
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
        return self.event_log.take()

    def record_event(self, now: float, kind: str, subject: str, message: str) -> None:
        """Add an event for ``ctl events``; it is stored at the next flush (see :class:`EventLog`)."""
        self.event_log.record(Event(now, kind, subject, message))


def _placement_facts(facts: NodeFacts) -> tuple[object, ...]:
    """What the scheduler reads of a node's facts: not the GPUs' free memory, which moves all the time."""
    gpus = tuple((g.index, g.uuid, g.memory_total_mib) for g in facts.gpus)
    return (gpus, facts.fabrics, facts.engines, facts.model_sources, facts.problems)


def _states(observed: dict[str, ObservedShard]) -> dict[str, tuple[object, ...]]:
    return {key: (shard.state, shard.exit_code, shard.detail) for key, shard in observed.items()}
