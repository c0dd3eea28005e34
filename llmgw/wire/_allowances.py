"""A gateway's share of its limited keys' rates: ``POST /v1/gateway/allowances``.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
Each gateway process posts an :class:`AllowanceRequest` every
:attr:`AllowanceReply.period` seconds (and at once when a key it holds nothing
for is asked for), and gets what the fleet's buckets on the server can lend.
"""

from __future__ import annotations

import attrs

from llmgw.models import bounded

__all__ = ["AllowanceReply", "AllowanceRequest", "KeyAllowance", "KeyDemand", "UsageReport", "SpentKey"]


def _not_negative(_: object, attribute: attrs.Attribute, value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name}: expected a number >= 0, got {value}")


@attrs.frozen
class KeyDemand:
    """One limited key as a gateway process sees it since its last request."""

    key: str = attrs.field(validator=bounded(text=253))
    #: requests it asks to be granted now (beyond what it holds)
    wanted: int = attrs.field(default=0, validator=_not_negative)
    #: prompt + completion tokens of the key's answers that ended since its last request
    tokens: int = attrs.field(default=0, validator=_not_negative)
    #: requests granted earlier that it gives back unused
    returned: int = attrs.field(default=0, validator=_not_negative)


@attrs.frozen
class UsageReport:
    """What one key's answers of one model used since the gateway process last reported (any key)."""

    key: str = attrs.field(validator=bounded(text=253))
    model: str = attrs.field(validator=bounded(text=253))
    requests: int = attrs.field(default=0, validator=_not_negative)
    prompt_tokens: int = attrs.field(default=0, validator=_not_negative)
    completion_tokens: int = attrs.field(default=0, validator=_not_negative)


@attrs.frozen
class AllowanceRequest:
    """``POST /v1/gateway/allowances``: a gateway process's demand, per limited key, and its keys' usage."""

    #: the gateway process (host, pid and a random part): for the server's log only
    gateway: str = attrs.field(validator=bounded(text=253))
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
