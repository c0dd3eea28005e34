"""Held seats: a gateway process's share of one API key's ``concurrency``, borrowed from the leading server.

A key with ``concurrency N`` has N seats for the whole fleet, lent by the
leader (:mod:`llmgw.server.state.seats`) on the allowance exchange the
gateway already makes (:mod:`llmgw.gateway.leases`). A process admits a
request of the key only on a free seat it holds (:mod:`llmgw.gateway.admission`);
with none free it asks at once, the request waiting for that exchange (as for
rpm), unless the last answer, less than a period ago, lent it fewer seats than
it needed: the fleet's are taken, and the request is refused (429) at once.

On each exchange it says the seats it holds, those in use, and those it wants
from now on: its requests in flight and waiting, or the most it had in use at
once in the last period: a seat not used for a period goes back. When requests
wait it asks for twice what it needs (up to the limit), so a burst ramps up in
a few exchanges; what it does not use goes back a period later. Seats it gives
back are gone at once, before the answer; the answer's count is what it holds.

Its seats last the server's TTL from when it sent the request that was
answered: a process that loses the server admits on them until then, then
refuses (429) until the server answers again (its requests running are never
cut; it reports them, and the server counts them, when it is back).
"""

from __future__ import annotations

__all__ = ["HeldSeats"]


class HeldSeats:
    """One key's seats in one gateway process, the requests on them, and what to ask for.

    ``held`` seats were lent by the server, valid until ``until`` (the clock's time); ``used`` of them carry
    requests now; of the free ones, ``reserved`` are kept for the requests that wait for the exchange out
    (or that waited for the last answer and have not asked again); ``waiting`` requests wait now for an
    exchange; until ``full_until`` the fleet had no more seats for this process (its last answer);
    ``reached[n - 1]`` is when ``n`` seats were last wanted at once (in use, or one more asked for).

    :param limit: the key's ``concurrency`` (never ask for more).
    """

    __slots__ = ("limit", "held", "used", "reserved", "waiting", "until", "full_until", "reached")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = self.used = self.reserved = self.waiting = 0
        self.until = self.full_until = 0.0
        self.reached: list[float] = []

    def free(self, now: float) -> int:
        """Seats held and not in use (0 once they expired)."""
        return self.valid(now) - self.used

    def may_take(self, now: float, *, again: bool = False) -> bool:
        """Whether a request may take a seat now (nothing taken); marks the demand when it may not.

        Seats the last answer lent for requests that waited for it go to them (``again``) before others.
        """
        free = self.free(now)
        if free >= 1 and (again or free > self.reserved):
            return True
        self._reach(self.used + 1, now)
        return False

    def take(self, now: float, *, again: bool = False) -> None:
        """A request admitted takes a seat (:meth:`may_take` said it may)."""
        if again and self.reserved:
            self.reserved -= 1
        self.used += 1
        self._reach(self.used, now)

    def release(self) -> None:
        """A request on a seat ended: its seat is free (held until given back)."""
        self.used = max(0, self.used - 1)

    def _reach(self, count: int, now: float) -> None:
        reached = self.reached
        while len(reached) < count:
            reached.append(now)
        reached[count - 1] = now

    def wanted(self, now: float, period: float, *, last: bool = False) -> tuple[int, int]:
        """The seats to hold from now on, and of them those needed now. Needed: the requests in flight and
        waiting, or the most wanted at once in the last ``period``; when some wait, it asks for twice what
        they and those in flight need (a key's burst ramps up in a few exchanges, not one per request).
        ``last``: only those in flight (the process stops). Seats held beyond it are given back at once: no
        request takes them while the exchange is out. Called as the exchange is sent."""
        needed = wanted = self.used
        if not last:
            reached = self.reached
            recent = next((n for n in range(len(reached), 0, -1) if now - reached[n - 1] < period), 0)
            needed = max(needed, min(self.limit, max(needed + self.waiting, recent)))
            ramp = 2 * (self.used + self.waiting) if self.waiting else 0
            wanted = max(needed, min(self.limit, ramp))
        self.held = min(self.held, wanted)
        # the seats free now go to the requests that wait for this exchange: a request that comes while it is
        # out takes only what they leave, or it would take seats the exchange asks for them
        self.reserved = min(max(0, self.free(now)), self.waiting)
        return wanted, needed

    def valid(self, now: float) -> int:
        """Seats held whose lease has not expired."""
        return self.held if now < self.until else 0

    def lent(
        self, seats: int, sent_at: float, ttl: float, now: float, period: float, asked: tuple[int, ...]
    ) -> None:
        """The server's answer: ``seats`` held for ``ttl`` seconds from ``sent_at`` (when the request went),
        ``asked`` (seats needed, requests waiting) then; free seats go first to the requests that waited."""
        needed, waiting = asked
        self.held = seats
        self.until = sent_at + ttl
        self.full_until = now + period if seats < needed else 0.0
        self.reserved = min(max(0, seats - self.used), waiting)
