"""Stalled replicas, and requests on replicas that left the routes: found by the gateway, moved elsewhere.

Each attempt on a replica is an :class:`Attempt` the replica's
:class:`~llmgw.gateway.balancer.Upstream` holds while it is in flight;
:class:`StallWatch` looks at them every ``tick`` seconds.

**Stalled** (``--stall-timeout``): a replica with requests in flight that
had been producing (a byte arrived from it at most the stall timeout before
it last went from no request in flight to one) and from which no byte has
arrived for the stall timeout. Before acting, the gateway asks it
``GET /health`` with a short deadline (1 s, sent that long before the stall
timeout is up, so that the verdict comes at it): any answer is a byte, and
the replica is only slow (a long generation that is not
streamed sends nothing until its end). No answer: the replica is stalled.
Then, as when its breaker opens, no request goes to it for the breaker's
open time; every attempt on it that has sent nothing to its client is
cancelled and retried elsewhere (``forward`` sees a failed attempt); a stream
already passing to its client ends with an error event; and the server is
told (``POST /v1/gateway/suspect``), which records it for the agent's
liveness canary to confirm: the gateway's word alone tears nothing down.
Until a byte comes from it again the replica stays suspect: a probe request
that waits the stall timeout with nothing back is moved elsewhere too.

**Left the routes**: attempts that have sent nothing to their client are
cancelled at once and retried elsewhere; streams passing to clients go on
while the replica keeps sending (a drain lets them finish) and end once it
sends nothing for the stall timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import trio

from llmgw.gateway.balancer import Balancer, Upstream
from llmgw.net.client import ConnectionPool, HttpClientError

__all__ = ["Attempt", "StallWatch"]

log = logging.getLogger("llmgw.gateway")


class Attempt:
    """One attempt of a request on one replica, which the gateway can end.

    It is the ``watch`` of :meth:`llmgw.net.client.ConnectionPool.send`: ending it closes
    the connection its request went on (a cancel scope per attempt would cost more than
    the rest of a proxied request), and whatever waits on that connection fails at once.
    """

    __slots__ = ("connection", "start", "handed_over", "why")

    def __init__(self, start: float) -> None:
        #: the pool's connection carrying the request, once it has one
        self.connection = None
        #: trio time the attempt began
        self.start = start
        #: its response is passing through to the client (a stream): a retry is no longer possible
        self.handed_over = False
        #: why the gateway ended it (None: it did not)
        self.why: str | None = None

    def abort(self, why: str) -> None:
        """End the attempt: the proxy retries it elsewhere, or ends the client's stream if it began."""
        if self.why is not None:
            return
        self.why = why
        if self.connection is not None:
            self.connection.close()


class StallWatch:
    """Every ``tick`` seconds, finds stalled replicas and ends what waits on them.

    :param pool: the connection pool to the replicas (for the ``/health`` check).
    :param report: called with a replica found stalled and why (the gateway tells the server).
    :param check_timeout: seconds the ``/health`` check may take before the replica counts as stalled.
    """

    def __init__(
        self,
        balancer: Balancer,
        pool: ConnectionPool,
        stall_timeout: float,
        report: Callable[[Upstream, str], None],
        *,
        tick: float = 0.25,
        check_timeout: float = 1.0,
    ) -> None:
        self.balancer = balancer
        self.pool = pool
        self.stall_timeout = stall_timeout
        self.report = report
        self.tick = min(tick, stall_timeout / 4)
        self.check_timeout = min(check_timeout, stall_timeout / 2)
        #: replicas that left the routes with attempts still in flight
        self.departed: set[Upstream] = set()
        #: replicas found stalled so far (for tests and logs)
        self.stalls = 0
        self._nursery: trio.Nursery | None = None

    def left(self, replicas: Iterable[Upstream]) -> None:
        """``replicas`` left the routes: move what has sent nothing to its client elsewhere, at once.

        Called by the gateway on each routes update.
        """
        for replica in replicas:
            if not replica.attempts:
                continue
            why = f"replica {replica.name} left the routes"
            waiting = [a for a in replica.attempts if not a.handed_over]
            for attempt in waiting:
                attempt.abort(why)
            if waiting:
                log.info("%s: %d requests in flight on it moved elsewhere", why, len(waiting))
            self.departed.add(replica)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch until cancelled; started at once."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await trio.sleep(self.tick)
                now = trio.current_time()
                for replica in self.balancer:
                    if replica.attempts and not replica.checking:
                        self._look(replica, now)
                for replica in list(self.departed):
                    self._look_departed(replica, now)

    def _look(self, replica: Upstream, now: float) -> None:
        timeout = self.stall_timeout
        if replica.suspect:
            # stalled before and silent since: nothing that waits on it for the stall timeout stays
            why = f"replica {replica.name} was found stalled and sent nothing for {timeout:g} s since"
            late = [a for a in replica.attempts if now - a.start >= timeout and replica.last_byte < a.start]
            for attempt in late:
                attempt.abort(why)
            if late:
                replica.breaker.trip(now)
            return
        # checked from check_timeout before the stall timeout, so that the verdict comes at it
        silent = now - replica.last_byte
        if silent < timeout - self.check_timeout:
            return
        # it had been producing: a byte came within the stall timeout before these requests piled up
        if replica.last_byte < replica.busy_since - timeout:
            return
        replica.checking = True
        self._nursery.start_soon(self._check, replica, replica.last_byte)

    async def _check(self, replica: Upstream, last_byte: float) -> None:
        """Ask the silent replica for ``/health``; declare it stalled when nothing answers in time."""
        try:
            answered = False
            with trio.move_on_after(self.check_timeout):
                try:
                    await self.pool.request("GET", replica.url + "/health", limit=64 * 1024)
                    answered = True
                except HttpClientError:
                    pass
            if not answered and replica.last_byte == last_byte:
                await trio.sleep_until(last_byte + self.stall_timeout)
            if answered or replica.last_byte != last_byte:
                replica.produced(trio.current_time())  # slow, not stalled: its silence starts again
                return
            if not replica.attempts:
                return  # nothing waits on it any more: nothing to judge
            silent = trio.current_time() - last_byte
            self._stalled(
                replica,
                f"nothing arrived from it for {silent:.1f} s with {replica.in_flight} requests in flight "
                f"(--stall-timeout {self.stall_timeout:g}), and GET /health got no answer within "
                f"{self.check_timeout:g} s",
            )
        finally:
            replica.checking = False

    def _stalled(self, replica: Upstream, why: str) -> None:
        self.stalls += 1
        replica.suspect = True
        replica.breaker.trip(trio.current_time())
        attempts = list(replica.attempts)
        log.warning(
            "replica %s (%s) stalled: %s; out for %gs, %d requests in flight on it moved elsewhere or ended",
            replica.name,
            replica.url,
            why,
            replica.breaker.open_for,
            len(attempts),
        )
        for attempt in attempts:
            attempt.abort(f"replica {replica.name} stalled: {why}")
        self.report(replica, why)

    def _look_departed(self, replica: Upstream, now: float) -> None:
        if not replica.attempts:
            self.departed.discard(replica)
            return
        silent = now - max(replica.last_byte, min(a.start for a in replica.attempts))
        if silent >= self.stall_timeout:
            why = f"replica {replica.name} left the routes and sent nothing for {silent:.1f} s"
            for attempt in list(replica.attempts):
                attempt.abort(why)
            self.departed.discard(replica)
