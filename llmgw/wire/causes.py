"""Failure causes: why a shard ended or a replica failed, one enum from the agent to the metric label.

The agent sets :attr:`ObservedShard.cause <llmgw.wire.ObservedShard>` when a
shard turns ``exited`` or ``unhealthy``; the server records it on the
replica it fails (:class:`~llmgw.server.state.records.ReplicaRecord`), counts
it in ``llmgw_server_replica_failures_total{cause}`` and the agent in
``llmgw_agent_shard_failures_total{cause}``. The label is the member's
value; nothing reads a cause back out of a message. docs/failure-causes.md
says how to add one.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["FailureCause", "SHARD_CAUSES", "structure_cause"]


class FailureCause(enum.StrEnum):
    """Why a shard ended or a replica failed; the value is the metric label and the JSON spelling."""

    #: the engine process exited (its exit code and last log line are the detail)
    EXITED = "exited"
    #: a health check failed, a sidecar ended, or rank 0 was not ready within its timeout
    UNHEALTHY = "unhealthy"
    #: the health check passes but the engine makes no progress (the liveness canary)
    HUNG = "hung"
    #: the engine ran out of GPU memory (its last log lines say so)
    OOM = "oom"
    #: the server saw no shard ready within the replica's ready timeout
    READY_TIMEOUT = "ready_timeout"
    #: a shard the server handed out is gone from its node, or stopped running
    SHARD_GONE = "shard_gone"
    #: the shard ended with the agent that ran it (an agent restart): not the replica's failure
    PREVIOUS_AGENT = "previous_agent"
    #: anything else the agent reports
    OTHER = "other"

    @property
    def counted(self) -> bool:
        """Whether a failure with this cause counts against the replica (and in the failure metrics)."""
        return self is not FailureCause.PREVIOUS_AGENT


#: the causes an agent reports for a shard (the rest are the server's own judgements)
SHARD_CAUSES = (FailureCause.EXITED, FailureCause.UNHEALTHY, FailureCause.HUNG, FailureCause.OOM)


def structure_cause(value: Any, _: type) -> FailureCause:
    """The converter's hook: a cause from its JSON spelling; anything else is refused, naming the causes."""
    if not isinstance(value, str) or value not in FailureCause._value2member_map_:
        raise ValueError(f"expected one of {', '.join(FailureCause)}, got {value!r}")
    return FailureCause(value)
