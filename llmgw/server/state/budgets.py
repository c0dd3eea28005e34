"""Budgets: the tokens each API key used this month, by UTC day, and which keys are spent.

Held by the leading server. The gateways report what their answers used, per
key and model, with every ``POST /v1/gateway/allowances``; :meth:`Budgets.add`
counts it at once and keeps it until :meth:`Budgets.pending` hands it to the
store (one write every :data:`FLUSH_INTERVAL` seconds, and before ``ctl keys
usage`` reads it). A new leader reads the month's days back from the store
(:meth:`Budgets.load`): what the last leader had not written yet (at most
:data:`FLUSH_INTERVAL` seconds of reports) is lost with it.

A key whose use this period (its budget's UTC day or month) reaches its budget
is *spent* (:meth:`Budgets.spent`): every answer tells the gateways, which
refuse its requests with 429 until the period ends. Tokens are reported once
answers end, within a second: a key may go over its budget by what its
requests in flight use, never by a running stream being cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw.tenancy.periods import day_of, period_bounds
from llmgw.wire import BudgetPeriod, KeyLimits, SpentKey, UsageReport

__all__ = ["FLUSH_INTERVAL", "Budgets"]

#: seconds between two writes of the reported usage to the store
FLUSH_INTERVAL = 5.0

#: one stored row: (key name, UTC day, model, requests, prompt tokens, completion tokens)
Row = tuple[str, str, str, int, int, int]


class Budgets:
    """Every key's tokens by UTC day since the month began, and the reports not stored yet."""

    def __init__(self) -> None:
        #: the first UTC day of the month loaded (None: nothing loaded yet)
        self.month: str | None = None
        #: key name -> UTC day -> prompt + completion tokens
        self.days: dict[str, dict[str, int]] = {}
        #: (key name, day, model) -> [requests, prompt, completion] reported and not stored yet
        self._pending: dict[tuple[str, str, str], list[int]] = {}
        #: the clock's time of the last write to the store
        self.flushed = 0.0

    def stale(self, now: float) -> str | None:
        """The first UTC day of the month to load when the month loaded is not ``now``'s; None when it is."""
        month = period_bounds(BudgetPeriod.MONTH, now)[0]
        return None if month == self.month else month

    def load(self, month: str, rows: Iterable[tuple[str, str, int]]) -> None:
        """Take the store's (key name, day, tokens) from ``month`` on; reports not stored yet are kept."""
        self.month = month
        self.days = {}
        for name, day, tokens in rows:
            self.days.setdefault(name, {})[day] = tokens
        for (name, day, _model), counts in self._pending.items():
            if day >= month:
                days = self.days.setdefault(name, {})
                days[day] = days.get(day, 0) + counts[1] + counts[2]

    def add(self, usage: Iterable[UsageReport], now: float) -> None:
        """Count a gateway's report, made at ``now`` (the server's clock)."""
        day = day_of(now)
        for report in usage:
            tokens = report.prompt_tokens + report.completion_tokens
            days = self.days.setdefault(report.key, {})
            days[day] = days.get(day, 0) + tokens
            counts = self._pending.setdefault((report.key, day, report.model), [0, 0, 0])
            counts[0] += report.requests
            counts[1] += report.prompt_tokens
            counts[2] += report.completion_tokens

    def pending(self, now: float) -> list[Row]:
        """The reports not stored yet, as rows, taken out; called when a write of them begins (and put back
        with :meth:`restore` when it fails)."""
        rows = [(name, day, model, *counts) for (name, day, model), counts in self._pending.items()]
        self._pending = {}
        self.flushed = now
        return rows

    def restore(self, rows: Iterable[Row]) -> None:
        """Put back rows whose write failed: the next write takes them again."""
        for name, day, model, requests, prompt, completion in rows:
            counts = self._pending.setdefault((name, day, model), [0, 0, 0])
            counts[0] += requests
            counts[1] += prompt
            counts[2] += completion

    def used(self, name: str, period: BudgetPeriod, now: float) -> int:
        """Tokens key ``name`` used in the ``period`` ``now`` falls in."""
        since = period_bounds(period, now)[0]
        return sum(tokens for day, tokens in self.days.get(name, {}).items() if day >= since)

    def spent(self, limits: Mapping[str, KeyLimits], now: float) -> tuple[SpentKey, ...]:
        """The keys (name -> limits, the live ones) at or over their budget now, with when it resets."""
        spent = []
        for name, wanted in limits.items():
            if wanted.budget is None or self.used(name, wanted.budget_period, now) < wanted.budget:
                continue
            resets_at = period_bounds(wanted.budget_period, now)[1]
            spent.append(SpentKey(name, wanted.budget, str(wanted.budget_period), resets_at))
        return tuple(spent)
