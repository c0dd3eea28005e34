"""Models that wake on demand: requests held while a model is at zero replicas, and the activity reported.

A model whose catalog ``replicas.min`` is 0 is named in the routes feed's
``wake_on_demand``. While such a model has no route, :meth:`Demand.hold` keeps
its requests (at most ``hold_queue`` per model, each at most ``hold_timeout``
seconds) and asks :meth:`Demand.report` to tell the server at once; they go to
the first replica the routes feed brings. Beyond the queue or the timeout the
request is answered 503 with ``Retry-After``, naming the model and why.

:meth:`Demand.run` posts a :class:`~llmgw.wire.GatewayActivity` to the server
(``POST /v1/gateway/activity``) every :data:`REPORT_INTERVAL` seconds, and at
once when a request is held: for each such model, the seconds since its last
request (0 while one is in flight or held) and how many are held; and for
every model that streamed, the 95th percentile of its time to first token since
the last report. The server's autoscaler takes an idle model to zero, wakes a
held one, and reads the percentile for a ``ttft_p95`` target. Only models that
wake on demand are counted request by request: the others cost one set lookup.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable

import trio

from llmgw.gateway.adapters import AdapterDemand
from llmgw.wire import GatewayActivity, ModelActivity, RouteTable

__all__ = ["ACTIVITY_PATH", "REPORT_INTERVAL", "Demand"]

log = logging.getLogger("llmgw.gateway")

#: the server's endpoint for activity reports
ACTIVITY_PATH = "/v1/gateway/activity"
#: seconds between two activity reports (a held request is reported at once)
REPORT_INTERVAL = 5.0
#: streams whose time to first token one report window keeps per model (a random sample beyond)
TTFT_SAMPLES = 512


class Demand:
    """The requests of the models that wake on demand: counted, and held while such a model has no route.

    :param hold_timeout: seconds a request waits for a replica of a model at zero (``--hold-timeout``).
    :param hold_queue: requests held at once per model (``--hold-queue``); more are answered 503.
    """

    def __init__(self, hold_timeout: float = 300.0, hold_queue: int = 256) -> None:
        self.hold_timeout = hold_timeout
        self.hold_queue = hold_queue
        #: served names of the models that wake on demand (the routes feed's ``wake_on_demand``)
        self.wake_on_demand: frozenset[str] = frozenset()
        #: model -> trio time of its last request here
        self.last_request: dict[str, float] = {}
        #: model -> requests in flight (held ones included)
        self.in_flight: Counter[str] = Counter()
        #: model -> requests held now
        self.held: Counter[str] = Counter()
        #: model -> the time to first token of each stream since the last report (at most TTFT_SAMPLES)
        self.ttft: dict[str, list[float]] = {}
        self._routes_changed = trio.Event()
        self._report_now = trio.Event()
        #: model -> the ticket of the last request held; the last ticket whose request left the hold,
        #: counting in order; tickets that left out of order
        self._tickets: dict[str, int] = {}
        self._turn: dict[str, int] = {}
        self._left: dict[str, set[int]] = {}
        self._turn_changed = trio.Event()
        #: requests for LoRA adapters: counted, held while no replica has theirs loaded (reported here)
        self.adapters = AdapterDemand(hold_timeout, hold_queue, lambda: self._report_now.set())

    def routes_changed(self, table: RouteTable) -> None:
        """Take a new routes table: which models wake on demand; held requests look for a route again.

        Called by the routes watcher with every new table.
        """
        self.wake_on_demand = frozenset(table.wake_on_demand)
        self.adapters.routes_changed(table)
        self._routes_changed.set()
        self._routes_changed = trio.Event()

    def began(self, model: str) -> None:
        """A request for ``model`` (one that wakes on demand) began; :meth:`ended` is called once it ends.

        The first request after a quiet spell is reported at once: the server may be about to put the
        model to sleep on the last report, up to :data:`REPORT_INTERVAL` seconds old.
        """
        now = trio.current_time()
        last = self.last_request.get(model)
        if self.in_flight[model] == 0 and (last is None or now - last >= REPORT_INTERVAL):
            self._report_now.set()
        self.in_flight[model] += 1
        self.last_request[model] = now

    def ended(self, model: str) -> None:
        """A request :meth:`began` is over (answered, failed, or its client left)."""
        self.in_flight[model] -= 1
        self.last_request[model] = trio.current_time()

    def first_token(self, model: str, seconds: float) -> None:
        """A stream of ``model`` sent its first token ``seconds`` after the request came; called for every
        stream (any model: a ``ttft_p95`` target reads them)."""
        samples = self.ttft.setdefault(model, [])
        if len(samples) < TTFT_SAMPLES:
            samples.append(seconds)
        else:  # keep a fair sample of a busy window: replace one at random
            samples[random.randrange(TTFT_SAMPLES)] = seconds

    async def hold(self, model: str, routed: Callable[[], bool]) -> str | None:
        """Hold a request for ``model`` until ``routed()`` (a replica is in the routes) or the hold ends.

        Called by the proxy for a model that wakes on demand and has no route; the server hears of the
        held request at once.

        :returns: None once routed; else why the request cannot wait (for the 503 the proxy answers).
        """
        if self.held[model] >= self.hold_queue:
            return (
                f"model `{model}` is at zero replicas and waking up; {self.held[model]} requests wait for it "
                f"already (--hold-queue {self.hold_queue}); retry later"
            )
        self.held[model] += 1
        self._report_now.set()
        ticket = self._tickets[model] = self._tickets.get(model, 0) + 1
        try:
            with trio.move_on_after(self.hold_timeout):
                while True:
                    while not routed():
                        await self._routes_changed.wait()
                    # held requests leave in the order they came: the first of a batch larger than the
                    # replica's seats is not served last
                    if self._turn.get(model, 0) + 1 >= ticket:
                        return None
                    await self._turn_changed.wait()
        finally:
            self.held[model] -= 1
            self._left.setdefault(model, set()).add(ticket)
            turn = self._turn.get(model, 0)
            while turn + 1 in self._left[model]:
                turn += 1
                self._left[model].discard(turn)
            self._turn[model] = turn
            self._turn_changed.set()
            self._turn_changed = trio.Event()
        return (
            f"model `{model}` is at zero replicas and no replica became ready within "
            f"{self.hold_timeout:g} s (--hold-timeout); retry later"
        )

    def activity(self, now: float) -> GatewayActivity:
        """What to report, and start a new window: each model that wakes on demand and had a request here
        (its idle time and held requests), and each model that streamed (its time to first token, p95)."""
        models = []
        ttft, self.ttft = self.ttft, {}
        for model in sorted((self.wake_on_demand & self.last_request.keys()) | ttft.keys()):
            idle = None
            if model in self.wake_on_demand:
                idle = 0.0 if self.in_flight[model] > 0 else max(0.0, now - self.last_request[model])
            samples = sorted(ttft.get(model, ()))
            p95 = samples[min(len(samples) - 1, int(0.95 * len(samples)))] if samples else None
            models.append(
                ModelActivity(model, idle=idle, held=self.held[model], ttft_p95=p95, streams=len(samples))
            )
        return GatewayActivity(tuple(models), self.adapters.activity())

    async def run(
        self,
        post: Callable[[GatewayActivity], Awaitable[object]],
        *,
        interval: float = REPORT_INTERVAL,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Send the activity with ``post`` every ``interval`` seconds and at once on a held request, while
        some model wakes on demand or some adapter was requested; runs until cancelled."""
        task_status.started()
        while True:
            with trio.move_on_after(interval):
                await self._report_now.wait()
            self._report_now = trio.Event()
            activity = self.activity(trio.current_time())
            if activity.models or activity.adapters:
                await post(activity)
