"""Stopping a replica in order: once the gateways let go of it; then, for a multi-node replica, rank 0
first, with its grace, and the workers once rank 0 is gone.

A replica retired while ready (a drain's original, a rollout's, a scale-down)
leaves the routes at once but *lingers*: every shard stays in its node's desired
shards until each gateway process heard from lately routes by a table without
it (:mod:`llmgw.server.state.gateways`), or ``Settings.linger_max`` passed,
or its node is lost. A gateway reading its routes from a standby, or from a
server that went silent, would otherwise send its next requests to an engine
that is stopping. A replica that failed, or was never ready, stops at once.

When a replica leaves the desired state (a drain's original retired, a
scale-down, a model removed from the catalog), its rank 0 is dropped from
its node's desired shards at once: that agent sends SIGTERM and rank 0 has
its ``stop_grace`` to finish the requests in flight. Rank 0 needs its workers
for that (every token of a multi-node engine goes through them), so the
workers stay in their nodes' desired shards, marked ``stop_after_rank0``:
their agents keep them running (and never start them anew) until the server
drops them, which it does once rank 0 is gone, its node is lost, or its grace
(plus :data:`STOP_MARGIN`) has passed.

:func:`linger`, :func:`let_go`, :func:`hold` and :func:`release` decide; the record of the lingering
replicas and the held workers is :class:`~llmgw.server.state.stopping.StopOrder`, changed only by its
verbs, which the reconciler calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from llmgw.models import DEFAULT_STOP_GRACE
from llmgw.server.state.gateways import GatewayBook
from llmgw.server.state.records import NodeRecord, ReplicaRecord, ReplicaState
from llmgw.server.state.stopping import HeldWorkers, Lingering, StopOrder
from llmgw.wire import DesiredShard

__all__ = ["NOTABLE_WAIT", "STOP_MARGIN", "hold", "let_go", "linger", "linger_bound", "release"]


def linger_bound(poll_timeout: float) -> float:
    """Seconds a retired replica lingers at most for gateways that still route to it, for a server whose
    long-polls wait ``poll_timeout``: a gateway leaves a silent server after twice that wait (its
    routes table says it) plus 2 s (:meth:`llmgw.gateway.routes.RoutesWatcher.poll_limit`), then
    reports the new routes within its report interval (2 s); one second more of margin. 15 s for the
    default 5 s. Called when the server's settings are built (``Settings.linger_max``)."""
    return 2 * poll_timeout + 2.0 + 2.0 + 1.0


#: a linger at least this long is an event (gateways answer in milliseconds when all is well)
NOTABLE_WAIT = 1.0

#: seconds past rank 0's grace the workers are held at most: the agent's
#: own SIGKILL margin, plus a sync or two to report rank 0 gone
STOP_MARGIN = 10.0


def linger(
    before: Mapping[str, tuple[DesiredShard, ...]],
    ready_before: frozenset[str],
    retired: set[str],
    generation: int,
    now: float,
    bound: float,
) -> dict[str, Lingering]:
    """The attempts to keep running that ``before`` ran, were ready, and were retired or removed.

    Called by the reconciler after the controllers decided, with ``before`` the desired shards and
    ``ready_before`` the ready replicas it started from, ``retired`` the ``replica/attempt`` the
    state's verbs retired or removed since, ``generation`` the routes generation without them, and
    ``bound`` the longest they may linger (``Settings.linger_max``).

    :returns: ``replica/attempt`` -> every shard of it, to linger until ``now + bound`` at the most.
    """
    by_attempt = _by_attempt(
        before, lambda s: f"{s.replica_id}/{s.attempt}" in retired and s.replica_id in ready_before
    )
    return {a: Lingering(tuple(s), generation, now, now + bound) for a, s in by_attempt.items()}


def let_go(
    stopping: StopOrder, gateways: GatewayBook, nodes: Mapping[str, NodeRecord], now: float
) -> list[tuple[str, str | None]]:
    """The lingering attempts no gateway sends requests to any more (or past their bound, or on a
    lost node), and why when it is worth an event: a gateway was slow (:data:`NOTABLE_WAIT`) or never
    answered. Called by the reconciler on every pass, before :func:`hold`.

    :returns: (``replica/attempt``, what happened or None) for each attempt to stop now.
    """
    out: list[tuple[str, str | None]] = []
    for attempt, lingering in stopping.lingering.items():
        behind = gateways.behind(lingering.generation, now)
        lost = sorted({n for n, _ in lingering.shards if n not in nodes or nodes[n].lost})
        waited = now - lingering.since
        if lost:
            out.append((attempt, None))  # the lost node's event says it; nothing runs there to stop
        elif not behind and not gateways.unsure(now):
            why = f"the gateways took routes without it after {waited:.1f} s"
            out.append((attempt, why if waited >= NOTABLE_WAIT else None))
        elif now >= lingering.deadline:
            bound = lingering.deadline - lingering.since
            if behind:
                names = ", ".join(behind[:3]) + (f" and {len(behind) - 3} more" if len(behind) > 3 else "")
                out.append((attempt, f"gateway {names} did not take routes without it in {bound:g} s"))
            else:
                out.append((attempt, f"waited {bound:g} s for gateways this new leader may not know yet"))
    return out


def hold(
    before: Mapping[str, tuple[DesiredShard, ...]],
    replicas: Mapping[str, ReplicaRecord],
    stopping: StopOrder,
    revision: int,
    now: float,
) -> dict[str, HeldWorkers]:
    """The workers to hold of every multi-node attempt that ``before`` ran and the reconciler just retired.

    Called by the reconciler after the controllers decided, with ``before`` the
    desired shards it started from. An attempt is retired when its replica is
    gone from ``replicas`` or runs another attempt (not after a failure: a
    failed replica's shards all stop at once, as there is nothing to save).

    :returns: ``replica/attempt`` -> its workers to hold (those not held already in ``stopping``).
    """
    by_attempt = _by_attempt(
        before, lambda s: s.spec.nnodes > 1 and not s.stop_after_rank0 and _retired(s, replicas)
    )
    out = {}
    for attempt, shards in by_attempt.items():
        rank0 = next(((n, s) for n, s in shards if s.rank == 0), None)
        workers = tuple((n, attrs.evolve(s, stop_after_rank0=True)) for n, s in shards if s.rank > 0)
        if rank0 is None or not workers or attempt in stopping.held or attempt in stopping.lingering:
            continue
        grace = DEFAULT_STOP_GRACE if rank0[1].stop_grace is None else rank0[1].stop_grace
        out[attempt] = HeldWorkers(workers, rank0[0], rank0[1].key, revision, now + grace + STOP_MARGIN)
    return out


def release(stopping: StopOrder, nodes: Mapping[str, NodeRecord], now: float) -> list[tuple[str, str]]:
    """The held attempts whose rank 0 is gone (or lost, or out of grace), and why.

    Called by the reconciler on every pass, before it compares the desired state.

    :returns: (``replica/attempt``, what happened) for each attempt to release.
    """
    released = []
    for attempt, held in stopping.held.items():
        why = _rank0_gone(held, nodes.get(held.rank0_node), now)
        if why is not None:
            released.append((attempt, why))
    return released


def _by_attempt(
    before: Mapping[str, tuple[DesiredShard, ...]], keep: Callable[[DesiredShard], bool]
) -> dict[str, list[tuple[str, DesiredShard]]]:
    """``replica/attempt`` -> (node id, shard) of every shard in ``before`` that ``keep`` keeps."""
    by_attempt: dict[str, list[tuple[str, DesiredShard]]] = {}
    for node_id, shards in before.items():
        for shard in shards:
            if keep(shard):
                by_attempt.setdefault(f"{shard.replica_id}/{shard.attempt}", []).append((node_id, shard))
    return by_attempt


def _retired(shard: DesiredShard, replicas: Mapping[str, ReplicaRecord]) -> bool:
    record = replicas.get(shard.replica_id)
    return record is None or (record.attempt != shard.attempt and record.state != ReplicaState.BACKOFF)


def _rank0_gone(held: HeldWorkers, node: NodeRecord | None, now: float) -> str | None:
    """Why the workers may stop now, or None while rank 0 may still be finishing requests."""
    if node is None or node.lost:
        return f"rank 0's node {held.rank0_node} is lost"
    observed = node.observed.get(held.rank0_key)
    if observed is not None and observed.state == "exited":
        return "rank 0 exited"
    if observed is None and node.reported and node.agent_revision > held.revision:
        return "rank 0 stopped"
    if now >= held.deadline:
        return "rank 0 is still stopping past its grace"
    return None
