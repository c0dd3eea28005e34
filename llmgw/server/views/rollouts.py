"""``ctl rollout status``: each model's rollout as the rollout controller last left it."""

from __future__ import annotations

from llmgw.scheduler import format_bytes
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import ReplicaRecord, ReplicaState
from llmgw.wire import RolloutList, RolloutStatus

__all__ = ["rollout_status", "staging_note"]


def rollout_status(state: ClusterState, model: str | None = None) -> RolloutList:
    """Each model's rollout (or ``model``'s only) for ``ctl rollout status`` and ``ctl replicas``."""
    book = state.rollouts
    by_model: dict[str, list[ReplicaRecord]] = {name: [] for name in state.catalog.models}
    for record in state.replicas.values():
        if record.placement.model in by_model:
            by_model[record.placement.model].append(record)
    out = []
    for name in sorted(by_model):
        if model is not None and name != model:
            continue
        records = by_model[name]
        counted = [r for r in records if r.placement.replaces is None]
        outdated = sum(state.is_outdated(r) for r in counted)
        updated = sum(r.state == ReplicaState.READY and not state.is_outdated(r) for r in counted)
        pause = book.paused.get(name)
        if pause is not None:
            status, reason = "paused", pause.reason
        elif not outdated:
            status, reason = "done", None
        elif name in book.waiting:
            status, reason = "waiting", book.waiting[name]
        elif name in book.staging:
            status, reason = "staging", staging_note(state, book.staging[name])
        else:
            status, reason = "rolling", None
        rollout = state.catalog.models[name].rollout
        out.append(
            RolloutStatus(
                model=name,
                state=status,
                revision=state.catalog_revision,
                replicas=len(counted),
                updated=updated,
                outdated=outdated,
                max_surge=rollout.max_surge,
                max_unavailable=rollout.max_unavailable,
                reason=reason,
                failure=pause.failure if pause is not None else None,
            )
        )
    return RolloutList(tuple(out))


def staging_note(cluster: ClusterState, stage: dict[str, str]) -> str:
    """What ``ctl rollout status`` says while the new weights are copied ahead: nodes and percent."""
    parts = []
    for node_id, source in sorted(stage.items()):
        node = cluster.nodes.get(node_id)
        copy = None
        if node is not None:
            copy = max(
                (c for c in node.facts.model_copies if c.source == source),
                key=lambda c: c.bytes_present,
                default=None,
            )
        if copy is not None and copy.bytes_total:
            parts.append(f"{node_id} {100 * copy.bytes_present // copy.bytes_total}%")
        else:
            parts.append(f"{node_id} 0%")
    source = next(iter(stage.values()))
    manifest = cluster.manifests.get(source)
    size = f" ({format_bytes(manifest.total_bytes)})" if manifest is not None else ""
    return (
        f"copying the new weights {source}{size} to the outdated replicas' nodes before they are "
        f"restarted or replaced: {', '.join(parts)}; the outdated replicas keep serving"
    )
