"""``ctl autoscale``: each autoscaled model as the autoscaler controller last left it."""

from __future__ import annotations

from llmgw.server.state.autoscale import ScaleCause
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import ReplicaRecord
from llmgw.wire import AutoscaleList, AutoscaleSignal, AutoscaleStatus

__all__ = ["autoscale_status"]


def autoscale_status(state: ClusterState, now: float, model: str | None = None) -> AutoscaleList:
    """Every autoscaled model (or ``model`` only): replicas, desired, each signal against its target, the
    last decision and when the next may change the count."""
    book = state.autoscale
    by_model: dict[str, list[ReplicaRecord]] = {}
    for record in state.replicas.values():
        by_model.setdefault(record.placement.model, []).append(record)
    out = []
    for name, entry in sorted(state.catalog.models.items()):
        auto = entry.autoscale
        if auto is None or (model is not None and name != model):
            continue
        records = [r for r in by_model.get(name, []) if r.placement.replaces is None]
        memory = book.memory(name, entry, (r.placement for r in records))
        ready, values = book.signals(auto.target, records, now, name)
        signals = tuple(
            AutoscaleSignal(key, goal, values.get(key)) for key, goal in auto.target.signals().items()
        )
        last = memory.last
        waits = [memory.changed_at + auto.cooldown]
        if last is not None and last.cause == ScaleCause.STABILIZING and memory.low_since is not None:
            waits.append(memory.low_since + auto.scale_down_after)
        next_at = max(waits)
        demand = book.demand.get(name) if auto.min == 0 else None
        out.append(
            AutoscaleStatus(
                model=name,
                replicas=len(records),
                ready=ready,
                desired=min(max(memory.desired, auto.min), auto.max),
                min=auto.min,
                max=auto.max,
                signals=signals,
                direction=last.direction.value if last else None,
                cause=last.cause.value if last else None,
                decided_at=last.at if last else None,
                reason=last.describe() if last else None,
                changed=memory.last_change.describe() if memory.last_change else None,
                changed_at=memory.last_change.at if memory.last_change else None,
                next_at=next_at if next_at > now else None,
                idle_after=entry.idle_after,
                last_request_at=demand.last_request if demand is not None else None,
                held=demand.held if demand is not None else 0,
            )
        )
    return AutoscaleList(tuple(out))
