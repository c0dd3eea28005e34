"""The token bucket: a rate per minute, spent at once up to its size, refilled evenly.

Pure: every method takes the time (seconds on a monotonic clock) from its caller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from llmgw.wire import KeyLimits

__all__ = ["KeyBuckets", "TokenBucket", "follow_keys"]


class TokenBucket:
    """Up to ``per_minute`` tokens, refilled at ``per_minute / 60`` per second; its level may go negative.

    :param per_minute: the bucket's size and its refill per minute.
    :param now: the clock's time when it is made (full then).
    """

    __slots__ = ("size", "rate", "level", "stamp")

    def __init__(self, per_minute: int, now: float) -> None:
        self.size = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.size
        self.stamp = now

    def refill(self, now: float) -> float:
        """Add what was refilled since the last look, up to the size; the level now."""
        if now > self.stamp:
            self.level = min(self.size, self.level + (now - self.stamp) * self.rate)
            self.stamp = now
        return self.level

    def wait(self, amount: float, now: float) -> float:
        """Seconds until the level reaches ``amount`` (0: it has); nothing taken."""
        missing = amount - self.refill(now)
        return 0.0 if missing <= 0 else missing / self.rate

    def drain(self, since: float) -> None:
        """Empty it as of ``since`` (at most the clock's time now): it refills from then on."""
        self.level = 0.0
        self.stamp = since

    def take(self, amount: float, now: float) -> None:
        """Remove ``amount``; the level may go negative (tokens charged after the fact)."""
        self.refill(now)
        self.level -= amount

    def resize(self, per_minute: int, now: float) -> None:
        """A new limit: the level is kept (at most the new size), the refill rate follows."""
        self.refill(now)
        self.size = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = min(self.level, self.size)


class KeyBuckets:
    """One key's buckets for its limits: ``requests`` for rpm, ``tokens`` for tpm (None: no such limit).

    :param limits: the key's :class:`~llmgw.wire.KeyLimits`.
    :param now: the clock's time when they are made (full then).
    """

    __slots__ = ("limits", "requests", "tokens")

    def __init__(self, limits: KeyLimits, now: float) -> None:
        self.limits = limits
        self.requests = TokenBucket(limits.rpm, now) if limits.rpm is not None else None
        self.tokens = TokenBucket(limits.tpm, now) if limits.tpm is not None else None

    def follow(self, limits: KeyLimits, now: float) -> None:
        """Take the key's new limits, keeping what was used of those that stay."""
        self.limits = limits
        self.requests = _resized(self.requests, limits.rpm, now)
        self.tokens = _resized(self.tokens, limits.tpm, now)

    def drain(self, since: float) -> None:
        """Empty both buckets as of ``since``: for a key whose earlier use is not known (a new leader, see
        :class:`~llmgw.server.state.allowances.Lender`)."""
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.drain(since)

    def tokens_wait(self, now: float) -> float:
        """Seconds until the tpm bucket is positive again (0: it is, or there is no tpm limit)."""
        if self.tokens is None:
            return 0.0
        level = self.tokens.refill(now)
        return 0.0 if level > 0 else -level / self.tokens.rate


def _resized(bucket: TokenBucket | None, per_minute: int | None, now: float) -> TokenBucket | None:
    if per_minute is None:
        return None
    if bucket is None:
        return TokenBucket(per_minute, now)
    bucket.resize(per_minute, now)
    return bucket


Buckets = TypeVar("Buckets", bound=KeyBuckets)


def follow_keys(
    held: Mapping[str, Buckets],
    limits: Mapping[str, KeyLimits],
    now: float,
    make: Callable[[str, KeyLimits, float], Buckets],
) -> dict[str, Buckets]:
    """Every key's buckets for new ``limits`` (key name -> limits), from those ``held`` so far.

    Called when the keys' limits may have changed (a gateway's new routes table, every lease request on
    the server). A key whose limits are unchanged keeps its buckets; one whose limits changed keeps what
    it used of the limits that stay (:meth:`KeyBuckets.follow`); a key new here gets ``make(name, limits,
    now)``; a key not named is dropped.
    """
    kept = {}
    for name, wanted in limits.items():
        buckets = held.get(name)
        if buckets is None:
            buckets = make(name, wanted, now)
        elif buckets.limits != wanted:
            buckets.follow(wanted, now)
        kept[name] = buckets
    return kept
