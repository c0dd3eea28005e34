"""The records the control plane keeps: a node, a replica, the reconciler's timings, an event."""

from __future__ import annotations

import enum

import attrs

from llmgw.models import DEFAULT_READY_TIMEOUT, Catalog, Model, NodeFacts, Profile, Rollout
from llmgw.scheduler import NodeView, Replica
from llmgw.wire import KeyLimits, ObservedShard, SyncRequest, shard_key
from llmgw.wire.causes import FailureCause

__all__ = [
    "Settings",
    "DEFAULT_SETTINGS",
    "Event",
    "EventKind",
    "NodeRecord",
    "ReplicaRecord",
    "ReplicaState",
    "Launch",
    "KeyRecord",
]


class ReplicaState(enum.StrEnum):
    """A replica's state as the server records it (``ctl replicas`` shows ``staging`` for a starting
    replica whose shards copy their weights)."""

    STARTING = "starting"
    READY = "ready"
    #: failed; rebuilt once its backoff has passed
    BACKOFF = "backoff"


class EventKind(enum.StrEnum):
    """What an event is about: ``ctl events``' kind column and ``llmgw_server_events_total{kind}``."""

    #: a LoRA adapter was loaded on a replica, its load failed, or it was unloaded (subject: the adapter)
    ADAPTER_LOADED = "adapter_loaded"
    ADAPTER_FAILED = "adapter_failed"
    ADAPTER_UNLOADED = "adapter_unloaded"
    #: the autoscaler changed a model's desired replicas (or holds it at its max while over target)
    AUTOSCALE = "autoscale"
    CATALOG = "catalog"
    CLUSTER = "cluster"
    GATEWAY = "gateway"
    #: an API key created, revoked, or its limits changed
    KEY = "key"
    #: a server took the lead (written by the leader itself)
    LEADER = "leader"
    MODEL = "model"
    NODE = "node"
    REFUSAL = "refusal"
    REPLICA = "replica"
    ROLLOUT = "rollout"
    WEIGHTS = "weights"


@attrs.frozen
class KeyRecord:
    """An API key as the server keeps it: the hash of its secret (never the secret), dates, limits."""

    #: sha256 hex of the secret
    digest: str
    created_at: float
    revoked_at: float | None = None
    limits: KeyLimits = KeyLimits()


@attrs.frozen
class Settings:
    """The reconciler's timings, in seconds."""

    #: a node that has not synced for this long is lost
    lost_after: float = 30.0
    #: when more than this fraction of the nodes (and at least two) go silent together, the
    #: server suspects its own network: it declares none of them lost until syncs return
    max_lost_fraction: float = 0.3
    #: first wait before rebuilding a failed replica; doubles per consecutive failure
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    #: a replica ready this long has its consecutive-failure count reset
    stable_after: float = 60.0
    #: how long rank 0 may take to pass its health check
    ready_timeout: float = DEFAULT_READY_TIMEOUT
    #: after a catalog change, how long placing waits for every node to say
    #: which of its model sources it has (so replicas spread, not pile onto
    #: the first node that answered)
    source_wait: float = 10.0
    #: the share of a model's size a node must have free beyond the copy of its weights
    disk_headroom: float = 0.05
    #: seconds between two tries to place replicas that found no place, when nothing else changed
    #: (a node's disk got room, a copy was evicted: free bytes are not watched sync by sync)
    unplaced_retry: float = 5.0
    #: a replica retired while ready runs at most this long for gateways that still route to it
    #: (:mod:`llmgw.server.controllers.stopping`): the server derives it from its poll timeout
    linger_max: float = 15.0


#: the timings ``llmgw server`` runs with unless told otherwise
DEFAULT_SETTINGS = Settings()


@attrs.frozen
class Event:
    """Something the server decided, and why: ``ctl events`` shows these."""

    at: float
    kind: str
    subject: str
    message: str
    #: a replica's failure: why (not stored; the metrics count it as it is recorded)
    cause: FailureCause | None = attrs.field(default=None, eq=False)


@attrs.define
class NodeRecord:
    """One node as the server knows it."""

    node_id: str
    address: str
    facts: NodeFacts
    port_range: tuple[int, int]
    first_seen: float
    last_seen: float
    cordoned: bool = False
    lost: bool = False
    draining: bool = False
    #: the revision of the last reply the agent applied
    agent_revision: int = 0
    observed: dict[str, ObservedShard] = attrs.field(factory=dict)
    #: whether the agent synced since this server started (``observed`` is known)
    reported: bool = False
    #: the model sources the agent checked for ``facts.model_sources``
    checked_sources: frozenset[str] = frozenset()
    #: the serial and expiry (UNIX time) of the certificate the node last synced with
    cert_serial: int | None = None
    cert_not_after: float | None = None
    #: the agent's instance id, whether it said it is leaving, and when it last left or restarted
    #: (:mod:`llmgw.server.controllers.health.agent_restart`); not stored: a server restart forgets them
    agent_instance: str = ""
    agent_leaving: bool = False
    agent_left_at: float | None = None
    #: the old agent's last sync before it left or restarted (its shards may have ended since)
    agent_gone_since: float = 0.0
    #: when the current agent instance first synced, if it replaced a known one (0: not known)
    agent_instance_since: float = 0.0

    @property
    def state(self) -> str:
        """``lost``, ``cordoned`` (draining included) or ``ready``."""
        if self.lost:
            return "lost"
        return "cordoned" if self.cordoned else "ready"

    def view(self) -> NodeView:
        """This node as the scheduler sees it."""
        return NodeView(facts=self.facts, address=self.address, state=self.state, port_range=self.port_range)

    def note_agent(self, request: SyncRequest, now: float) -> str | None:
        """Record the agent instance and farewell a sync carries; called by ``ClusterState.sync``, every sync.

        See :mod:`llmgw.server.controllers.health.agent_restart` for what follows.

        :returns: the node event to record when the agent is leaving or restarted, else None.
        """
        message = None
        if request.instance and request.instance != self.agent_instance:
            if self.agent_instance and not self.agent_leaving and self.adopted_all(request):
                message = "its agent restarted and adopted every shard running here (nothing restarts)"
            elif self.agent_instance and not self.agent_leaving:
                self.agent_left_at, self.agent_gone_since = now, self.last_seen
                message = (
                    "its agent restarted: the replicas with a shard here start again (no failure counted)"
                )
            if self.agent_instance:
                self.agent_instance_since = now
            self.agent_instance, self.agent_leaving = request.instance, False
        if request.leaving and not self.agent_leaving:
            self.agent_leaving, self.agent_left_at, self.agent_gone_since = True, now, now
            message = (
                "its agent is stopping on purpose: the replicas with a shard here leave the routes and start "
                "again once it is back (no failure counted)"
            )
        return message

    def adopted_all(self, request: SyncRequest) -> bool:
        """Whether a restarted agent's first sync reports every shard its predecessor ran still running.

        Called by :meth:`ClusterState.sync` when the agent instance changes: such an agent adopted its
        predecessor's engines (they outlived it), so nothing starts again.
        """
        reported = {shard.key: shard.state for shard in request.observed}
        live = ("starting", "running", "ready")
        ran = [key for key, shard in self.observed.items() if shard.state in live]
        return all(reported.get(key) in ("running", "ready") for key in ran)

    def forget_progress(self, why: str) -> bool:
        """Drop the staging progress (bytes, rate, ETA) its shards last reported; ``why`` is their detail.

        Called by :meth:`ClusterState.forget_progress` for a node lost or silent; returns whether it had any.
        """
        stale = {key: shard for key, shard in self.observed.items() if shard.staged is not None}
        self.observed |= {key: attrs.evolve(shard, staged=None, detail=why) for key, shard in stale.items()}
        return bool(stale)


@attrs.frozen
class Launch:
    """What a replica's current attempt was started from: its model's and its profile's catalog entries.

    The shards agents are told to run are built from it, never from the
    catalog in force: a replica runs what it was started with until it is
    replaced (see :mod:`llmgw.server.controllers.rollout.rollouts`).
    """

    model: Model
    profile: Profile

    @classmethod
    def of(cls, catalog: Catalog, model: str) -> Launch | None:
        """What ``catalog`` asks a replica of ``model`` to run; None when it has no such model or profile."""
        entry = catalog.models.get(model)
        profile = catalog.profiles.get(entry.profile) if entry is not None else None
        if entry is None or profile is None:
            return None
        # how many replicas, how they roll and scale: not what one replica runs
        plain = attrs.evolve(entry, replicas=1, rollout=Rollout(), autoscale=None, priority=0)
        return cls(attrs.evolve(plain, idle_after=None), profile)

    @property
    def command(self) -> tuple[object, ...]:
        """The fields that make the shards' commands: launches that differ here run different commands.

        The rest (ready timeout, stop grace, minimum GPU memory) is timing
        or placement; a replica differing only there is not outdated. A
        model's adapters are loaded on the running engine, so which adapters
        it has is not here; whether it has any, and the profile's
        ``max_adapters`` and ``max_adapter_rank``, are (the engine's LoRA flags).
        On an engine that loads adapters only at start (``adapters_at_start``),
        they are: each one's name and source (its ``--lora`` arguments). Not their
        order: a running replica numbers them as its own launch does, and so do the
        request fields the routes feed gives for it.
        """
        model, profile = self.model, self.profile
        command = (
            model.source,
            model.profile,
            model.served_name,
            profile.engine,
            profile.nodes,
            profile.gpus_per_node,
            profile.args,
            profile.sidecars,
        )
        # only for a model with adapters: a model without keeps the command (and a paused rollout's digest
        # of it) it had before adapters existed
        if not model.adapters:
            return command
        lora = (profile.max_adapters, profile.max_adapter_rank)
        if profile.adapters_at_start:
            return (*command, lora, tuple(sorted(model.adapters.items())))
        return (*command, lora)


@attrs.define
class ReplicaRecord:
    """One replica: where it is placed and how its current attempt is doing."""

    placement: Replica
    #: a number never used before by any replica, new at every (re)build:
    #: shards of older attempts are stopped, and a key is never reused
    attempt: int = 0
    #: failures in a row, for the backoff; reset once stable
    consecutive_failures: int = 0
    #: every failure of this replica, for the operator
    failures: int = 0
    state: ReplicaState = attrs.field(default=ReplicaState.STARTING, converter=ReplicaState)
    reason: str | None = None
    #: why it last failed (not stored)
    cause: FailureCause | None = None
    #: when the current attempt's shards were first handed out (revision)
    sent_revision: int = 0
    started_at: float = 0.0
    ready_since: float | None = None
    #: in backoff, when the rebuild may start
    not_before: float = 0.0
    #: what the current attempt runs (None only for a replica whose model left the catalog before it
    #: was recorded: such a replica is removed by the scheduler)
    launch: Launch | None = None
    #: what it ran before a rollout restarted it in place: it goes back to that if the rollout pauses
    #: (not stored: after a server restart such a replica stays on the new command)
    rolled_from: Launch | None = None
    #: when it last failed (not stored)
    failed_at: float | None = None

    @property
    def id(self) -> str:
        """The replica's id."""
        return self.placement.id

    def shard_keys(self) -> list[tuple[str, str]]:
        """(node id, shard key) of every shard of the current attempt."""
        return [
            (shard.node_id, shard_key(self.id, self.attempt, shard.rank)) for shard in self.placement.shards
        ]
