"""A gateway's share of its limited keys' rates and seats: ``POST /v1/gateway/allowances``.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
Each gateway process posts an :class:`AllowanceRequest` every
:attr:`AllowanceReply.period` seconds (and at once when a key it holds nothing
for is asked for), and gets what the fleet's buckets and seats on the server
can lend. A server from before seats answers no :attr:`AllowanceReply.seat_ttl`
(and ignores the ``seats_*`` fields, as every peer ignores keys it does not know).
"""

from __future__ import annotations

import attrs

from llmgw.models import bounded

__all__ = ["AllowanceReply", "AllowanceRequest", "KeyAllowance", "KeyDemand", "UsageReport", "SpentKey"]


def _not_negative(_: object, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name}: expected a number >= 0, got {value}")


def _name() -> str:
    """A field naming a key, a model or a gateway process: at most 253 characters."""
    return attrs.field(validator=bounded(text=253))


def _count() -> int:
    """A field counting requests, tokens or seats: 0 unless given, never negative."""
    return attrs.field(default=0, validator=_not_negative)


@attrs.frozen
class KeyDemand:
    """One limited key as a gateway process sees it since its last request."""

    key: str = _name()
    #: requests it asks to be granted now (beyond what it holds)
    wanted: int = _count()
    #: prompt + completion tokens of the key's answers that ended since its last request
    tokens: int = _count()
    #: requests granted earlier that it gives back unused
    returned: int = _count()
    #: for a key with ``concurrency``: the seats it holds as it asks (its lease not expired), those of them in
    #: use (its requests in flight: more than it holds once its lease expired with requests running), and
    #: the seats it asks to hold from now on (fewer than it holds gives the rest back)
    seats_held: int = _count()
    seats_used: int = _count()
    seats_wanted: int = _count()


@attrs.frozen
class UsageReport:
    """What one key's answers of one model used since the gateway process last reported (any key)."""

    key: str = _name()
    model: str = _name()
    requests: int = _count()
    prompt_tokens: int = _count()
    completion_tokens: int = _count()


@attrs.frozen
class AllowanceRequest:
    """``POST /v1/gateway/allowances``: a gateway process's demand, per limited key, and its keys' usage."""

    #: the gateway process (host, pid and a random part): the server's log names it, and holds its seats
    #: under it (and its certificate's name)
    gateway: str = _name()
    keys: tuple[KeyDemand, ...] = attrs.field(default=(), validator=bounded(items=100_000))
    #: the tokens answers used, per key and model, since the last report (counted against budgets)
    usage: tuple[UsageReport, ...] = attrs.field(default=(), validator=bounded(items=100_000))


@attrs.frozen
class KeyAllowance:
    """What the server lends one key's gateway process now."""

    key: str
    #: requests granted, the gateway's to admit from now on (never more than the fleet's rpm bucket had)
    granted: int = 0
    #: seconds until the fleet's rpm bucket holds a whole request again (0: it does)
    requests_wait: float = 0.0
    #: seconds until the fleet's tpm bucket is positive again (0: it is; the key's requests may go)
    tokens_wait: float = 0.0
    #: seats the gateway process holds from now on, for :attr:`AllowanceReply.seat_ttl` seconds from its
    #: request (None: the key has no ``concurrency`` limit)
    seats: int | None = None


@attrs.frozen
class SpentKey:
    """A key that used its whole token budget this period: refused until the period ends."""

    key: str
    #: the budget (tokens) and its period (``day`` or ``month``)
    budget: int
    period: str
    #: when the period ends and the budget is whole again (UNIX time)
    resets_at: float


@attrs.frozen
class AllowanceReply:
    """The server's answer: an allowance per key asked about that has a rate limit, and the keys spent."""

    keys: tuple[KeyAllowance, ...] = ()
    #: seconds until the gateway should ask again
    period: float = 1.0
    #: every key at or over its budget now
    spent: tuple[SpentKey, ...] = ()
    #: seconds a gateway process's seats last from its request without another (None: a server from before
    #: seats, which lends none: each process counts ``concurrency`` alone)
    seat_ttl: float | None = None
