"""The fleet's buckets: one per rate-limited API key, lending requests (and seats) to the gateway processes.

Held by the leading server, in memory; asked
by ``POST /v1/gateway/allowances`` (:mod:`llmgw.server.http.routes`). Each
gateway process reports, per key it saw requests of, how many more it wants,
the tokens its answers used and the requests it gives back unused; it gets
whole requests out of the key's rpm bucket (never more than the bucket
holds: the fleet admits at most the limit) and how long until the bucket
can lend again, and whether the key's tpm bucket, charged with every
gateway's tokens, is positive. See :mod:`llmgw.gateway.leases` for the
gateway's side and the accuracy it gives.

A new leader (after a failover, or a restart) knows nothing of what the last
one lent: the buckets of the keys that existed when it began to lead
(:meth:`Lender.carry`) start empty at that moment and refill at the key's
rate. A bucket admits at most its size plus its refill in any window; a
bucket emptied can only admit less, so across a failover the fleet admits no
more than one leader alone would have: at most ``rpm * (1 + T / 60)``
requests lent in any T seconds (admitted: plus one period's refill, as the
gateways use what they hold up to a period after it was lent). What it costs
a key: the burst it had saved, which comes back within a minute (its steady
rate is lent from the first second). Keys made after the leader began start
full, as they do on any leader.

A key's ``concurrency`` is lent on the same exchange as seats
(:class:`~llmgw.server.state.seats.SeatBook`), with the same care for a new leader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw.server.state.seats import SEAT_TTL, SeatBook
from llmgw.tenancy.bucket import KeyBuckets, follow_keys
from llmgw.wire import AllowanceReply, AllowanceRequest, KeyAllowance, KeyLimits

__all__ = ["LEASE_PERIOD", "Lender"]

#: seconds between two requests of a gateway process (what :attr:`AllowanceReply.period` says)
LEASE_PERIOD = 1.0


class Lender:
    """Every rate-limited key's fleet-wide buckets and every key's seats; :meth:`lend` answers one gateway's
    request.

    :param period: seconds the gateways are told to wait between two requests.
    :param seat_ttl: seconds a gateway process's seats last without another request.
    """

    def __init__(self, period: float = LEASE_PERIOD, seat_ttl: float = SEAT_TTL) -> None:
        self.period = period
        self._keys: dict[str, KeyBuckets] = {}
        #: the keys' seats (``concurrency``), by gateway process
        self.seats = SeatBook(seat_ttl, period)
        #: the keys that existed when this server began to lead, and when it did (the server's clock)
        self._carried: frozenset[str] = frozenset()
        self._began = 0.0

    def carry(self, names: Iterable[str], now: float) -> None:
        """This server begins to lead at ``now``, with the keys ``names`` made before: their buckets start
        empty then (an earlier leader may have lent all they held). Called once, when the keys are loaded."""
        self._carried = frozenset(names)
        self._began = now
        self.seats.carry(self._carried, now)

    def lend(
        self, limits: Mapping[str, KeyLimits], request: AllowanceRequest, now: float, holder: str = ""
    ) -> AllowanceReply:
        """Charge what ``request`` reports and lend what it asks, as far as the key's buckets and seats allow.

        Called for every ``POST /v1/gateway/allowances``, with the live keys' limits (key name -> limits),
        the server's clock and the process that asks (``holder``, its seats' name: the request's
        ``gateway`` unless given). Keys without rpm, tpm or concurrency are left out of the answer.
        """
        self._follow(limits, now)
        holder = holder or request.gateway
        answers = []
        for demand in request.keys:
            buckets = self._keys.get(demand.key)
            if buckets is None:
                continue
            concurrency = buckets.limits.concurrency
            seats = None if concurrency is None else self.seats.lend(demand, concurrency, holder, now)
            granted, requests_wait = 0, 0.0
            if buckets.tokens is not None and demand.tokens:
                buckets.tokens.take(demand.tokens, now)
            requests = buckets.requests
            if requests is not None:
                level = requests.refill(now)
                requests.level = min(requests.size, level + demand.returned)
                granted = min(int(requests.level), demand.wanted)
                if granted:
                    requests.take(granted, now)
                requests_wait = requests.wait(1.0, now)
            answers.append(KeyAllowance(demand.key, granted, requests_wait, buckets.tokens_wait(now), seats))
        return AllowanceReply(tuple(answers), self.period, seat_ttl=self.seats.ttl)

    def _follow(self, limits: Mapping[str, KeyLimits], now: float) -> None:
        """Keep the buckets of the keys limited by a rate or a concurrency, following changed limits."""
        leased = {n: w for n, w in limits.items() if (w.rpm, w.tpm, w.concurrency) != (None, None, None)}
        self._keys = follow_keys(self._keys, leased, now, self._new)
        self.seats.keep(n for n, w in leased.items() if w.concurrency is not None)

    def _new(self, name: str, limits: KeyLimits, now: float) -> KeyBuckets:
        """A key's buckets, first lent from now: full, or for a key older than this lead, as if empty when
        it began."""
        buckets = KeyBuckets(limits, now)
        if name in self._carried:
            buckets.drain(min(self._began, now))
        return buckets
