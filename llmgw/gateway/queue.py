"""The gateway's per-model queue: requests wait for a seat, by priority class, then by fair share of tokens.

With ``--replica-concurrency N`` a gateway process sends at most N requests at
once to each replica of a model (its seats: N × the model's replicas). A
request that finds every seat taken, or others already waiting, waits in the
model's queue (at most ``--queue-size`` per model, at most ``--queue-timeout``
seconds); beyond either it is answered 503 with ``Retry-After``
(:class:`Overflow`). ``--replica-concurrency 0`` (the default) sends every
request at once and queues nothing.

Which waiting request goes when a seat frees:

1. its key's priority class: every ``critical`` request before any ``standard``
   one, every ``standard`` before any ``batch`` (:class:`llmgw.wire.Priority`);
2. within a class, the tenant (API key name) with the fewest tokens served, by
   a virtual token counter (VTC, Sheng et al., OSDI 2024): each tenant's
   counter grows by the tokens of its requests (prompt + completion, from the
   engine's usage; at dispatch by the model's mean, corrected when the answer
   ends). A tenant that starts waiting has its counter lifted to the least
   counter of the tenants already waiting in its class (or to the counter of
   the last request started in it), so an idle spell earns no credit;
3. within a tenant, the order the requests came.

A request waiting counts against its key's ``concurrency`` (it was admitted
before it queued). Everything here is plain dicts and deques, O(tenants waiting) per dispatch;
waits run on trio's clock (an autojump clock in tests). Seats are counted per process:
with ``--workers N`` or several gateways, give each ``seats / processes``.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable

import attrs
import trio

from llmgw.wire import Priority

__all__ = ["PRIORITY_ORDER", "QueueCause", "Overflow", "FairQueue", "Queues", "QueueSettings"]

#: the classes in the order they are served
PRIORITY_ORDER = (Priority.CRITICAL, Priority.STANDARD, Priority.BATCH)
_RANK = {priority: rank for rank, priority in enumerate(PRIORITY_ORDER)}
#: tokens a request is assumed to take until the model's first answer says otherwise
_FIRST_ESTIMATE = 256.0
#: the weight of the latest answer in the model's mean tokens per request
_MEAN_WEIGHT = 0.1


class QueueCause(enum.StrEnum):
    """Why the queue turned a request away (the error's ``code``; a metric label)."""

    FULL = "queue_full"
    TIMEOUT = "queue_timeout"


@attrs.frozen
class QueueSettings:
    """The queue's flags: seats per replica (0: no queue), requests waiting per model, seconds of waiting."""

    replica_concurrency: int = 0
    size: int = 1024
    timeout: float = 30.0


@attrs.frozen
class Overflow:
    """A request the model's queue turned away: why, and what the client is told (503, ``Retry-After``)."""

    cause: QueueCause
    model: str
    #: the flag's value: requests for ``queue_full``, seconds for ``queue_timeout``
    limit: float

    def message(self) -> str:
        """The error message for people: which model, which flag, what to do."""
        if self.cause is QueueCause.FULL:
            return (
                f"every replica of model `{self.model}` is busy and {self.limit:g} requests wait for it "
                f"already (--queue-size {self.limit:g}); retry in {self.retry_seconds()} s."
            )
        return (
            f"every replica of model `{self.model}` stayed busy for the {self.limit:g} s this request may "
            f"wait (--queue-timeout {self.limit:g}); retry in {self.retry_seconds()} s."
        )

    def retry_seconds(self) -> int:
        """``Retry-After``: 1 s for a full queue, a quarter of the timeout (1 to 60 s) past the timeout."""
        if self.cause is QueueCause.FULL:
            return 1
        return min(60, max(1, math.ceil(self.limit / 4)))


class _Waiter:
    """One request waiting: its tenant, and the event set once it has a seat."""

    __slots__ = ("tenant", "rank", "event", "seated")

    def __init__(self, tenant: str, rank: int) -> None:
        self.tenant = tenant
        self.rank = rank
        self.event = trio.Event()
        self.seated = False


class FairQueue:
    """One model's waiting requests, by class and fair share: pure bookkeeping, no waiting, no clock.

    :meth:`push` a waiter, :meth:`pop` the next one to serve, :meth:`started` and :meth:`charge` the
    tokens a tenant's requests take.
    """

    __slots__ = ("classes", "counters", "floor", "mean", "waiting")

    def __init__(self) -> None:
        #: one dict per class (PRIORITY_ORDER): tenant -> its waiters, first come first
        self.classes: tuple[dict[str, deque[_Waiter]], ...] = tuple({} for _ in PRIORITY_ORDER)
        #: tenant -> tokens served (virtual: lifted when it starts waiting)
        self.counters: dict[str, float] = {}
        #: per class, the counter of the last request started in it
        self.floor = [0.0] * len(PRIORITY_ORDER)
        #: the model's mean tokens per request, charged at dispatch
        self.mean = _FIRST_ESTIMATE
        #: requests waiting, in every class
        self.waiting = 0

    def push(self, waiter: _Waiter) -> None:
        """Queue ``waiter`` behind its tenant's others; a tenant that was not waiting is lifted (no credit
        for an idle spell)."""
        tenants = self.classes[waiter.rank]
        queue = tenants.get(waiter.tenant)
        if queue is None:
            counters = self.counters
            waiting = [counters[tenant] for tenant in tenants]
            lift = min(waiting) if waiting else self.floor[waiter.rank]
            counters[waiter.tenant] = max(counters.get(waiter.tenant, 0.0), lift)
            queue = tenants[waiter.tenant] = deque()
        queue.append(waiter)
        self.waiting += 1

    def remove(self, waiter: _Waiter) -> None:
        """Take out a waiter that gave up (its client left, or it waited too long)."""
        tenants = self.classes[waiter.rank]
        queue = tenants.get(waiter.tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            self.waiting -= 1
            if not queue:
                del tenants[waiter.tenant]

    def pop(self) -> _Waiter | None:
        """The next waiter to serve (highest class; in it the tenant with the least counter; its first
        request), taken out; None when nobody waits."""
        if not self.waiting:
            return None
        for tenants in self.classes:
            if tenants:
                counters = self.counters
                tenant = min(tenants, key=counters.__getitem__)
                queue = tenants[tenant]
                waiter = queue.popleft()
                if not queue:
                    del tenants[tenant]
                self.waiting -= 1
                return waiter
        return None  # pragma: no cover - waiting counts what the classes hold

    def started(self, tenant: str, rank: int) -> None:
        """A request of ``tenant`` in class ``rank`` takes a seat: charged the model's mean tokens for now."""
        counter = self.counters.get(tenant, self.floor[rank]) + self.mean
        self.counters[tenant] = counter
        self.floor[rank] = counter

    def charge(self, tenant: str, tokens: int | None) -> None:
        """A request of ``tenant`` ended having taken ``tokens`` (None: unknown, the estimate stands)."""
        if tokens is None:
            return
        self.counters[tenant] = self.counters.get(tenant, 0.0) + tokens - self.mean
        self.mean += _MEAN_WEIGHT * (tokens - self.mean)


class Queues:
    """Every model's seats and queue in one gateway process.

    :param settings: the flags (``replica_concurrency`` 0: nothing is ever queued).
    :param replicas: the number of replicas a model has now (the balancer's).

    Waits run on trio's clock (an autojump clock in tests).
    """

    def __init__(self, settings: QueueSettings, replicas: Callable[[str], int]) -> None:
        self.settings = settings
        self.enabled = settings.replica_concurrency > 0
        self._replicas = replicas
        #: model -> its queue
        self.queues: dict[str, FairQueue] = {}
        #: model -> requests holding a seat
        self.seated: dict[str, int] = {}

    def _free(self, model: str) -> bool:
        replicas = self._replicas(model)
        if not replicas:  # a model waking from zero: its requests are held by the proxy, not here
            return True
        return self.seated.get(model, 0) < replicas * self.settings.replica_concurrency

    async def enter(self, model: str, tenant: str, priority: Priority) -> Overflow | None:
        """Wait for a seat for a request of ``tenant`` (its key's name) for ``model``.

        Called once per request after its admission, when the queue is :attr:`enabled`; on None the request
        holds a seat until :meth:`leave`. A client that leaves while waiting gives its place up.

        :returns: None once seated, or an :class:`Overflow` (nothing held) when the queue is full or the
            request waited ``--queue-timeout`` seconds.
        """
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = FairQueue()
        rank = _RANK[priority]
        if not queue.waiting and self._free(model):
            self.seated[model] = self.seated.get(model, 0) + 1
            queue.started(tenant, rank)
            return None
        settings = self.settings
        if queue.waiting >= settings.size:
            return Overflow(QueueCause.FULL, model, settings.size)
        waiter = _Waiter(tenant, rank)
        queue.push(waiter)
        try:
            with trio.move_on_after(settings.timeout):
                await waiter.event.wait()
        except BaseException:  # the client left: its place, or the seat it was just given, goes on
            if waiter.seated:
                self.leave(model, tenant, None)
            else:
                queue.remove(waiter)
            raise
        if waiter.seated:
            return None
        queue.remove(waiter)
        return Overflow(QueueCause.TIMEOUT, model, settings.timeout)

    def leave(self, model: str, tenant: str, tokens: int | None) -> None:
        """A seated request ended having taken ``tokens`` (prompt + completion; None: unknown): its seat goes
        to the next waiter. Called once per request :meth:`enter` seated."""
        self.seated[model] -= 1
        queue = self.queues[model]
        queue.charge(tenant, tokens)
        self._dispatch(model, queue)

    def routes_changed(self) -> None:
        """The replicas changed: seats a new replica brings go to waiters. Called with every routes table."""
        for model, queue in self.queues.items():
            self._dispatch(model, queue)

    def _dispatch(self, model: str, queue: FairQueue) -> None:
        while queue.waiting and self._free(model):
            waiter = queue.pop()
            assert waiter is not None
            waiter.seated = True
            self.seated[model] = self.seated.get(model, 0) + 1
            queue.started(waiter.tenant, waiter.rank)
            waiter.event.set()

    def depth(self) -> dict[tuple[str, Priority], int]:
        """Requests waiting now, by (model, priority class); for the ``/metrics`` gauge."""
        return {
            (model, priority): sum(len(waiters) for waiters in queue.classes[rank].values())
            for model, queue in self.queues.items()
            for rank, priority in enumerate(PRIORITY_ORDER)
        }
