"""The scheduler: which nodes, GPUs and ports each replica of the catalog gets."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import attrs

from llmgw.models import Catalog, Model, Profile
from llmgw.scheduler._disk import DEFAULT_HEADROOM, Need, format_bytes, needs_of
from llmgw.scheduler._explain import explain_unplaced
from llmgw.scheduler._pick import Request, place
from llmgw.scheduler._records import Move, NodeView, Removal, Replica, ScheduleResult, Unplaced, replica_id
from llmgw.scheduler._room import make_room
from llmgw.scheduler._state import NodeState
from llmgw.weights import is_distributable

__all__ = ["schedule"]


def schedule(
    nodes: Iterable[NodeView],
    catalog: Catalog,
    placements: Iterable[Replica],
    *,
    replace: Iterable[str] = (),
    roll: Iterable[str] = (),
    launches: Mapping[str, tuple[Model, Profile]] | None = None,
    sizes: Mapping[str, int] | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> ScheduleResult:
    """Decide where every replica of ``catalog`` runs, starting from ``placements``.

    Called by the server's reconciler whenever the catalog, a node or a
    placement changes. Pure and deterministic: the same inputs, in any order,
    give the same result, and feeding a result's placements back in changes
    nothing. Existing replicas stay where they are unless their model left the
    catalog or was scaled down (highest index first), their profile's shape
    changed, or a node they run on is lost, unknown, or lacks the engine or the
    model source; new ones go to ready nodes with the engine, the source and
    enough free GPUs, spread over nodes (fewest replicas of the model first,
    then fewest used GPUs, then node id), multi-node ones on one fabric.

    :param nodes: every node the server knows, with its state and port range.
    :param catalog: the desired state.
    :param placements: the replicas placed so far (the previous result's).
    :param replace: ids of replicas to move (drain): each gets a replacement
        away from its nodes, marked ``replaces=<id>``, that does not count
        toward the model's replicas until the caller removes the original.
        Ids not placed, or already being replaced, are ignored.
    :param roll: ids of replicas to replace where they are (a rollout): as
        ``replace``, but the replacement may share the original's nodes.
    :param launches: replica id -> the model and profile entries it runs, for
        placed replicas that run another command than the catalog asks (a
        rollout under way): such a replica is checked against what it runs
        (its shape, engine, source), so it stays until it is replaced.
    :param sizes: distributable source -> bytes of a complete copy (its
        manifest's): a node without the copy is chosen only when its models
        directory has room for it plus ``headroom`` × the size, counting
        copies it could evict (:mod:`llmgw.scheduler._disk`). A source not in
        here (no manifest yet) is placed without that check.
    :param headroom: the share of a model's size kept free beyond its copy.
    :returns: the placements to run, the replicas that found no place with
        the reason, and the input replicas dropped with the reason.
    :raises ValueError: when two nodes have the same id.
    """
    views = sorted(nodes, key=lambda view: view.node_id)
    placements = list(placements)
    launches = launches or {}
    sizes = sizes or {}
    copying = _copying(views, catalog, placements, launches)
    state: dict[str, NodeState] = {}
    for view in views:
        if view.node_id in state:
            raise ValueError(f"node {view.node_id} appears twice")
        state[view.node_id] = NodeState(view, copying)
    ordered = list(state.values())
    members = Counter(fabric for node in ordered if node.ready for fabric in node.fabrics)
    for node in ordered:
        node.shared_fabric = any(members[fabric] > 1 for fabric in node.fabrics)

    kept, removed, generations = _keep(state, catalog, placements, launches, sizes)
    removed += _scale_down(state, catalog, kept)
    moves = [(i, True) for i in sorted(set(replace))] + [(i, False) for i in sorted(set(roll) - set(replace))]
    requests = _requests(catalog, kept, generations, moves)

    new: list[Replica] = []
    unplaced: list[Unplaced] = []
    failed: list[tuple[str, Model, Profile, list[Request]]] = []
    for model_name, profile, group in _ordered(catalog, requests):
        model = catalog.models[model_name]
        if profile is None:
            reason = f"profile {model.profile} is not in the catalog"
            unplaced += [Unplaced(model_name, request.index, reason, request.replaces) for request in group]
            continue
        for run in _by_avoid(group):
            placed, left = place(ordered, state, model_name, model, profile, run, sizes, headroom)
            new += placed
            if left:
                failed.append((model_name, model, profile, left))
    # multi-node replicas left over: moving single-node replicas off a fabric's nodes may make room
    taken: set[str] = set()
    room_moves: list[Move] = []
    for position, (model_name, model, profile, left) in enumerate(failed):
        still: list[Request] = []
        for request in left:
            room = None
            if profile.nodes > 1:
                target = (model_name, model, profile, request)
                placements = [*kept.values(), *new]
                args = (catalog, placements, launches, generations, target, sizes, headroom, frozenset(taken))
                room = make_room(ordered, state, *args)
            if room is None:
                still.append(request)
                continue
            taken.update(room.nodes)
            new += room.replacements
            room_moves += room.moves
            unplaced.append(Unplaced(model_name, request.index, room.reason, request.replaces))
        failed[position] = (model_name, model, profile, still)
    # Explained once everything is placed, so the reason describes the nodes as the result leaves them.
    for model_name, model, profile, left in failed:
        if not left:
            continue
        weights = (model_name, sizes.get(model.source), headroom)
        needs = needs_of(model, sizes)
        reason = explain_unplaced(ordered, profile, model.source, left[0].avoid, weights, needs, model)
        unplaced += [Unplaced(model_name, request.index, reason, request.replaces) for request in left]

    return ScheduleResult(
        placements=sorted([*kept.values(), *new], key=lambda replica: replica.id),
        unplaced=sorted(unplaced, key=lambda item: (item.model, item.index)),
        removed=sorted(removed, key=lambda removal: removal.replica.id),
        moves=room_moves,
    )


def _keep(
    state: dict[str, NodeState],
    catalog: Catalog,
    placements: Iterable[Replica],
    launches: Mapping[str, tuple[Model, Profile]],
    sizes: Mapping[str, int],
) -> tuple[dict[str, Replica], list[Removal], dict[str, int]]:
    """Check every placed replica, in id order, and claim the resources of those that stay.

    A replica that stays uses, on each of its nodes, the source it runs and
    the one the catalog asks for (a rollout brings that there): their copies
    are not evictable, and what they lack is reserved.
    """
    kept: dict[str, Replica] = {}
    removed: list[Removal] = []
    generations: dict[str, int] = {}
    for replica in sorted(placements, key=lambda replica: (replica.id, replica.generation)):
        reason = _problem(replica, state, catalog, launches.get(replica.id))
        if reason is None and replica.id in kept:
            reason = f"another replica has the id {replica.id}"
        if reason is None:
            reason = next(
                filter(None, (state[shard.node_id].conflict(shard) for shard in replica.shards)), None
            )
        if reason is None:
            reason = _no_room(replica, state, _source_of(replica, catalog, launches), sizes)
        if reason is not None:
            removed.append(Removal(replica, reason))
            generations[replica.id] = max(generations.get(replica.id, 0), replica.generation + 1)
            continue
        kept[replica.id] = replica
        running = _needs_of(replica, catalog, launches, sizes)
        for shard in replica.shards:
            node = state[shard.node_id]
            node.claim(shard, replica.id, replica.model)
            node.disk.use_all(running)
    # then what rollouts will bring: reserved after every copy under way kept its place
    for replica in kept.values():
        wanted = _needs_of(replica, catalog, {}, sizes)
        for node_id in replica.node_ids:
            state[node_id].disk.use_all(wanted)
    for replica in list(kept.values()):
        original = kept.get(replica.replaces) if replica.replaces else None
        if replica.replaces and (original is None or original.model != replica.model):
            kept[replica.id] = attrs.evolve(replica, replaces=None)
    return kept, removed, generations


def _problem(
    replica: Replica,
    state: dict[str, NodeState],
    catalog: Catalog,
    launch: tuple[Model, Profile] | None = None,
) -> str | None:
    """Why ``replica`` cannot stay where it is, or None when it can (``launch``: what it runs, if not the
    catalog's)."""
    model = catalog.models.get(replica.model)
    if model is None:
        return f"model {replica.model} is no longer in the catalog"
    if launch is not None:
        model, profile = launch
    elif (found := catalog.profiles.get(model.profile)) is not None:
        profile = found
    else:
        return f"profile {model.profile} is not in the catalog"
    if replica.id != replica_id(replica.model, replica.index):
        return f"its id should be {replica_id(replica.model, replica.index)}"
    shape = (len(replica.shards), {len(shard.gpus) for shard in replica.shards})
    if shape != (profile.nodes, {profile.gpus_per_node}) or len(set(replica.node_ids)) != profile.nodes:
        return (
            f"profile {model.profile} now needs {profile.nodes} node(s) "
            f"with {profile.gpus_per_node} GPU(s) each"
        )
    if [shard.rank for shard in replica.shards] != list(range(profile.nodes)):
        return "its shards are not ranked 0.." + str(profile.nodes - 1)
    if profile.nodes > 1 and replica.fabric is None:
        return "a multi-node replica needs a fabric"
    for shard in replica.shards:
        node = state.get(shard.node_id)
        if node is None:
            return f"node {shard.node_id} is not known"
        if node.state == "lost":
            return f"node {node.id} is lost"
        if profile.engine not in node.engines:
            return f"node {node.id} lacks engine {profile.engine}"
        missing = node.lacks(model, profile)
        if missing is not None:
            return f"node {node.id} lacks {missing}"
        if profile.nodes > 1 and replica.fabric not in node.fabrics:
            return f"node {node.id} is not on fabric {replica.fabric}"
        if shard.port == shard.dist_init_port:
            return f"its port {shard.port} on {node.id} is also its dist-init port"
        for gpu in shard.gpus:
            memory = node.gpu_memory.get(gpu)
            if profile.min_gpu_memory_mib and memory is not None and memory < profile.min_gpu_memory_mib:
                return (
                    f"GPU {gpu} on {node.id} has {memory} MiB, "
                    f"profile {model.profile} needs {profile.min_gpu_memory_mib}"
                )
    return None


def _no_room(
    replica: Replica, state: dict[str, NodeState], source: str | None, sizes: Mapping[str, int]
) -> str | None:
    """Why a node of ``replica`` cannot take the copy it makes (placed before its size was known); or None.

    Checked without headroom: a copy under way keeps its place while the disk can take it at all.
    """
    size = sizes.get(source) if source is not None else None
    if size is None:
        return None
    for node_id in replica.node_ids:
        disk = state[node_id].disk
        if not disk.fits(source, size, 0.0):  # type: ignore[arg-type]
            unused = f", {format_bytes(disk.unused_bytes)} in unused copies" if disk.unused_bytes else ""
            return (
                f"node {node_id} has no disk room for the {format_bytes(size)} copy of {source} "
                f"({format_bytes(disk.free or 0)} free{unused})"
            )
    return None


def _source_of(
    replica: Replica, catalog: Catalog, launches: Mapping[str, tuple[Model, Profile]]
) -> str | None:
    """The source ``replica`` runs: its launch's, else the catalog's; None when its model left the catalog."""
    launch = launches.get(replica.id)
    if launch is not None:
        return launch[0].source
    model = catalog.models.get(replica.model)
    return model.source if model is not None else None


def _needs_of(
    replica: Replica,
    catalog: Catalog,
    launches: Mapping[str, tuple[Model, Profile]],
    sizes: Mapping[str, int],
) -> tuple[Need, ...]:
    """The sources ``replica`` takes on its nodes (its launch's model, else the catalog's): weights and
    LoRA adapters (:func:`~llmgw.scheduler._disk.needs_of`); none when its model left the catalog."""
    launch = launches.get(replica.id)
    model = launch[0] if launch is not None else catalog.models.get(replica.model)
    return needs_of(model, sizes) if model is not None else ()


def _copying(
    views: list[NodeView],
    catalog: Catalog,
    placements: list[Replica],
    launches: Mapping[str, tuple[Model, Profile]],
) -> frozenset[str]:
    """Distributable sources a placed replica runs on a node without a complete copy (being copied)."""
    held = {
        view.node_id: {*view.facts.model_sources, *(c.source for c in view.facts.model_copies if c.complete)}
        for view in views
    }
    out: set[str] = set()
    for replica in placements:
        source = _source_of(replica, catalog, launches)
        if source is not None and is_distributable(source) and source not in out:
            if any(source not in held.get(node_id, ()) for node_id in replica.node_ids):
                out.add(source)
    return frozenset(out)


def _scale_down(state: dict[str, NodeState], catalog: Catalog, kept: dict[str, Replica]) -> list[Removal]:
    """Drop the highest-index replicas of models that have more than the catalog asks for."""
    by_model: dict[str, list[Replica]] = {}
    for replica in kept.values():
        if replica.replaces is None:
            by_model.setdefault(replica.model, []).append(replica)
    removed: list[Removal] = []
    for name, replicas in by_model.items():
        desired = catalog.models[name].replicas
        for replica in sorted(replicas, key=lambda replica: replica.index)[desired:]:
            removed.append(Removal(replica, f"model {name} is scaled down to {desired} replica(s)"))
    gone = {removal.replica.id for removal in removed}
    pending = sorted((r for r in kept.values() if r.replaces is not None), key=lambda r: r.id)
    while moved := [r for r in pending if r.replaces in gone and r.id not in gone]:
        for replica in moved:
            removed.append(Removal(replica, f"the replica it replaces, {replica.replaces}, is scaled down"))
            gone.add(replica.id)
    for removal in removed:
        replica = kept.pop(removal.replica.id)
        for shard in replica.shards:
            state[shard.node_id].release(shard, replica.model)
    return removed


def _requests(
    catalog: Catalog, kept: dict[str, Replica], generations: dict[str, int], moves: list[tuple[str, bool]]
) -> dict[str, list[Request]]:
    """The replicas to place, per model: missing slots first (lowest index first), then replacements."""
    used: dict[str, set[int]] = {}
    counted: dict[str, int] = {}
    for replica in kept.values():
        used.setdefault(replica.model, set()).add(replica.index)
        if replica.replaces is None:
            counted[replica.model] = counted.get(replica.model, 0) + 1

    def free_indices(model: str):
        index = 0
        while True:
            if index not in used.setdefault(model, set()):
                used[model].add(index)
                yield index
            index += 1

    requests: dict[str, list[Request]] = {}
    for name in sorted(catalog.models):
        missing = catalog.models[name].replicas - counted.get(name, 0)
        slots = free_indices(name)
        for _ in range(missing):
            index = next(slots)
            generation = generations.get(replica_id(name, index), 0)
            requests.setdefault(name, []).append(Request(index, generation))
    moving = {replica.replaces for replica in kept.values()}
    for original_id, away in moves:
        original = kept.get(original_id)
        if original is None or original_id in moving:
            continue
        avoid = frozenset(original.node_ids) if away else frozenset()
        index = next(free_indices(original.model))
        generation = generations.get(replica_id(original.model, index), 0)
        requests.setdefault(original.model, []).append(
            Request(index, generation, replaces=original_id, avoid=avoid)
        )
    return requests


def _ordered(
    catalog: Catalog, requests: dict[str, list[Request]]
) -> list[tuple[str, Profile | None, list[Request]]]:
    """Models with replicas to place, largest first (multi-node, then more GPUs), then by name."""

    def size(item: tuple[str, Profile | None, list[Request]]) -> tuple[int, int, str]:
        name, profile, _ = item
        if profile is None:
            return (0, 0, name)
        return (-profile.nodes * max(profile.gpus_per_node, 1), -profile.nodes, name)

    items = [
        (name, catalog.profiles.get(catalog.models[name].profile), group) for name, group in requests.items()
    ]
    return sorted(items, key=size)


def _by_avoid(group: list[Request]) -> list[list[Request]]:
    """Split a model's requests into runs that avoid the same nodes, in order."""
    runs: list[list[Request]] = []
    for request in group:
        if runs and runs[-1][0].avoid == request.avoid:
            runs[-1].append(request)
        else:
            runs.append([request])
    return runs
