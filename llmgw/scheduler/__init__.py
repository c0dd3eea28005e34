"""The scheduler: a pure, deterministic function from (nodes, catalog, placements) to placements.

The server's reconciler calls :func:`schedule` with every node it knows (as
:class:`NodeView`), the stored catalog and the replicas placed so far, stores
the :class:`ScheduleResult`, and sends each agent the shards on its node. The
scheduler does no I/O and keeps no state between calls: what it needs to know
about earlier decisions is in the placements it is given.

How it decides:

- A replica already placed stays, unchanged, unless its model left the catalog
  or was scaled down (highest index first), its profile's shape changed, or a
  node it runs on is lost, unknown, or lacks the engine or the model source.
  Each dropped replica is in :attr:`ScheduleResult.removed` with the reason.
  A replica that runs another command than the catalog asks (a rollout under
  way, ``schedule(..., launches=...)``) is checked against what it runs.
- A cordoned node keeps its replicas and gets no new ones; drain moves them
  with ``schedule(..., replace=[replica_id])``.
- A rollout replaces a replica with ``schedule(..., roll=[replica_id])``: as a
  drain's move, but the replacement may share the original's nodes.
- A new replica goes to ready nodes with the engine, the model source, enough
  free GPUs (each with the profile's minimum memory) and free ports in their
  range. It prefers nodes with the fewest replicas of its model, then the
  fewest used GPUs, then the lowest node id. A multi-node replica takes nodes
  of one fabric; an island node (no fabric) only takes single-node replicas.
- A node without a copy of a distributable source gets a replica of it only
  when its models directory has room for the copy plus a headroom
  (``schedule(..., sizes=..., headroom=...)``), counting the copies no
  replica there uses (its agent evicts them, least recently used first).
- A single-node replica, among nodes with as many replicas of its model,
  prefers islands and nodes already partly used to a fabric node no replica
  uses (on a fabric with another ready node: one a multi-node replica could
  use). A multi-node replica with no place, that would have one if
  single-node replicas on a fabric's nodes ran elsewhere, gets those nodes
  freed: each such replica gets a replacement away from them
  (:attr:`ScheduleResult.moves`, as a drain's move); while they move, no
  other replica is moved for it (:mod:`llmgw.scheduler._room`).
- A replica with no place is in :attr:`ScheduleResult.unplaced` with a reason
  that names the closest miss.
"""

from __future__ import annotations

from llmgw.scheduler._disk import DEFAULT_HEADROOM, DiskRoom, format_bytes
from llmgw.scheduler._explain import explain_unplaced, node_warnings
from llmgw.scheduler._place import schedule
from llmgw.scheduler._records import (
    DEFAULT_PORT_RANGE,
    NODE_STATES,
    Move,
    NodeView,
    Removal,
    Replica,
    ScheduleResult,
    Shard,
    Unplaced,
    replica_id,
)

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_PORT_RANGE",
    "DiskRoom",
    "Move",
    "NODE_STATES",
    "NodeView",
    "Removal",
    "Replica",
    "ScheduleResult",
    "Shard",
    "Unplaced",
    "explain_unplaced",
    "format_bytes",
    "node_warnings",
    "replica_id",
    "schedule",
]
