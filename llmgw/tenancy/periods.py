"""Budget periods: the UTC calendar day or month a moment falls in, and when that period ends.

Pure: every function takes the time (UNIX seconds) from its caller. Usage is stored per UTC day
(``2026-12-04``); a month's use is the sum of its days.
"""

from __future__ import annotations

import datetime as dt

from llmgw.wire import BudgetPeriod

__all__ = ["day_of", "period_bounds"]


def day_of(now: float) -> str:
    """The UTC day ``now`` falls in, as stored: ``YYYY-MM-DD``."""
    return dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%d")


def period_bounds(period: BudgetPeriod, now: float) -> tuple[str, float]:
    """The ``period`` (day or month) ``now`` falls in: (its first UTC day, ``YYYY-MM-DD``; when it ends,
    UNIX seconds: the budget is whole again then)."""
    moment = dt.datetime.fromtimestamp(now, dt.UTC)
    if period is BudgetPeriod.DAY:
        start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
        end = start + dt.timedelta(days=1)
    else:
        start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (
            start.replace(year=start.year + 1, month=1)
            if start.month == 12
            else start.replace(month=start.month + 1)
        )
    return start.strftime("%Y-%m-%d"), end.timestamp()
