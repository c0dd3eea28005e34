"""Admission: whether one API key's request may go now, by the key's limits.

The routes feed hands the gateway each key's :class:`~llmgw.wire.KeyLimits`
(:attr:`llmgw.wire.RouteTable.limits`); :meth:`Admission.admit` is asked once
per inference request, before it is routed, and answers a :class:`Ticket` or a
:class:`Refused` with its :class:`Cause`:

- ``models``: the key may not use that model (403);
- ``rpm``: a token bucket per key holding up to ``rpm`` requests, refilled at
  ``rpm / 60`` per second; a request takes one (429 with ``Retry-After`` when
  there is less than one);
- ``tpm``: a token bucket per key holding up to ``tpm`` tokens, refilled alike;
  a request's prompt + completion tokens are known only once its answer ends
  (the engine's ``usage``), so they are charged then, and the bucket may go
  negative: requests are refused while it is not positive (429);
- ``concurrency``: requests of the key in flight at once (429), for the whole
  fleet: each on a seat the process holds (:mod:`llmgw.gateway.seats`);
- ``budget``: tokens per UTC day or month for the whole fleet, counted by the
  server from every gateway's reports (:mod:`llmgw.gateway.leases`): a key the
  server says is spent is refused (429, ``Retry-After`` until the period ends).

A request admitted is never cut afterwards: limits act at admission only, and
a running stream's tokens are charged when it ends. Buckets start full, so a
key may use its whole minute at once.

Each process counts its own requests, and with :mod:`llmgw.gateway.leases`
also admits a limited key's request only with the fleet's leave (a request
lent for rpm, the tpm bucket positive, a seat for concurrency): N processes
(``--workers``, several gateways) then admit the limit in all, not N times it.
A server without leases (or from before seats) leaves each process to count alone.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import attrs

from llmgw.tenancy.bucket import KeyBuckets, follow_keys
from llmgw.wire import KeyLimits, Priority

if TYPE_CHECKING:
    from llmgw.gateway.leases import Leases
    from llmgw.gateway.seats import HeldSeats

__all__ = ["Admission", "Cause", "Refused", "Ticket"]

#: seconds on a monotonic clock
Clock = Callable[[], float]


class Cause(enum.StrEnum):
    """Why a request was refused: the limit it hit (the error's ``code`` says ``<cause>_limit``)."""

    MODELS = "models"
    RPM = "rpm"
    TPM = "tpm"
    CONCURRENCY = "concurrency"
    BUDGET = "budget"


@attrs.frozen
class Refused:
    """A request that may not go now: the limit it hit, and in how many seconds it may be tried again."""

    cause: Cause
    key: str
    #: the limit's value (requests or tokens per minute, requests at once); 0 for ``models``
    limit: int
    #: seconds until a retry may pass (None for ``models``: it never will)
    retry_after: float | None = None
    #: the gateway holds no lease for it, but the fleet had requests left: worth asking the server now
    renewable: bool = False
    #: for ``budget``: its period (``day``, ``month``) and when it resets (UNIX time)
    period: str = ""
    resets_at: float = 0.0

    @property
    def status(self) -> int:
        """The HTTP status: 403 for a model not allowed, 429 for a rate or concurrency."""
        return 403 if self.cause is Cause.MODELS else 429

    def message(self, model: str) -> str:
        """The error message for people: which key, which limit, what to do."""
        if self.cause is Cause.MODELS:
            return f"API key '{self.key}' may not use the model `{model}`; ask an operator to allow it."
        if self.cause is Cause.BUDGET:
            resets = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.resets_at))
            return (
                f"API key '{self.key}' has used its budget of {self.limit} tokens per {self.period} "
                f"(budget); it resets at {resets}, in {self.retry_seconds()} s."
            )
        what = {
            Cause.RPM: f"{self.limit} requests per minute (rpm)",
            Cause.TPM: f"{self.limit} tokens per minute (tpm)",
            Cause.CONCURRENCY: f"{self.limit} requests at once (concurrency)",
        }[self.cause]
        return f"API key '{self.key}' is over its limit of {what}; retry in {self.retry_seconds()} s."

    def retry_seconds(self) -> int:
        """:attr:`retry_after` as ``Retry-After`` says it: whole seconds, at least 1."""
        return max(1, math.ceil(self.retry_after or 0.0))


class _KeyState(KeyBuckets):
    """One limited key's name, buckets, and requests in flight."""

    __slots__ = ("name", "in_flight")

    def __init__(self, name: str, limits: KeyLimits, now: float) -> None:
        super().__init__(limits, now)
        self.name = name
        self.in_flight = 0

    @classmethod
    def new(cls, name: str, limits: KeyLimits, now: float) -> _KeyState:
        """A key new to the gateway: its buckets full."""
        return cls(name, limits, now)


class Ticket:
    """An admitted request of a limited key: :meth:`done` once its answer is over."""

    __slots__ = ("_state", "_clock", "_leases", "_seats", "_open")

    def __init__(self, key: _KeyState, clock: Clock, leases: Leases | None, seats: HeldSeats | None) -> None:
        self._state = key
        self._clock = clock
        self._leases = leases
        #: the key's seats in this process, one of which the request holds (None: counted per process)
        self._seats = seats
        self._open = True

    def done(self, usage: tuple[int, int] | None) -> None:
        """The answer ended (or the client left): free its place, charge its (prompt, completion) tokens.

        Called once per request when its response is over; a second call does nothing.
        """
        if not self._open:
            return
        self._open = False
        state = self._state
        state.in_flight -= 1
        if self._seats is not None:
            self._seats.release()
        if usage is not None and state.tokens is not None:
            state.tokens.take(usage[0] + usage[1], self._clock())
            if self._leases is not None:
                self._leases.charge(state.name, usage[0] + usage[1])


class Admission:
    """Every limited key's buckets in one gateway process, and the decision for each request.

    :param clock: seconds on a monotonic clock (``trio.current_time`` in the gateway; a fake one in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, leases: Leases | None = None) -> None:
        self.clock = clock
        #: the fleet-wide leases (None: this process counts alone)
        self.leases = leases
        self._keys: dict[str, _KeyState] = {}

    def update(self, limits: Mapping[str, KeyLimits]) -> None:
        """Take the limits of a new routes table (key name -> limits; a key not named is unlimited).

        Called on every new table: a key whose limits are unchanged keeps its buckets; one whose limits
        changed keeps what it used of the limits that stay.
        """
        self._keys = follow_keys(self._keys, limits, self.clock(), _KeyState.new)
        if self.leases is not None:
            self.leases.forget({name for name, wanted in limits.items() if wanted.rpm or wanted.tpm})
            seated = {name: wanted.concurrency for name, wanted in limits.items() if wanted.concurrency}
            self.leases.follow_seats(seated)
            self.leases.budgeted = any(wanted.budget is not None for wanted in limits.values())

    def forbidden(self, key: str, model: str) -> Refused | None:
        """A :class:`Refused` (``models``) when key ``key`` may not use ``model``, else None; nothing counted.

        Called before the model's readiness is looked at, so such a key learns nothing more of the model.
        """
        state = self._keys.get(key)
        if state is None or state.limits.models is None or model in state.limits.models:
            return None
        return Refused(Cause.MODELS, key, 0)

    def admit(self, key: str, model: str, *, again: bool = False) -> Ticket | Refused | None:
        """Whether a request of key ``key`` (its name) for ``model`` may go now.

        Called once per inference request, after its key and model were found valid; ``again`` when the
        same request asks once more after its :attr:`Refused.renewable` refusal and a lease exchange.

        :returns: None for a key without limits (nothing to release), a :class:`Ticket` (the request
            counts against the key's limits from now; call :meth:`Ticket.done` when it ends), or a
            :class:`Refused` saying which limit it hit (nothing counted).
        """
        state = self._keys.get(key)
        if state is None:
            return None
        limits = state.limits
        if limits.models is not None and model not in limits.models:
            return Refused(Cause.MODELS, key, 0)
        if limits.budget is not None and self.leases is not None and key in self.leases.spent:
            spent = self.leases.spent[key]
            wait = spent.resets_at - time.time()
            return Refused(
                Cause.BUDGET, key, spent.budget, wait, period=spent.period, resets_at=spent.resets_at
            )
        now = self.clock()
        leases = self.leases if self.leases is not None and self.leases.active else None
        if limits.concurrency is not None and state.in_flight >= limits.concurrency:
            # a place frees when a request ends: no way to know when; one second is a fair guess
            return Refused(Cause.CONCURRENCY, key, limits.concurrency, 1.0)
        if leases is not None and not again and (state.tokens is not None or state.requests is not None):
            leases.seen(key)  # before its seat: one exchange asks for both when the request waits
        seats = None
        if limits.concurrency is not None and leases is not None:
            seats = leases.seats(key)
            if seats is not None and not seats.may_take(now, again=again):
                fleet = leases.seats_wait(key)
                retry = fleet if fleet is not None else leases.period
                return Refused(Cause.CONCURRENCY, key, limits.concurrency, retry, renewable=fleet is None)
        if state.tokens is not None:
            wait = max(state.tokens_wait(now), leases.tokens_wait(key) if leases is not None else 0.0)
            if wait > 0:  # refused until positive, however little
                return Refused(Cause.TPM, key, limits.tpm or 0, wait)
        if state.requests is not None:
            wait = state.requests.wait(1.0, now)
            if wait > 0:
                return Refused(Cause.RPM, key, limits.rpm or 0, wait)
            if leases is not None and not leases.take(key, again=again):
                fleet = leases.requests_wait(key)
                retry = fleet if fleet is not None else leases.period
                return Refused(Cause.RPM, key, limits.rpm or 0, retry, renewable=fleet is None)
            state.requests.take(1.0, now)
        if seats is not None:
            seats.take(now, again=again)
        state.in_flight += 1
        return Ticket(state, self.clock, leases, seats)

    def priority(self, key: str) -> Priority:
        """Key ``key``'s priority class in the model queues (``standard`` for a key without limits)."""
        state = self._keys.get(key)
        return state.limits.priority if state is not None else Priority.STANDARD

    def charges_tokens(self, key: str) -> bool:
        """Whether key ``key`` has a ``tpm`` limit (its answers' tokens are charged)."""
        state = self._keys.get(key)
        return state is not None and state.tokens is not None

    def in_flight(self, key: str) -> int:
        """Requests of limited key ``key`` in flight now (0 for a key without limits)."""
        state = self._keys.get(key)
        return state.in_flight if state is not None else 0
