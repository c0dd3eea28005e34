"""The stop order: retired replicas kept running until gateways let go, and multi-node workers held
until their rank 0 is gone.

Two things keep shards of a replica that left the desired state in their nodes'
desired shards, each decided by :mod:`llmgw.server.controllers.stopping`:

- a replica retired while ready (a drain's original, a rollout's, a scale-down)
  *lingers*, every shard running as before, until every gateway routes by a
  table without it (:mod:`llmgw.server.state.gateways`) or a bounded wait ran out;
- then the workers of a multi-node replica stay (``stop_after_rank0``) until its
  rank 0 is gone.

:class:`StopOrder` is the record of both; its verbs, called by the reconciler, are
the only code that changes it.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from llmgw.server.state.events import EventLog
from llmgw.server.state.records import Event, EventKind
from llmgw.wire import DesiredShard

__all__ = ["HeldWorkers", "Lingering", "StopOrder"]


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


@attrs.frozen
class Lingering:
    """A replica attempt retired while ready, every shard still running until the gateways let go."""

    #: node id -> shard, every shard of the attempt as it ran
    shards: tuple[tuple[str, DesiredShard], ...]
    #: the first routes generation without it: a gateway that holds it (or a later one) sends it nothing
    generation: int
    #: when it left the routes, and when it stops whatever the gateways say
    since: float
    deadline: float


class StopOrder:
    """The lingering replicas and the held workers, each by ``replica/attempt``."""

    def __init__(self) -> None:
        #: ``replica/attempt`` -> its held workers
        self.held: dict[str, HeldWorkers] = {}
        #: ``replica/attempt`` -> the retired attempt kept running until the gateways let go
        self.lingering: dict[str, Lingering] = {}
        #: ``replica/attempt`` of the replicas retired or removed since the reconciler last looked (their
        #: ids may be given to new replicas at once: a drain's second move takes the first one's id)
        self.retired: set[str] = set()

    def shards(self) -> Iterable[tuple[str, DesiredShard]]:
        """(node id, shard) of every lingering shard and held worker, for the desired state."""
        for lingering in self.lingering.values():
            yield from lingering.shards
        for held in self.held.values():
            yield from held.workers

    def left(self, replica_id: str, attempt: int) -> None:
        """Note that ``replica_id`` running ``attempt`` was retired or removed (the state's verbs call it)."""
        self.retired.add(f"{replica_id}/{attempt}")

    def take_retired(self) -> set[str]:
        """The attempts retired or removed since the last call (the reconciler, once a pass)."""
        retired, self.retired = self.retired, set()
        return retired

    def linger(self, attempt: str, lingering: Lingering) -> None:
        """Keep ``attempt`` (``replica/attempt``) running while gateways may still send it requests."""
        self.lingering[attempt] = lingering

    def let_go(self, attempt: str, why: str | None, now: float, events: EventLog) -> None:
        """Stop the lingering ``attempt``: the gateways let go of it, or the wait ran out; an event says
        ``why`` (None: it waited for nothing worth an event)."""
        del self.lingering[attempt]
        if why is not None:
            _record(events, now, attempt, f"{why}; stopping it")

    def hold(self, attempt: str, held: HeldWorkers) -> None:
        """Keep the workers of ``attempt`` running until its rank 0 is gone."""
        self.held[attempt] = held

    def release(self, attempt: str, why: str, now: float, events: EventLog) -> None:
        """Stop the held workers of ``attempt``: its rank 0 is gone (``why``)."""
        del self.held[attempt]
        _record(events, now, attempt, f"{why}; stopping its workers")


def _record(events: EventLog, now: float, attempt: str, what: str) -> None:
    """An event on the replica of ``attempt`` (``replica/attempt``): ``attempt N: what``."""
    replica_id, _, number = attempt.rpartition("/")
    events.record(Event(now, EventKind.REPLICA, replica_id, f"attempt {number}: {what}"))
