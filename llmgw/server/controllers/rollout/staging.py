"""Rollouts stage before they roll: a new distributable source is copied to the outdated nodes first.

When a rollout changes a model's source to a distributable one (``seed://``),
:func:`stage_ahead` asks every node running an outdated replica of the model
to copy the new weights now (``SyncReply.stage_sources``), while the old
replicas go on serving. A replica is restarted in place (``max_unavailable``)
only once each of its nodes holds a verified copy, so it is down for an
engine start, not for a copy. Surge replacements stage themselves, beside
the replicas they replace, and count only once ready.

A node whose disk has no room for the new copy beside the old one (counted
as the scheduler counts, :class:`~llmgw.scheduler.DiskRoom`) is not asked:
its replica is restarted in place as before, and its agent evicts the old
copy, unused by then, to make room.
"""

from __future__ import annotations

from llmgw.scheduler import DiskRoom
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import Launch, NodeRecord, ReplicaRecord
from llmgw.weights import holds, is_distributable

__all__ = ["stage_ahead", "copied_bytes"]


def stage_ahead(
    cluster: ClusterState, wanted: Launch, outdated: list[ReplicaRecord]
) -> tuple[dict[str, str], set[str]]:
    """Where ``wanted``'s weights are copied ahead of the rollout, and which replicas wait for them.

    Called by :func:`~llmgw.server.controllers.rollout.rollouts.step` for each
    model with outdated replicas that serve.

    :returns: node id -> the source it should copy now, and the ids of the
        outdated replicas with a node still copying it (not restarted in place yet).
    """
    source = wanted.model.source
    if not is_distributable(source):
        return {}, set()
    manifest = cluster.manifests.get(source)
    size = manifest.total_bytes if manifest is not None else None
    lacking: dict[str, list[str]] = {}  # node id -> the outdated replicas there waiting for the copy
    for record in outdated:
        launch = cluster.launch_of(record)
        if launch is None or launch.model.source == source:
            continue
        for node_id in record.placement.node_ids:
            node = cluster.nodes.get(node_id)
            if node is not None and not node.lost and not holds(node.facts, source, manifest):
                lacking.setdefault(node_id, []).append(record.id)
    stage: dict[str, str] = {}
    waiting: set[str] = set()
    used = _sources_used(cluster, set(lacking))
    for node_id, records in sorted(lacking.items()):
        if _room_beside(cluster, cluster.nodes[node_id], used.get(node_id, set()), source, size):
            stage[node_id] = source
            waiting.update(records)
    return stage, waiting


def _sources_used(cluster: ClusterState, node_ids: set[str]) -> dict[str, set[str]]:
    """Node id -> the sources the replicas on it run, for ``node_ids`` only (one pass over the replicas)."""
    used: dict[str, set[str]] = {}
    if not node_ids:
        return used
    for record in cluster.replicas.values():
        launch = cluster.launch_of(record)
        if launch is None:
            continue
        for node_id in set(record.placement.node_ids) & node_ids:
            used.setdefault(node_id, set()).add(launch.model.source)
    return used


def _room_beside(
    cluster: ClusterState, node: NodeRecord, used: set[str], source: str, size: int | None
) -> bool:
    """Whether ``node`` can take a copy of ``source`` beside the copies of ``used`` (its replicas run)."""
    disk = DiskRoom(node.facts)
    for running in sorted(used):
        manifest = cluster.manifests.get(running)
        disk.use(running, manifest.total_bytes if manifest is not None else None)
    return disk.fits(source, size, cluster.settings.disk_headroom)


def copied_bytes(cluster: ClusterState, wanted: Launch) -> int:
    """Bytes of ``wanted``'s distributable source in copies on live nodes (0 for other sources).

    A rollout whose copies grow is making progress (its progress_deadline).
    """
    source = wanted.model.source
    if not is_distributable(source):
        return 0
    return sum(
        copy.bytes_present
        for node in cluster.nodes.values()
        if not node.lost
        for copy in node.facts.model_copies
        if copy.source == source and not copy.seed
    )
