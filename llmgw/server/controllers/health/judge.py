"""Judging a replica's current attempt: ready, failed (and why), rebuilt after its backoff, or started again.

:func:`judge` is the health controller's step, called by the reconciler for
every replica after the nodes controller looked at the nodes. It reads what
the agents observed and changes the replica only through the state's verbs.
An agent that restarted is not the replica's failure
(:mod:`~llmgw.server.controllers.health.agent_restart`).
"""

from __future__ import annotations

from llmgw.server.controllers.health.agent_restart import left_agent, start_again
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import ReplicaRecord, ReplicaState
from llmgw.wire import ObservedShard
from llmgw.wire.causes import FailureCause

__all__ = ["judge"]

#: the shard states of a shard that serves or will (rank 0 ready, workers running)
UP = ("running", "ready")


def judge(state: ClusterState, record: ReplicaRecord, now: float) -> None:
    """Move ``record`` on from what its shards' agents observed; called once per replica per reconcile."""
    if (left := left_agent(record, state.nodes)) is not None:
        return start_again(state, record, left, now)
    if record.state == ReplicaState.BACKOFF:
        if now >= record.not_before:
            event = f"rebuilding after {record.failures} failures"
            state.start_attempt(record, now, event, renumber=False, reason=None)
        return
    observed: list[ObservedShard | None] = []
    for node_id, key in record.shard_keys():
        node = state.nodes.get(node_id)
        if node is None or node.lost:
            return  # the scheduler moves replicas off lost nodes
        if not node.reported:
            return  # after a server restart: wait for the agent to say what runs
        shard = node.observed.get(key)
        if shard is None and record.sent_revision and node.agent_revision >= record.sent_revision:
            gone = f"shard {key} is gone from {node_id} (its agent restarted?)"
            return state.fail(record, now, FailureCause.SHARD_GONE, gone)
        if shard is not None and shard.state in ("exited", "unhealthy"):
            detail = f": {shard.detail}" if shard.detail else ""
            code = f" with code {shard.exit_code}" if shard.exit_code is not None else ""
            reason = f"shard r{shard.rank} on {node_id} {shard.state}{code}{detail}"
            return state.fail(record, now, shard_cause(shard), reason)
        observed.append(shard)
    if record.state == ReplicaState.READY:
        if any(s is None or s.state not in UP for s in observed):
            state.fail(record, now, FailureCause.SHARD_GONE, "a shard stopped running")
        elif record.ready_since is not None and now - record.ready_since >= state.settings.stable_after:
            state.mark_stable(record)
        return
    if any(s is not None and s.state == "staging" for s in observed):
        return state.note_staging(record, now)
    all_up = all(s is not None and s.state in UP for s in observed)
    if all_up and observed[0] is not None and observed[0].state == "ready":
        state.mark_ready(record, now)
    elif now - record.started_at > (timeout := state.ready_timeout_of(record)):
        state.fail(record, now, FailureCause.READY_TIMEOUT, f"not ready within {timeout:.0f} s")


def shard_cause(shard: ObservedShard) -> FailureCause:
    """The cause of a failed shard: the agent's, or (an agent that predates causes) its state's."""
    if shard.cause is not None:
        return shard.cause
    return FailureCause.UNHEALTHY if shard.state == "unhealthy" else FailureCause.EXITED
