"""The records the scheduler reads and writes: node views, replicas, shards, results."""

from __future__ import annotations

import attrs

from llmgw.models import NodeFacts

__all__ = [
    "DEFAULT_PORT_RANGE",
    "NODE_STATES",
    "NodeView",
    "Shard",
    "Replica",
    "Unplaced",
    "Removal",
    "ScheduleResult",
    "replica_id",
]

#: Ports a node hands out when its agent configures none (both ends included).
DEFAULT_PORT_RANGE = (20000, 20999)

#: ``ready`` takes new replicas; ``cordoned`` keeps the ones it has and gets no
#: new ones (drain, or a node whose heartbeat is late); ``lost`` stopped syncing
#: and its replicas are placed elsewhere.
NODE_STATES = frozenset({"ready", "cordoned", "lost"})


def replica_id(model: str, index: int) -> str:
    """The id of replica ``index`` of ``model``: ``llama-3.1-70b-0``, ``llama-3.1-70b-1``...

    Unique across models, since the suffix is always ``-<integer>``.
    """
    return f"{model}-{index}"


def _port_range(instance: object, attribute: attrs.Attribute, value: tuple[int, int]) -> None:
    if len(value) != 2 or not 1 <= value[0] <= value[1] <= 65535:
        raise ValueError(f"{attribute.name} must be (low, high) with 1 <= low <= high <= 65535, got {value}")


@attrs.frozen
class NodeView:
    """One node as the scheduler sees it: the agent's facts plus what the server knows."""

    facts: NodeFacts
    #: the host the node's shards bind and are reached at
    address: str
    state: str = attrs.field(default="ready", validator=attrs.validators.in_(NODE_STATES))
    #: ports this node's shards may use, both ends included
    port_range: tuple[int, int] = attrs.field(
        default=DEFAULT_PORT_RANGE, converter=tuple, validator=_port_range
    )

    @property
    def node_id(self) -> str:
        """The node's id, as in its certificate."""
        return self.facts.node_id

    @property
    def usable(self) -> bool:
        """True when the node may get new replicas."""
        return self.state == "ready"


@attrs.frozen
class Shard:
    """The part of a replica that runs on one node."""

    #: 0 serves HTTP and binds the dist-init port; workers join it
    rank: int
    node_id: str
    #: GPU indices on the node (``nvidia-smi``'s ``index``); empty for CPU-only engines
    gpus: tuple[int, ...] = attrs.field(converter=tuple)
    #: rank 0 serves HTTP here; a worker listens here for engines whose rank 0
    #: dials its workers (llama.cpp RPC), other engines leave it unused
    port: int
    #: rank 0 of a multi-node replica binds it and workers join it; None otherwise
    dist_init_port: int | None = None


@attrs.frozen
class Replica:
    """One copy of a model, placed: its shards, in rank order."""

    #: ``replica_id(model, index)``; stable while the replica lives
    id: str
    model: str
    #: the replica's slot among the model's replicas; scaling down removes the highest
    index: int
    shards: tuple[Shard, ...] = attrs.field(converter=tuple)
    #: the fabric every shard's node shares; None for a single-node replica
    fabric: str | None = None
    #: one more than the generation of the replica with this id that the same
    #: run dropped (its node was lost...), else 0: a re-placed replica keeps its
    #: id, and this (with the shards) tells the new incarnation from the old
    generation: int = 0
    #: the id of the replica this one is moving (drain): it does not count
    #: toward the model's replicas until that one is removed
    replaces: str | None = None

    @property
    def rank0(self) -> Shard:
        """The shard that serves HTTP."""
        return self.shards[0]

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The nodes this replica runs on, in rank order."""
        return tuple(shard.node_id for shard in self.shards)


@attrs.frozen
class Unplaced:
    """A replica the catalog asks for that no node can take now, and why."""

    model: str
    #: the index the replica would get
    index: int
    #: what is missing, naming nodes and numbers, for ``ctl replicas``
    reason: str
    #: set when this is the replacement of a replica being moved
    replaces: str | None = None

    @property
    def id(self) -> str:
        """The id the replica would get."""
        return replica_id(self.model, self.index)


@attrs.frozen
class Removal:
    """An existing replica the scheduler dropped, and why (for the event log)."""

    replica: Replica
    reason: str


@attrs.frozen
class Move:
    """A single-node replica moved to make room for a multi-node replica (its replacement placed away)."""

    #: the replica moved, and its replacement (``replaces=replica``)
    replica: str
    replacement: str
    #: the multi-node replica the room is for: its model and index, the fabric and nodes it will take
    model: str
    index: int
    fabric: str
    nodes: tuple[str, ...] = attrs.field(converter=tuple)

    @property
    def message(self) -> str:
        """The event the server records: what moves where, and for whom."""
        return (
            f"moving to {self.replacement}: room for {replica_id(self.model, self.index)} "
            f"on nodes {', '.join(self.nodes)} of fabric {self.fabric}"
        )


@attrs.frozen
class ScheduleResult:
    """What :func:`~llmgw.scheduler.schedule` decided."""

    #: every replica that should run, sorted by id: the kept ones unchanged, plus new ones
    placements: tuple[Replica, ...] = attrs.field(converter=tuple)
    #: replicas the catalog asks for that could not be placed, by model and index
    unplaced: tuple[Unplaced, ...] = attrs.field(converter=tuple, default=())
    #: input replicas left out of ``placements``, by id
    removed: tuple[Removal, ...] = attrs.field(converter=tuple, default=())
    #: single-node replicas moved to make room for a multi-node one (their replacements are in placements)
    moves: tuple[Move, ...] = attrs.field(converter=tuple, default=())
