"""Draining a node: its replicas move one at a time, each replacement ready before its original stops.

:func:`drain_moves` is called by the reconciler (:func:`llmgw.server.reconciler.begin`)
on every reconcile; the moves it returns are the scheduler's ``replace=``.
"""

from __future__ import annotations

from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import ReplicaRecord, ReplicaState

__all__ = ["drain_moves"]


def drain_moves(cluster: ClusterState, now: float) -> list[str]:
    """Replica ids to move off draining nodes now: one at a time per node.

    Retires each original whose replacement is ready, and ends the drain of
    a node with no replica left (it stays cordoned).
    """
    moves = []
    replicas = cluster.replicas
    replacing = {r.placement.replaces for r in replicas.values() if r.placement.replaces}
    for node in sorted(cluster.nodes.values(), key=lambda n: n.node_id):
        if not node.draining:
            continue
        on_node = sorted(
            r.id
            for r in replicas.values()
            if node.node_id in r.placement.node_ids and not r.placement.replaces
        )
        for replica_id in on_node:
            replacement = _replacement_of(cluster, replica_id)
            if replacement is not None and replacement.state == ReplicaState.READY:
                message = f"moved: {replacement.id} is ready, stopping the original"
                cluster.retire(replica_id, replacement, now, message)
        on_node = [i for i in on_node if i in replicas]
        if not on_node:
            if not any(node.node_id in r.placement.node_ids for r in replicas.values()):
                cluster.end_drain(node.node_id, now)
            continue
        if not any(i in replacing for i in on_node):
            moves.append(on_node[0])
    return moves


def _replacement_of(cluster: ClusterState, replica_id: str) -> ReplicaRecord | None:
    return next((r for r in cluster.replicas.values() if r.placement.replaces == replica_id), None)
