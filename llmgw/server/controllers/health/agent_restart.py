"""An agent restarted on purpose is not a replica failure.

An agent's shards may end with it: with ``orphan_grace = 0`` its launchers end
their process groups when it exits, and a new agent ends the groups it cannot
adopt (reporting their shards ``exited``). A restarted agent that adopted every
shard its predecessor ran (it reports them all running on its first sync)
restarted nothing, and nothing starts again. That is no fault of the replicas, so it must not cost them
a backoff, a failure, or (for a rollout's replacement) a step towards pausing
the rollout. The server learns of a restart two ways (the state records
them as syncs come, :meth:`ClusterState.sync <llmgw.server.state.cluster.ClusterState.sync>`):

- the agent says it is leaving: on SIGTERM (a planned restart, an upgrade) it
  sends a last sync with ``leaving`` set *before* it stops any shard, so the
  replicas leave the gateway's routes before their engines get SIGTERM;
- a sync carries another ``instance`` than the node's last one (the agent was
  killed and started again, or left without a word).

Either way every replica with a shard on that node whose attempt started
before is started again at once under a new attempt (same placement; if the
agent never comes back the node is declared lost and they move), without
counting a failure. When an agent is killed without a farewell, a multi-node
replica's rank 0 on another node may notice its lost worker (and exit) before
the new agent's first sync: a failure of a replica with a shard on that node
between the old agent's last sync and the new one's first is taken back (it
is rebuilt at once, its counts as before). A real failure in that window is
taken back too: the server cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import NodeRecord, ReplicaRecord, ReplicaState
from llmgw.wire.causes import FailureCause

__all__ = ["left_agent", "start_again"]



def left_agent(record: ReplicaRecord, nodes: Mapping[str, NodeRecord]) -> tuple[str, bool] | None:
    """The node of ``record`` whose agent left or restarted since its attempt started (or since it
    last failed, when that failure came while the agent was gone), and whether to take that failure
    back; None when no agent of its nodes did. Called by the reconciler for every replica."""
    for node_id in record.placement.node_ids:
        node = nodes.get(node_id)
        if node is None or node.agent_left_at is None:
            continue
        failed = record.failed_at
        if failed is not None and node.agent_gone_since < failed <= node.agent_left_at:
            return node_id, True
        if node.agent_left_at > record.started_at and record.state != ReplicaState.BACKOFF:
            return node_id, False
    for node_id, key in record.shard_keys() if record.state != ReplicaState.BACKOFF else ():
        # the old agent may have started this attempt's shard after its farewell: the new one ended it
        node = nodes.get(node_id)
        shard = node.observed.get(key) if node is not None else None
        if (
            shard is not None
            and shard.state == "exited"
            and shard.cause == FailureCause.PREVIOUS_AGENT
            and node.agent_instance_since > record.started_at
        ):
            return node_id, False
    return None


def start_again(state: ClusterState, record: ReplicaRecord, left: tuple[str, bool], now: float) -> None:
    """Start ``record`` again under a new attempt where it is: the agent of a node ended its shards.

    Called by the health controller in place of a failure; counts no failure and sets no backoff.
    ``left`` is what :func:`left_agent` said: the node, and whether to take back the failure
    that its agent's going caused.
    """
    node_id, take_back = left
    how = "is stopping" if state.nodes[node_id].agent_leaving else "restarted"
    reason = f"the agent of {node_id} {how}"
    if take_back:
        how += f"; its failure ({record.reason}) is taken back"
        state.take_back(record)
    record_event = f"starting again: the agent of {node_id} {how} (not counted as a failure)"
    state.start_attempt(record, now, record_event, reason=reason, forget_failure=True)
