"""The fleet's buckets: one per rate-limited API key, lending requests to the gateway processes.

Held by the leading server, in memory (a new leader starts them full); asked
by ``POST /v1/gateway/allowances`` (:mod:`llmgw.server.http.routes`). Each
gateway process reports, per key it saw requests of, how many more it wants,
the tokens its answers used and the requests it gives back unused; it gets
whole requests out of the key's rpm bucket (never more than the bucket
holds: the fleet admits at most the limit) and how long until the bucket
can lend again, and whether the key's tpm bucket, charged with every
gateway's tokens, is positive. See :mod:`llmgw.gateway.leases` for the
gateway's side and the accuracy it gives.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.tenancy.bucket import KeyBuckets
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
        kept = {}
        for name, wanted in limits.items():
            if wanted.rpm is None and wanted.tpm is None:
                continue
            buckets = self._keys.get(name)
            if buckets is None:
                buckets = KeyBuckets(wanted, now)
            elif buckets.limits != wanted:
                buckets.follow(wanted, now)
            kept[name] = buckets
        self._keys = kept
