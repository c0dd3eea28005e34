"""Seats: each API key's ``concurrency`` for the whole fleet, lent to gateway processes as leases that expire.

Held by the leading server, in memory, beside the rate buckets
(:class:`~llmgw.server.state.allowances.Lender` asks it on every
``POST /v1/gateway/allowances``). A key with ``concurrency N`` has N seats; a
gateway process admits a request of the key only on a seat it holds
(:mod:`llmgw.gateway.seats`). On each exchange it says the seats it holds,
those in use and those it wants from now on, and is answered the seats it
holds from then: what it wants, as far as the seats the other processes hold
leave, and never fewer than it has in use (a request running is never cut).
Requests are answered one at a time, so two processes asking for the last
seat at once: the first gets it, the second is answered without it.

A process's seats last :data:`SEAT_TTL` seconds from its last exchange. The
gateway counts them from when it sent that request (before the server got it),
so its seats end there first: a process killed, or cut off from the server,
frees its seats for the others within the TTL, and never uses one the server
lends again (except requests it had running, which are counted when it
reports again).

A new leader (a failover, a restart) does not know what the last one lent.
For the keys that existed when it began to lead (:meth:`SeatBook.carry`) it
lends no seat beyond what each process reports it holds, until the TTL and a
period have passed: by then every seat the last leader lent was reported to
this one or has ended at its gateway. So the fleet never holds more than N
seats of a key (beyond requests still running on seats that expired), and a
key may not grow its share for those seconds after a failover.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw.wire import KeyDemand

__all__ = ["SEAT_TTL", "SeatBook"]

#: seconds a gateway process's seats last from its last exchange (five periods of one second)
SEAT_TTL = 5.0


class SeatBook:
    """Every key's seats lent, by gateway process, and until when.

    :param ttl: seconds a process's seats last from its last exchange.
    :param period: seconds between two exchanges of a process (the margin a new leader adds to the TTL).
    """

    def __init__(self, ttl: float = SEAT_TTL, period: float = 1.0) -> None:
        self.ttl = ttl
        self.period = period
        #: key name -> process -> (seats it holds, when they end on the server's clock)
        self._held: dict[str, dict[str, tuple[int, float]]] = {}
        self._carried: frozenset[str] = frozenset()
        self._blind_until = 0.0

    def carry(self, names: Iterable[str], now: float) -> None:
        """This server begins to lead at ``now``, with the keys ``names`` made before: until the TTL and a
        period have passed it lends them no seat beyond what each process reports it holds."""
        self._carried = frozenset(names)
        self._blind_until = now + self.ttl + self.period

    def lend(self, demand: KeyDemand, limit: int, holder: str, now: float) -> int:
        """The seats of ``demand``'s key (``limit`` in all) that process ``holder`` holds from ``now`` on.

        Called for each key with ``concurrency`` in a process's exchange, with what it says: the seats it
        held as it asked, those used by its requests in flight and those it wants from now on.
        """
        key, held, used, wanted = demand.key, demand.seats_held, demand.seats_used, demand.seats_wanted
        holders = self._held.setdefault(key, {})
        for name in [n for n, (_, until) in holders.items() if until <= now]:
            del holders[name]
        if key in self._carried and now < self._blind_until:
            free = held  # what the last leader lent is not known yet: no more than it says it holds
        else:
            free = limit - sum(seats for name, (seats, _) in holders.items() if name != holder)
        granted = max(used, min(wanted, free))
        if granted:
            holders[holder] = (granted, now + self.ttl)
        else:
            holders.pop(holder, None)
        return granted

    def lent(self, key: str, now: float) -> int:
        """The seats of ``key`` held now by every process, in all (for tests and logs)."""
        return sum(seats for seats, until in self._held.get(key, {}).values() if until > now)

    def keep(self, names: Iterable[str]) -> None:
        """Forget the seats of keys no longer limited by ``concurrency`` (not in ``names``)."""
        kept = set(names)
        for key in [k for k in self._held if k not in kept]:
            del self._held[key]
