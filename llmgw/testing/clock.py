"""A fake clock for tests: seconds that move only when the test says.

Give it where code takes a ``clock`` callable (the gateway's admission and leases, the server's lender)
and move it with ``clock.now += seconds``.
"""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """A ``clock()`` callable answering :attr:`now`, which only the test changes."""

    def __init__(self, now: float = 0.0) -> None:
        #: what the clock answers, in seconds
        self.now = now

    def __call__(self) -> float:
        return self.now
