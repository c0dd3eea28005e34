"""One scheduling run, copied out of the cluster so it can run off the event loop.

:meth:`llmgw.server.state.cluster.Cluster.begin` makes a :class:`SchedulePlan`, the
server runs it in a worker thread, and :meth:`~llmgw.server.state.cluster.Cluster.finish`
applies its result.
"""

from __future__ import annotations

import attrs

from llmgw.models import Catalog
from llmgw.scheduler import DEFAULT_HEADROOM, NodeView, Replica, ScheduleResult, schedule
from llmgw.server.state.records import Launch

__all__ = ["SchedulePlan"]


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
