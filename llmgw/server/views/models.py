"""``GET /v1/admin/models`` (``llmgw ctl models``): each catalog model's weights and where they are."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.weights import is_distributable
from llmgw.wire import CopyProgress, ModelList, ModelStatus

if TYPE_CHECKING:
    from llmgw.server.state.cluster import ClusterState

__all__ = ["model_list"]


def model_list(cluster: ClusterState) -> ModelList:
    """Every model of the catalog in force: source, pinned revision, size, digest, holders, copies under way.

    Called for every ``GET /v1/admin/models``; reads what agents last
    reported (lost nodes left out). A holder has a complete, verified copy
    (or the seed, or the path of a plain source); a copy under way is a
    partial copy of the stored manifest's digest.
    """
    out = []
    nodes = sorted((n for n in cluster.nodes.values() if not n.lost), key=lambda n: n.node_id)
    for name, model in sorted(cluster.catalog.models.items()):
        source = model.source
        manifest = cluster.manifests.get(source)
        holders: list[str] = []
        copying: list[CopyProgress] = []
        for node in nodes:
            facts = node.facts
            if source in facts.model_sources:
                holders.append(node.node_id)
                continue
            for copy in facts.model_copies:
                if copy.source != source or (manifest is not None and copy.digest != manifest.digest):
                    continue
                if copy.complete:
                    holders.append(node.node_id)
                else:
                    copying.append(CopyProgress(node.node_id, copy.bytes_present, copy.bytes_total))
                break
        out.append(
            ModelStatus(
                name=name,
                source=source,
                # a hub source's manifest names the commit its revision was pinned to, when it has one
                revision=getattr(manifest, "revision", None) or None,
                size=manifest.total_bytes if manifest is not None else None,
                digest=manifest.digest if manifest is not None else None,
                holders=holders,
                copying=copying,
                distributable=is_distributable(source),
            )
        )
    return ModelList(tuple(out))
