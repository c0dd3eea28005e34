"""Making room for a multi-node replica: moving single-node replicas off the nodes of a fabric.

When a multi-node replica finds no fabric with enough free nodes, but would
on some fabric if single-node replicas there ran elsewhere, :func:`make_room`
picks the nodes that need the fewest such moves and places a replacement of
each replica to move away from them (``replaces=<id>``, as a drain's move).
The server retires each original once its replacement is ready; the next
run then places the multi-node replica on the nodes it freed. While moves
are under way (a replica on those nodes is being replaced), the nodes count
as freed and no further replica is moved.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from llmgw.models import Catalog, Model, Profile
from llmgw.scheduler._disk import needs_of
from llmgw.scheduler._pick import Request, place
from llmgw.scheduler._records import Move, Replica, replica_id
from llmgw.scheduler._state import NodeState

__all__ = ["FABRICS_TRIED", "Room", "make_room"]

#: the fabrics needing the fewest moves that are tried, in order, before the replica stays unplaced
FABRICS_TRIED = 3


@attrs.frozen
class Room:
    """What :func:`make_room` decided for one multi-node replica."""

    #: the fabric and its nodes the replica will take once they are free
    fabric: str
    nodes: tuple[str, ...]
    #: replacements placed now, each away from ``nodes`` (empty: the moves are already under way)
    replacements: tuple[Replica, ...]
    #: the replicas moved now, and the ones already moving off ``nodes``
    moves: tuple[Move, ...]
    waiting: tuple[str, ...]

    @property
    def reason(self) -> str:
        """Why the replica is not placed yet, for ``ctl replicas``."""
        where = f"nodes {', '.join(self.nodes)} of fabric {self.fabric}"
        if self.moves:
            moving = ", ".join(f"{move.replica} to {move.replacement}" for move in self.moves)
            return f"making room on {where}: moving {moving}"
        return f"waiting for {', '.join(self.waiting)} to move off {where}"


@attrs.frozen
class _Candidate:
    """A node that fits the replica once ``moves`` (and the replicas already leaving) run elsewhere."""

    node: NodeState
    moves: tuple[Replica, ...]
    waiting: tuple[str, ...]

    def rank(self, model: str) -> tuple:
        return (len(self.moves), len(self.waiting), self.node.key(model))


def make_room(
    ordered: list[NodeState],
    state: dict[str, NodeState],
    catalog: Catalog,
    placements: list[Replica],
    launches: Mapping[str, object],
    generations: Mapping[str, int],
    target: tuple[str, Model, Profile, Request],
    sizes: Mapping[str, int],
    headroom: float,
    taken: frozenset[str],
) -> Room | None:
    """Find room for ``target`` (a multi-node replica no fabric has nodes for) by moving single-node replicas.

    Called by :func:`~llmgw.scheduler.schedule` after every model was placed,
    for each multi-node replica left over. ``placements`` are the replicas
    the run keeps and has placed; ``launches`` the ids of outdated replicas
    (never moved); ``taken`` nodes already promised to another replica's room.
    On success the replacements' GPUs and ports are claimed in ``state``
    (whose entries are replaced by the trial's) and returned.

    :returns: the room (moves placed now, or under way), or None when moving
        single-node replicas would not make room on any fabric.
    """
    name, model, profile, request = target
    leaving = {r.replaces for r in placements if r.replaces is not None}
    on_node: dict[str, list[Replica]] = {}
    for replica in placements:
        for node_id in replica.node_ids:
            on_node.setdefault(node_id, []).append(replica)
    fabrics: dict[str, list[_Candidate]] = {}
    for node in ordered:
        if not _usable(node, model, profile, request, sizes, headroom) or node.id in taken:
            continue
        candidate = _candidate(node, profile, on_node.get(node.id, []), leaving, catalog, launches)
        if candidate is not None:
            for fabric in node.fabrics:
                fabrics.setdefault(fabric, []).append(candidate)
    options = []
    for fabric, candidates in fabrics.items():
        if len(candidates) >= profile.nodes:
            chosen = sorted(candidates, key=lambda c: c.rank(name))[: profile.nodes]
            cost = (sum(len(c.moves) for c in chosen), sum(len(c.waiting) for c in chosen), fabric)
            options.append((cost, fabric, chosen))
    for _, fabric, chosen in sorted(options, key=lambda option: option[0])[:FABRICS_TRIED]:
        nodes = tuple(sorted(c.node.id for c in chosen))
        moving = [replica for c in chosen for replica in c.moves]
        waiting = tuple(sorted(i for c in chosen for i in c.waiting))
        if not moving:
            return Room(fabric, nodes, (), (), waiting) if waiting else None
        replacements = _move(ordered, state, catalog, placements, generations, moving, nodes, sizes, headroom)
        if replacements is not None:
            moves = tuple(
                Move(r.replaces, r.id, name, request.index, fabric, nodes)  # type: ignore[arg-type]
                for r in replacements
            )
            return Room(fabric, nodes, tuple(replacements), moves, waiting)
    return None


def _usable(
    node: NodeState,
    model: Model,
    profile: Profile,
    request: Request,
    sizes: Mapping[str, int],
    headroom: float,
) -> bool:
    """Whether ``node`` could take a shard of the replica, GPUs and ports aside."""
    return (
        node.ready
        and bool(node.fabrics)
        and node.id not in request.avoid
        and profile.engine in node.engines
        and node.lacks(model, profile) is None
        and node.disk.fits_all(needs_of(model, sizes), headroom)
    )


def _candidate(
    node: NodeState,
    profile: Profile,
    replicas: list[Replica],
    leaving: set[str | None],
    catalog: Catalog,
    launches: Mapping[str, object],
) -> _Candidate | None:
    """What must leave ``node`` for a shard of ``profile`` to fit: the fewest single-node replicas, largest
    first; None when even that is not enough."""
    usable = set(node.gpus_with(profile.min_gpu_memory_mib))
    free = set(node.free_gpus(profile.min_gpu_memory_mib))
    ports = node.free_ports
    needed = 2  # a multi-node shard's port, and rank 0's dist-init port

    def release(replica: Replica) -> None:
        nonlocal ports
        shard = next(s for s in replica.shards if s.node_id == node.id)
        free.update(usable & set(shard.gpus))
        ports += sum(node.low <= port <= node.high for port in (shard.port, shard.dist_init_port) if port)

    waiting = sorted(r.id for r in replicas if r.id in leaving)
    for replica in replicas:
        if replica.id in leaving:
            release(replica)
    movable = sorted(
        (r for r in replicas if _movable(r, leaving, catalog, launches)),
        key=lambda r: (-len(usable & set(r.shards[0].gpus)), r.id),
    )
    moves: list[Replica] = []
    while len(free) < profile.gpus_per_node or ports < needed:
        if not movable:
            return None
        moves.append(movable.pop(0))
        release(moves[-1])
    return _Candidate(node, tuple(moves), tuple(waiting))


def _movable(
    replica: Replica, leaving: set[str | None], catalog: Catalog, launches: Mapping[str, object]
) -> bool:
    """A single-node replica running what the catalog asks, not being moved, and not a replacement itself."""
    model = catalog.models.get(replica.model)
    return (
        len(replica.shards) == 1
        and replica.replaces is None
        and replica.id not in leaving
        and replica.id not in launches
        and model is not None
        and model.profile in catalog.profiles
    )


def _move(
    ordered: list[NodeState],
    state: dict[str, NodeState],
    catalog: Catalog,
    placements: list[Replica],
    generations: Mapping[str, int],
    moving: list[Replica],
    room: tuple[str, ...],
    sizes: Mapping[str, int],
    headroom: float,
) -> list[Replica] | None:
    """Place a replacement of each replica in ``moving`` away from ``room``, on a copy of ``state``.

    :returns: the replacements (``state`` and ``ordered`` now hold the copy's claims), or None when one
        has no place (``state`` unchanged).
    """
    trial = {node_id: node.copy() for node_id, node in state.items()}
    trial_order = [trial[node.id] for node in ordered]
    used: dict[str, set[int]] = {}
    for replica in placements:
        used.setdefault(replica.model, set()).add(replica.index)
    replacements: list[Replica] = []
    for replica in moving:
        model = catalog.models[replica.model]
        index = min(set(range(len(used[replica.model]) + 1)) - used[replica.model])
        used[replica.model].add(index)
        generation = generations.get(replica_id(replica.model, index), 0)
        request = Request(index, generation, replaces=replica.id, avoid=frozenset(room))
        profile = catalog.profiles[model.profile]
        placed, left = place(trial_order, trial, replica.model, model, profile, [request], sizes, headroom)
        if left:
            return None
        replacements += placed
    state.update(trial)
    ordered[:] = trial_order
    return replacements
