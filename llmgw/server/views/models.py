"""``GET /v1/admin/models`` (``llmgw ctl models``): each catalog model's weights and where they are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.weights import differs, holds, is_distributable
from llmgw.wire import CopyProgress, ModelList, ModelStatus, StagingProgress

if TYPE_CHECKING:
    from llmgw.server.state.cluster import ClusterState, NodeRecord

__all__ = ["model_list", "staging_progress"]


def model_list(cluster: ClusterState) -> ModelList:
    """Every model of the catalog in force: source, pinned revision, size, digest, holders, copies under way;
    each model's LoRA adapters follow it, the same for each (``adapter_of`` names the model).

    Called for every ``GET /v1/admin/models``; reads what agents last
    reported (lost nodes left out). A holder has a complete, verified copy
    of the stored manifest's digest (or the seed with it, or the path of a
    plain source); a copy under way is a partial copy of that digest; a node
    whose seed folder holds other files is listed as differing.
    """
    out = []
    reported = staging_progress(cluster)
    nodes = sorted((n for n in cluster.nodes.values() if not n.lost), key=lambda n: n.node_id)
    for name, model in sorted(cluster.catalog.models.items()):
        out.append(_status(cluster, nodes, reported, name, model.source))
        for adapter, source in sorted(model.adapters.items()):
            out.append(_status(cluster, nodes, reported, adapter, source, adapter_of=name))
    return ModelList(tuple(out))


def _status(
    cluster: ClusterState,
    nodes: list[NodeRecord],
    reported: dict[tuple[str, str], StagingProgress | None],
    name: str,
    source: str,
    adapter_of: str | None = None,
) -> ModelStatus:
    """The weights of one source: a model's (``name``), or adapter ``name``'s of model ``adapter_of``."""
    manifest = cluster.manifests.get(source)
    holders: list[str] = []
    copying: list[CopyProgress] = []
    differing: list[str] = []
    for node in nodes:
        facts = node.facts
        if differs(facts, source, manifest):
            differing.append(node.node_id)
        if holds(facts, source, manifest):
            holders.append(node.node_id)
            continue
        if (node.node_id, source) in reported:  # a staging shard says (None: it does not know now)
            if (staged := reported[node.node_id, source]) is not None:
                copying.append(CopyProgress(node.node_id, staged.bytes_present, staged.bytes_total))
            continue
        for copy in facts.model_copies:
            other = manifest is not None and copy.digest != manifest.digest
            if copy.seed or copy.source != source or other:
                continue
            if not copy.complete:
                copying.append(CopyProgress(node.node_id, copy.bytes_present, copy.bytes_total))
            break
    return ModelStatus(
        name=name,
        source=source,
        # a hub source's manifest names the commit its revision was pinned to, when it has one
        revision=getattr(manifest, "revision", None) or None,
        size=manifest.total_bytes if manifest is not None else None,
        digest=manifest.digest if manifest is not None else None,
        holders=holders,
        copying=copying,
        differing=differing,
        distributable=is_distributable(source),
        adapter_of=adapter_of,
    )


def staging_progress(cluster: ClusterState) -> dict[tuple[str, str], StagingProgress | None]:
    """(node, source) -> the bytes of the copy of ``source`` a staging shard on that live node last reported.

    The one source of copy progress for ``ctl models`` and ``ctl replicas``;
    None while the shard stages with no byte count (checking, waiting), or
    when its node stopped syncing (dropped by :mod:`llmgw.server.controllers.nodes.lost`).
    """
    out: dict[tuple[str, str], StagingProgress | None] = {}
    for node in cluster.nodes.values():
        for shard in node.observed.values() if not node.lost else ():
            record = cluster.replicas.get(shard.replica_id)
            if shard.state != "staging" or record is None:
                continue
            launch = record.launch
            model = launch.model if launch is not None else cluster.catalog.models.get(record.placement.model)
            if model is not None and out.get((node.node_id, model.source)) is None:
                out[(node.node_id, model.source)] = shard.staged
    return out
