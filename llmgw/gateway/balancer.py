"""Choosing a replica: least outstanding requests, session affinity, and a circuit breaker per replica.

- **Least outstanding requests** by the power of two choices: two replicas
  drawn at random among those available, the one with fewer requests in
  flight through this gateway wins.
- **Prefix** (``--routing prefix``): the replica that was sent the longest
  known beginning of the same prompt, within a bound on its load
  (:mod:`llmgw.gateway.prefix`). ``random`` is there for comparison.
- **Session affinity**: a request with an ``X-Session-Id`` header goes to the
  replica that rendezvous hashing (highest random weight) gives for that
  session among the available replicas, so a conversation keeps hitting the
  same engine's prefix cache, and only the sessions of a replica that leaves
  move elsewhere.
- **Circuit breaker**: ``failures`` consecutive failures (connection failed,
  502/503, broken mid-response) open a replica's breaker: it is not chosen for
  ``open_for`` seconds. Then it is half-open: one request is let through as a
  probe; its success closes the breaker, its failure opens it again.

Times are trio's clock, passed in, so the logic runs under a fake clock.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import random
from collections.abc import Collection, Iterator, Mapping, Sequence

import attrs

from llmgw.gateway.prefix import PrefixTable
from llmgw.wire import AdapterRoutes, Route

__all__ = ["BreakerState", "Breaker", "Upstream", "Balancer", "ROUTING_POLICIES"]

#: the ways a replica can be chosen for a request without a session (``--routing``)
ROUTING_POLICIES = ("least-outstanding", "prefix", "random")

log = logging.getLogger("llmgw.gateway")


class BreakerState(enum.IntEnum):
    """A circuit breaker's state; the value is what the metric reports."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@attrs.define
class Breaker:
    """Consecutive failures open it; after ``open_for`` seconds one probe may close it."""

    failures_to_open: int = 3
    open_for: float = 5.0
    state: BreakerState = BreakerState.CLOSED
    #: consecutive failures so far
    failures: int = 0
    opened_at: float = 0.0
    #: whether the half-open probe is in flight
    probing: bool = False

    def allows(self, now: float) -> bool:
        """Whether a request may go to this replica now (turns open into half-open when its time is up)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if now - self.opened_at < self.open_for:
                return False
            self.state = BreakerState.HALF_OPEN
            self.probing = False
        return not self.probing

    def attempt(self) -> None:
        """A request is sent: in half-open state, it is the probe."""
        if self.state is BreakerState.HALF_OPEN:
            self.probing = True

    def succeeded(self) -> bool:
        """The replica answered; True when that closed the breaker."""
        closed = self.state is not BreakerState.CLOSED
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.probing = False
        return closed

    def failed(self, now: float) -> bool:
        """The replica failed; True when that opened the breaker."""
        self.failures += 1
        self.probing = False
        if self.state is BreakerState.OPEN:
            return False
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failures_to_open:
            self.state = BreakerState.OPEN
            self.opened_at = now
            return True
        return False

    def abandoned(self) -> None:
        """A request ended without telling success from failure (its client left)."""
        self.probing = False

    def trip(self, now: float) -> None:
        """Open at once, whatever the count (the gateway found the replica stalled)."""
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.probing = False

    def reopens_in(self, now: float) -> float:
        """Seconds until an open breaker lets a probe through (0 when it would now)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self.opened_at + self.open_for - now)


class Upstream:
    """One ready replica as this gateway sees it: its route, requests in flight and its breaker.

    It also keeps what :mod:`llmgw.gateway.stalls` judges it by: the attempts
    in flight on it, when a byte last came from it, since when it has had
    requests in flight, and whether it was found stalled and has not answered since.
    """

    __slots__ = (
        "route",
        "in_flight",
        "breaker",
        "affinity_key",
        "attempts",
        "last_byte",
        "busy_since",
        "suspect",
        "checking",
    )

    def __init__(self, route: Route, breaker: Breaker) -> None:
        self.route = route
        self.in_flight = 0
        self.breaker = breaker
        self.affinity_key = route.replica.encode()
        #: the attempts in flight on it (:class:`llmgw.gateway.stalls.Attempt`)
        self.attempts: set = set()
        #: trio time a byte last arrived from it (-inf: never)
        self.last_byte = float("-inf")
        #: trio time its requests in flight went from none to one
        self.busy_since = 0.0
        #: found stalled, and nothing has arrived from it since
        self.suspect = False
        #: a stall check of it is under way
        self.checking = False

    @property
    def name(self) -> str:
        """The replica's id."""
        return self.route.replica

    @property
    def url(self) -> str:
        """The base URL of the replica's rank 0."""
        return self.route.url

    @property
    def continues(self) -> bool:
        """Whether its engine continues a final assistant message (a broken stream may go on here)."""
        return self.route.continues

    def begin(self, attempt: object = None, now: float = 0.0) -> None:
        """A request to this replica starts (``attempt``, at trio time ``now``, tracked when given)."""
        if not self.in_flight:
            self.busy_since = now
        self.in_flight += 1
        self.breaker.attempt()
        if attempt is not None:
            self.attempts.add(attempt)

    def end(self, attempt: object = None) -> None:
        """A request to this replica is over, whatever its outcome."""
        self.in_flight -= 1
        self.attempts.discard(attempt)

    def produced(self, now: float) -> None:
        """Bytes arrived from this replica at trio time ``now``."""
        self.last_byte = now
        self.suspect = False

    def succeeded(self) -> None:
        """The replica answered (a response head that is not a failure)."""
        if self.breaker.succeeded():
            log.warning("replica %s (%s) answers again: circuit closed", self.name, self.url)

    def failed(self, now: float, reason: str) -> None:
        """The replica failed a request."""
        if self.breaker.failed(now):
            log.warning(
                "replica %s (%s) failed %d times in a row (last: %s): circuit open for %gs",
                self.name,
                self.url,
                self.breaker.failures,
                reason,
                self.breaker.open_for,
            )

    def abandoned(self) -> None:
        """The request ended with no verdict on the replica (its client left)."""
        self.breaker.abandoned()

    def __repr__(self) -> str:
        return f"<Upstream {self.name} {self.url} in_flight={self.in_flight} {self.breaker.state.name}>"


class Balancer:
    """The ready replicas of every model, and the choice among them.

    :param breaker_failures: consecutive failures that open a replica's breaker.
    :param breaker_open_for: seconds a breaker stays open before its probe.
    :param routing: ``least-outstanding``, ``prefix`` (:mod:`llmgw.gateway.prefix`) or ``random``.
    :param prefix_load_factor: with ``prefix``, the bound on a replica's load relative to the mean.
    :param seats: ``--replica-concurrency``: a request without a session goes to a replica with fewer
        requests in flight than this when there is one (0: any replica).
    """

    def __init__(
        self,
        *,
        breaker_failures: int = 3,
        breaker_open_for: float = 5.0,
        routing: str = "prefix",
        prefix_load_factor: float = 1.5,
        rng: random.Random | None = None,
        seats: int = 0,
    ) -> None:
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}")
        self.breaker_failures = breaker_failures
        self.breaker_open_for = breaker_open_for
        self.routing = routing
        #: requests this process sends a replica at once before preferring another (0: no preference)
        self.seats = seats
        self.prefixes = PrefixTable(load_factor=prefix_load_factor)
        self._rng = rng or random.Random()
        self._models: dict[str, tuple[Upstream, ...]] = {}
        self._replicas: dict[Route, Upstream] = {}
        #: (adapter, replica id) -> the request fields its engine wants for the adapter
        self._adapter_fields: dict[tuple[str, str], Mapping[str, object]] = {}
        #: replica id -> the request fields its engine wants for its base model
        self._base_fields: dict[str, Mapping[str, object]] = {}

    def update(self, routes: Mapping[str, Collection[Route]]) -> list[Upstream]:
        """Replace the routes; a replica that stays keeps its in-flight count and breaker.

        New requests no longer go to a replica that left. Returns the replicas that left
        (what becomes of their requests in flight is :class:`llmgw.gateway.stalls.StallWatch`'s).
        """
        replicas: dict[Route, Upstream] = {}
        models: dict[str, tuple[Upstream, ...]] = {}
        for model, entries in routes.items():
            chosen = []
            for route in entries:
                replica = replicas.get(route) or self._replicas.get(route)
                if replica is None:
                    breaker = Breaker(failures_to_open=self.breaker_failures, open_for=self.breaker_open_for)
                    replica = Upstream(route, breaker)
                replicas[route] = replica
                chosen.append(replica)
            models[model] = tuple(chosen)
        left = [replica for route, replica in self._replicas.items() if route not in replicas]
        self._replicas, self._models = replicas, models
        return left

    def update_adapters(
        self,
        adapters: Mapping[str, AdapterRoutes],
        base_fields: Mapping[str, Mapping[str, object]] | None = None,
    ) -> None:
        """Take where each LoRA adapter is loaded (the routes feed's ``adapters``), and the fields each
        replica wants in a base-model request (its ``base_fields``); called after :meth:`update` with the
        same table. An adapter is chosen like a model, among the replicas of its base that have it loaded
        (the same :class:`Upstream` objects: one in-flight count each)."""
        self._base_fields = dict(base_fields or {})
        by_id = {upstream.name: upstream for upstream in self._replicas.values()}
        fields: dict[tuple[str, str], Mapping[str, object]] = {}
        for name, entry in adapters.items():
            chosen = tuple(by_id[r] for r in sorted(entry.loaded) if r in by_id)
            if chosen and name not in self._models:
                self._models[name] = chosen
            for replica, wanted in entry.loaded.items():
                fields[(name, replica)] = wanted
        self._adapter_fields = fields

    def base_fields(self, replica: str) -> Mapping[str, object] | None:
        """The request fields ``replica``'s engine wants for its base model (None: none)."""
        return self._base_fields.get(replica)

    def adapter_fields(self, adapter: str, replica: str) -> Mapping[str, object] | None:
        """The request fields ``replica``'s engine wants for ``adapter`` (None: not known there)."""
        return self._adapter_fields.get((adapter, replica))

    def replicas(self, model: str | None = None) -> tuple[Upstream, ...]:
        """The current replicas of ``model``, or of every model."""
        if model is None:
            return tuple(self._replicas.values())
        return self._models.get(model, ())

    def __iter__(self) -> Iterator[Upstream]:
        return iter(self._replicas.values())

    def choose(
        self,
        model: str,
        now: float,
        *,
        session: str | None = None,
        prefix: Sequence[bytes] = (),
        exclude: Collection[Upstream] = (),
        continuing: bool = False,
    ) -> Upstream | None:
        """The replica for the next attempt of a request for ``model``; None when none is available.

        :param session: the client's session key: one session gets one replica while that one is available.
        :param prefix: the prompt's prefix keys (:func:`llmgw.gateway.prefix.prefix_keys`), used by the
            ``prefix`` routing policy.
        :param exclude: replicas this request already tried.
        :param continuing: the request continues a broken stream: only replicas whose engine
            continues a final assistant message (:attr:`Upstream.continues`) are candidates.
        """
        candidates = [
            r
            for r in self._models.get(model, ())
            if r not in exclude and r.breaker.allows(now) and (r.route.continues or not continuing)
        ]
        if not candidates:
            return None
        if session is not None:
            key = session.encode()
            return max(candidates, key=lambda r: _weight(key, r.affinity_key))
        if self.seats and len(candidates) > 1:  # a replica with a free seat first (llmgw.gateway.queue)
            free = [r for r in candidates if r.in_flight < self.seats]
            candidates = free or candidates
        if len(candidates) == 1:
            return candidates[0]
        if prefix and self.routing == "prefix":
            return self.prefixes.choose(candidates, prefix)
        if self.routing == "random":
            return self._rng.choice(candidates)
        first, second = self._rng.sample(candidates, 2)
        return second if second.in_flight < first.in_flight else first

    def retry_after(self, model: str, now: float) -> float:
        """Seconds until some replica of ``model`` accepts a request again (its breaker's probe)."""
        waits = [r.breaker.reopens_in(now) for r in self._models.get(model, ())]
        return min(waits, default=0.0)


def _weight(session: bytes, replica: bytes) -> bytes:
    return hashlib.blake2b(session + b"\0" + replica, digest_size=8).digest()
