"""The placement controller: one scheduling run, copied out of the cluster so it runs off the event loop.

The reconciler's first half (:func:`llmgw.server.reconciler.begin`) asks
:func:`plan` for a :class:`SchedulePlan`, the server runs it in a worker
thread, and the second half (:func:`~llmgw.server.reconciler.finish`) has
:func:`apply` record its result through the state's verbs.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from llmgw.models import Catalog
from llmgw.scheduler import DEFAULT_HEADROOM, NodeView, Replica, ScheduleResult, schedule
from llmgw.server.state.cluster import ClusterState, where
from llmgw.server.state.records import EventKind, Launch
from llmgw.weights import agreeing_facts

__all__ = ["SchedulePlan", "plan", "apply"]


@attrs.frozen
class SchedulePlan:
    """What one scheduling run needs, copied out of the cluster so it can run off the event loop.

    Every field is immutable: the server runs :meth:`run` in a worker thread
    while syncs go on changing the cluster's nodes.
    """

    nodes: tuple[NodeView, ...]
    catalog: Catalog
    placements: tuple[Replica, ...]
    replace: tuple[str, ...]
    #: outdated replicas to replace where they are (a rollout's surge)
    roll: tuple[str, ...] = ()
    #: what each outdated replica runs, so the scheduler keeps it until it is replaced
    launches: tuple[tuple[str, Launch], ...] = ()
    #: distributable source -> bytes of a complete copy (its manifest's), for disk room
    sizes: tuple[tuple[str, int], ...] = ()
    #: the share of a model's size a node keeps free beyond its copy
    headroom: float = DEFAULT_HEADROOM

    def run(self) -> ScheduleResult:
        """Schedule (a pure function of the plan); called once, in any thread."""
        launches = {i: (launch.model, launch.profile) for i, launch in self.launches}
        return schedule(
            list(self.nodes),
            self.catalog,
            list(self.placements),
            replace=self.replace,
            roll=self.roll,
            launches=launches,
            sizes=dict(self.sizes),
            headroom=self.headroom,
        )


def plan(state: ClusterState, now: float, moves: list[str], rolls: list[str]) -> SchedulePlan | None:
    """The schedule to run now, or None when nothing the scheduler reads changed.

    ``moves`` are a drain's replicas to move, ``rolls`` a rollout's outdated
    replicas to replace beside themselves; replicas without a place are
    tried again every ``unplaced_retry`` seconds.
    """
    retry = bool(state.unplaced) and now - state.scheduled_at >= state.settings.unplaced_retry
    if not (state.schedule_wanted or moves or rolls or retry):
        return None
    state.note_scheduled(now)
    return SchedulePlan(
        # a node whose seed folder differs from the fleet's manifest does not hold that source
        nodes=tuple(
            attrs.evolve(node.view(), facts=agreeing_facts(node.facts, state.manifests))
            for node in state.nodes.values()
        ),
        catalog=state.scaled_catalog(),
        placements=tuple(record.placement for record in state.replicas.values()),
        replace=tuple(moves),
        roll=tuple(rolls),
        launches=tuple(
            (r.id, r.launch) for r in state.replicas.values() if r.launch is not None and state.is_outdated(r)
        ),
        sizes=tuple((source, m.total_bytes) for source, m in sorted(state.manifests.items())),
        headroom=state.settings.disk_headroom,
    )


def apply(
    state: ClusterState,
    now: float,
    result: ScheduleResult,
    launch_for: Callable[[ClusterState, Replica], Launch | None],
) -> None:
    """Record a schedule's result: replicas removed, placed, placed again; replicas moved to make room for a
    multi-node one; what cannot be placed.

    ``launch_for`` says what a replica placed anew runs (the rollout controller's answer). A moved
    replica's replacement is placed like a drain's: the rollout controller retires the original once
    the replacement is ready, so it leaves the routes before it stops.
    """
    for removal in result.removed:
        if removal.replica.id in state.replicas:
            state.remove(removal.replica.id, now, f"removed: {removal.reason}")
    for move in result.moves:
        state.record_event(now, EventKind.REPLICA, move.replica, move.message)
    for placement in result.placements:
        record = state.replicas.get(placement.id)
        if record is not None and record.placement == placement:
            continue
        if record is None:
            what = f"replacement for {placement.replaces}" if placement.replaces else "placed"
            state.place(placement, launch_for(state, placement), now, what)
        else:
            state.start_attempt(record, now, f"placed again on {where(placement)}", placement=placement)
    if result.unplaced != state.unplaced:
        state.note_unplaced(result.unplaced, now)
