"""The fleet's buckets: one per rate-limited API key, lending requests to the gateway processes.

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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw.tenancy.bucket import KeyBuckets, follow_keys
from llmgw.wire import AllowanceReply, AllowanceRequest, KeyAllowance, KeyLimits

__all__ = ["LEASE_PERIOD", "Lender"]

#: seconds between two requests of a gateway process (what :attr:`AllowanceReply.period` says)
LEASE_PERIOD = 1.0


class Lender:
    """Every rate-limited key's fleet-wide buckets; :meth:`lend` answers one gateway's request.

    :param period: seconds the gateways are told to wait between two requests.
    """

    def __init__(self, period: float = LEASE_PERIOD) -> None:
        self.period = period
        self._keys: dict[str, KeyBuckets] = {}
        #: the keys that existed when this server began to lead, and when it did (the server's clock)
        self._carried: frozenset[str] = frozenset()
        self._began = 0.0

    def carry(self, names: Iterable[str], now: float) -> None:
        """This server begins to lead at ``now``, with the keys ``names`` made before: their buckets start
        empty then (an earlier leader may have lent all they held). Called once, when the keys are loaded."""
        self._carried = frozenset(names)
        self._began = now

    def lend(self, limits: Mapping[str, KeyLimits], request: AllowanceRequest, now: float) -> AllowanceReply:
        """Charge what ``request`` reports and lend what it asks, as far as each key's buckets allow.

        Called for every ``POST /v1/gateway/allowances``, with the live keys' limits (key name -> limits)
        and the server's clock. Keys without rpm or tpm are left out of the answer.
        """
        self._follow(limits, now)
        answers = []
        for demand in request.keys:
            buckets = self._keys.get(demand.key)
            if buckets is None:
                continue
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
            answers.append(KeyAllowance(demand.key, granted, requests_wait, buckets.tokens_wait(now)))
        return AllowanceReply(tuple(answers), self.period)

    def _follow(self, limits: Mapping[str, KeyLimits], now: float) -> None:
        """Keep the buckets of the keys limited by a rate, following changed limits."""
        rated = {n: w for n, w in limits.items() if w.rpm is not None or w.tpm is not None}
        self._keys = follow_keys(self._keys, rated, now, self._new)

    def _new(self, name: str, limits: KeyLimits, now: float) -> KeyBuckets:
        """A key's buckets, first lent from now: full, or for a key older than this lead, as if empty when
        it began."""
        buckets = KeyBuckets(limits, now)
        if name in self._carried:
            buckets.drain(min(self._began, now))
        return buckets
