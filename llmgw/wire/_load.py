"""What agents send of their engines' load: the autoscaler's signals, one record per ready rank 0."""

from __future__ import annotations

import attrs

from llmgw.models import bounded

__all__ = ["ShardLoad"]


@attrs.frozen
class ShardLoad:
    """One reading of a ready rank 0's own gauges (:class:`llmgw.engine.LoadMetrics`), sent with the sync.

    Agents that predate autoscaling send none; the server then has no signal for that replica.
    """

    replica_id: str = attrs.field(validator=bounded())
    attempt: int
    #: requests queued in the engine, not yet running
    waiting: float
    #: requests being decoded; None when the engine names no such gauge
    running: float | None = None
    #: the share of the KV cache in use (0 to 1); None when the engine reports none
    kv_cache_usage: float | None = None
