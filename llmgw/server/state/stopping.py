"""The held workers of stopping multi-node replicas: what the stopping controller decided to keep running.

When a multi-node replica leaves the desired state, its workers stay in their
nodes' desired shards (``stop_after_rank0``) until rank 0 is gone; see
:mod:`llmgw.server.controllers.stopping`, which decides when to hold and
release them. :class:`StopOrder` is the record of those held now.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from llmgw.wire import DesiredShard

__all__ = ["HeldWorkers", "StopOrder"]


@attrs.frozen
class HeldWorkers:
    """The workers of one stopping replica attempt, waiting for its rank 0 to be gone."""

    #: node id -> that node's held worker shards (``stop_after_rank0`` set)
    workers: tuple[tuple[str, DesiredShard], ...]
    rank0_node: str
    rank0_key: str
    #: the cluster revision when rank 0 was dropped: an agent past it has applied the stop
    revision: int
    #: when the workers are dropped whatever rank 0 does
    deadline: float


class StopOrder:
    """The held workers of every stopping multi-node replica, by ``replica/attempt``."""

    def __init__(self) -> None:
        #: ``replica/attempt`` -> its held workers
        self.held: dict[str, HeldWorkers] = {}

    def shards(self) -> Iterable[tuple[str, DesiredShard]]:
        """(node id, shard) of every held worker, for the desired state."""
        for held in self.held.values():
            yield from held.workers
