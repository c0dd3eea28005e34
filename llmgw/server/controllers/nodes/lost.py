"""Declaring nodes lost: certificates that expired, and nodes silent for ``lost_after`` (mass silence aside).

:func:`detect_lost` is the nodes controller's first step, called by the
reconciler before the replicas are judged; the mass-silence judgement is
:meth:`SilenceWatch.judge <llmgw.server.state.silence.SilenceWatch.judge>` (the episode is kept in the state).
"""

from __future__ import annotations

from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import EventKind

__all__ = ["STALE_PROGRESS", "detect_lost"]

#: seconds without a sync after which a node's staging progress (bytes, rate, ETA) is no longer shown
STALE_PROGRESS = 10.0


def detect_lost(state: ClusterState, now: float) -> None:
    """Declare lost the nodes silent for ``lost_after``, unless too many went silent at once.

    A node whose recorded certificate expired is lost at once; the rest is
    :meth:`SilenceWatch.judge`. An operator may declare spared nodes lost
    (``ctl nodes lost``), which does not end the episode. The staging progress
    of a node lost, or silent for :data:`STALE_PROGRESS`, is dropped.
    """
    for node in list(state.nodes.values()):
        if not node.lost and node.cert_not_after and now >= node.cert_not_after:
            state.fence_node(node.node_id, f"its certificate {node.cert_serial or 0:x} expired", now)
    limit = state.settings.lost_after
    verdict = state.silence.judge(state.nodes.values(), limit, state.settings.max_lost_fraction, now)
    for message in verdict.messages:
        state.record_event(now, EventKind.CLUSTER, "nodes", message)
    for node_id, seconds in verdict.lost:
        state.declare_lost(node_id, now, f"lost: no sync for {seconds:.0f} s (limit {limit:.0f} s)")
    for node in list(state.nodes.values()):  # a staging shard reports every PROGRESS_EVERY: silent is stale
        if node.lost or now - node.last_seen > STALE_PROGRESS:
            why = f"no progress known: {node.node_id} has not synced for over {STALE_PROGRESS:.0f} s"
            state.forget_progress(node.node_id, why)
