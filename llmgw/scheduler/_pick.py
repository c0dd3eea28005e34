"""Picking nodes for one model's replicas: the best pool of nodes for each, one after another."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

import attrs

from llmgw.models import Model, Profile
from llmgw.scheduler._disk import needs_of
from llmgw.scheduler._records import Replica, Shard, replica_id
from llmgw.scheduler._state import NodeState

__all__ = ["Request", "place"]

_Entry = tuple[tuple[int, int, int, int, str], str]


@attrs.frozen
class Request:
    """One replica to place: its slot, and what it moves when it is a replacement."""

    index: int
    generation: int = 0
    replaces: str | None = None
    avoid: frozenset[str] = frozenset()


def place(
    ordered: list[NodeState],
    state: dict[str, NodeState],
    name: str,
    model: Model,
    profile: Profile,
    requests: list[Request],
    sizes: Mapping[str, int],
    headroom: float,
) -> tuple[list[Replica], list[Request]]:
    """Place ``requests`` (replicas of one model avoiding the same nodes) one by one.

    :returns: the replicas placed, and the requests left when no nodes were left for them.
    """
    wanted, gpus, memory = profile.nodes, profile.gpus_per_node, profile.min_gpu_memory_mib
    ports = 1 if wanted == 1 else 2
    avoid = requests[0].avoid

    needs = needs_of(model, sizes)  # its weights and its adapters' sources

    def fits(node: NodeState) -> bool:
        return node.fits(gpus, memory, ports) and node.disk.fits_all(needs, headroom)

    def key(node: NodeState) -> tuple[int, int, int, int, str]:
        # a node holding the weights first; the others get a copy (staging) when none is left
        return node.key(name, holds=model.source in node.sources, pack=wanted == 1)

    pools: dict[str | None, list[_Entry]] = {}
    for node in ordered:
        if (
            not node.ready
            or node.id in avoid
            or profile.engine not in node.engines
            or node.lacks(model, profile) is not None
            or not fits(node)
        ):
            continue
        for pool in _pools_of(node, wanted):
            pools.setdefault(pool, []).append((key(node), node.id))
    for heap in pools.values():
        heapq.heapify(heap)

    placed: list[Replica] = []
    for position, request in enumerate(requests):
        chosen = _choose(pools, state, key, wanted, fits)
        if chosen is None:
            return placed, requests[position:]
        fabric, members = chosen
        shards = []
        for rank, node in enumerate(members):
            node_ports = node.next_ports(2 if wanted > 1 and rank == 0 else 1)
            shards.append(
                Shard(
                    rank=rank,
                    node_id=node.id,
                    gpus=node.free_gpus(memory)[:gpus],
                    port=node_ports[0],
                    dist_init_port=node_ports[1] if len(node_ports) > 1 else None,
                )
            )
        replica = Replica(
            id=replica_id(name, request.index),
            model=name,
            index=request.index,
            shards=shards,
            fabric=fabric,
            generation=request.generation,
            replaces=request.replaces,
        )
        for shard, node in zip(shards, members, strict=True):
            node.claim(shard, replica.id, name)
            node.disk.use_all(needs)
            if fits(node):
                for pool in _pools_of(node, wanted):
                    if pool in pools:
                        heapq.heappush(pools[pool], (key(node), node.id))
        placed.append(replica)
    return placed, []


def _pools_of(node: NodeState, wanted: int) -> tuple[str | None, ...]:
    """The pools a node is in: one for single-node replicas, one per fabric for multi-node ones."""
    return (None,) if wanted == 1 else node.fabrics


def _choose(
    pools: dict[str | None, list[_Entry]],
    state: dict[str, NodeState],
    key: Callable[[NodeState], tuple[int, int, int, int, str]],
    wanted: int,
    fits: Callable[[NodeState], bool],
) -> tuple[str | None, list[NodeState]] | None:
    """The pool and its ``wanted`` best nodes for the next replica, or None when no pool has enough.

    Pools are compared by the sum of their best nodes' keys, then by name.
    Entries whose key is stale, or whose node no longer fits, are dropped.
    """
    best: tuple[tuple, str | None, list[_Entry]] | None = None
    taken: dict[str | None, list[_Entry]] = {}
    for pool in sorted(pools, key=lambda pool: pool or ""):
        heap = pools[pool]
        entries: list[_Entry] = []
        while heap and len(entries) < wanted:
            entry = heapq.heappop(heap)
            node = state[entry[1]]
            if entry[0] == key(node) and fits(node):
                entries.append(entry)
        taken[pool] = entries
        if len(entries) == wanted:
            score = tuple(sum(entry[0][part] for entry in entries) for part in range(4))
            if best is None or (score, pool or "") < (best[0], best[1] or ""):
                best = (score, pool, entries)
    for pool, entries in taken.items():
        if best is None or pool != best[1]:
            for entry in entries:
                heapq.heappush(pools[pool], entry)
    if best is None:
        return None
    return best[1], [state[entry[1]] for entry in best[2]]
