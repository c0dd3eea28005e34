"""Leases: a gateway process's share of its limited keys' rates and seats, lent by the server for the fleet.

Each gateway process counts its own requests (:mod:`llmgw.gateway.admission`);
alone, N processes would admit N times a key's rate. So the server keeps one
bucket per key for the fleet (:mod:`llmgw.server.state.allowances`) and lends
from it: a gateway admits a request of a key with ``rpm`` only while it holds
a request granted by the server, and a request of a key with ``tpm`` only
while the fleet's token bucket is positive. The gateway asks
(``POST /v1/gateway/allowances``, with its gateway certificate) every period
(one second, the server says) for the keys it saw requests of, reporting the
tokens their answers used; and at once, while the request waits, when a key
it holds nothing for is asked for and the fleet had some left at the last
answer. It asks for what the key's requests took in the last period (or the
current one, when more): a steady key holds a period's requests and does not
wait for an exchange per request. Requests it holds unused for a whole period
go back to the server.

Accuracy: the fleet never admits more requests than the server's bucket
lent (the limit per minute, refilled evenly); it may admit fewer while a
gateway holds requests it does not use (at most what it asked for in one
period) or died holding them. Tokens are charged once answers end, reported
within a period: the fleet may go over ``tpm`` by what its requests in flight
and one period's answers use, as one process does. A new leader starts the
buckets of the keys it found empty: a failover lends no fresh minute
(:mod:`llmgw.server.state.allowances`).

Every answer's tokens, of any key, are reported per key and model with the
next exchange (:meth:`Leases.used`): the server counts them against budgets
(:mod:`llmgw.server.state.budgets`) and answers the keys spent, whose requests
the gateway then refuses until their period ends. A report the server did not
take goes with the next exchange.

A key's ``concurrency`` is lent on the same exchange as seats
(:mod:`llmgw.gateway.seats`): the process reports the seats it holds and uses
with each exchange, asks for more at once when a request finds none free, and
its seats last the server's TTL from the last exchange answered.

A gateway that loses the server keeps admitting from what it holds, and
refuses the rest (429) until the server answers again. A server without the
endpoint (an older llmgw) answers 404: the gateway then counts per process;
one from before seats answers no ``seat_ttl``: ``concurrency`` counts per process.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Callable

import attrs
import trio

from llmgw.gateway.reports import post_to_leader
from llmgw.gateway.seats import HeldSeats
from llmgw.net.client import ConnectionPool
from llmgw.serverlist import ServerList
from llmgw.wire import (
    AllowanceReply,
    AllowanceRequest,
    KeyDemand,
    SpentKey,
    UsageReport,
    WireError,
    from_json,
)

__all__ = ["ALLOWANCES_PATH", "Leases"]

log = logging.getLogger("llmgw.gateway")

#: the server's endpoint
ALLOWANCES_PATH = "/v1/gateway/allowances"


class _Lease:
    """What the gateway holds of one key and what it saw since its last exchange."""

    __slots__ = (
        "held",
        "asked",
        "before",
        "window_start",
        "waiting",
        "reserved",
        "tokens",
        "last_seen",
        "requests_until",
        "tokens_until",
    )

    def __init__(self) -> None:
        #: requests granted and not used yet
        self.held = 0
        #: requests of the key (admitted or not) since ``window_start``, and in the period before it
        self.asked = 0
        self.before = 0
        #: the clock's time the current window of one period began
        self.window_start = 0.0
        #: requests waiting now for an exchange to end
        self.waiting = 0
        #: of ``held``, what the last exchange lent for the requests that waited for it and did not take yet
        self.reserved = 0
        #: tokens used by answers that ended since the last exchange (not reported yet)
        self.tokens = 0
        #: the clock's time of the key's last request
        self.last_seen = 0.0
        #: the clock's time until which the fleet has no whole request to lend
        self.requests_until = 0.0
        #: the clock's time until which the fleet's tpm bucket is not positive
        self.tokens_until = 0.0


class Leases:
    """A gateway process's leases, and the task that renews them.

    :param pool: the connection pool to the server (its TLS context holds the gateway's certificate).
    :param server: the server's base URL (several: comma-separated).
    :param clock: seconds on a monotonic clock (``trio.current_time``).
    :param timeout: seconds one exchange may take.
    """

    def __init__(
        self, pool: ConnectionPool, server: str, clock: Callable[[], float], *, timeout: float = 5.0
    ) -> None:
        self.pool = pool
        self.servers = ServerList.parse(server, schemes=("http", "https"))
        self.clock = clock
        self.timeout = timeout
        #: this process, as the server's log names it
        self.gateway = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        #: None until the server first answered; False: it has no allowances endpoint (per-process counts)
        self.supported: bool | None = None
        #: whether the last exchange succeeded
        self.up = False
        #: seconds between two exchanges (the server's word)
        self.period = 1.0
        #: exchanges done (for tests)
        self.exchanges = 0
        self._leases: dict[str, _Lease] = {}
        #: (key name, model) -> [requests, prompt tokens, completion tokens] not reported yet
        self._usage: dict[tuple[str, str], list[int]] = {}
        #: whether some key has a budget: exchanges go on even with nothing to report, to learn who is spent
        self.budgeted = False
        #: key name -> its budget spent this period, as the server said last
        self.spent: dict[str, SpentKey] = {}
        #: None until the server first answered; False: it lends no seats (``concurrency`` per process)
        self.seats_supported: bool | None = None
        #: key name -> its ``concurrency`` (the keys that have one), and the seats held of those asked for
        self._seat_limits: dict[str, int] = {}
        self._seats: dict[str, HeldSeats] = {}
        self._wake = trio.Event()
        self._answered = trio.Event()

    @property
    def active(self) -> bool:
        """Whether admission goes by leases (False while the server is known to have no such endpoint)."""
        return self.supported is not False

    # -- called by admission (synchronous) -------------------------------------------------------

    def seen(self, key: str) -> None:
        """Count a request of rate-limited ``key`` (admitted or not): the demand the next exchange reports."""
        lease = self._lease(key)
        lease.asked += 1
        lease.last_seen = self.clock()

    def take(self, key: str, *, again: bool = False) -> bool:
        """Spend one held request of ``key``; False when none is held (nothing spent).

        What an exchange lent goes first to the requests that waited for it (``again``: one of them asks
        again, :meth:`refresh`): a request that arrives just after the answer, before they ask, takes only
        what they leave.
        """
        lease = self._lease(key)
        if again and lease.held >= 1:
            lease.reserved = max(0, lease.reserved - 1)
            lease.held -= 1
            return True
        if lease.held > lease.reserved:
            lease.held -= 1
            return True
        return False

    def requests_wait(self, key: str) -> float | None:
        """Seconds until the fleet may lend ``key`` a request; None when it had some at the last answer
        and the server answers (worth an exchange now: :meth:`refresh`)."""
        lease = self._lease(key)
        left = lease.requests_until - self.clock()
        if left > 0:
            return left
        return None if self.up or self.supported is None else self.period

    def tokens_wait(self, key: str) -> float:
        """Seconds until the fleet's tpm bucket for ``key`` is positive again (0: it is)."""
        return max(0.0, self._lease(key).tokens_until - self.clock())

    def charge(self, key: str, tokens: int) -> None:
        """Count ``tokens`` of an answer of ``key`` that ended; reported at the next exchange."""
        self._lease(key).tokens += tokens

    def used(self, key: str, model: str, usage: tuple[int, int]) -> None:
        """Count an answer of ``key`` (any key) for ``model`` that ended having used (prompt, completion)
        tokens; reported at the next exchange, counted against its budget and shown by ``ctl keys usage``
        (nothing is kept for a server without the endpoint)."""
        if self.supported is False:
            return
        counts = self._usage.get((key, model))
        if counts is None:
            counts = self._usage[(key, model)] = [0, 0, 0]
        counts[0] += 1
        counts[1] += usage[0]
        counts[2] += usage[1]

    def forget(self, keep: set[str]) -> None:
        """Drop the leases of keys no longer limited by a rate (a new routes table)."""
        for key in [k for k in self._leases if k not in keep]:
            del self._leases[key]

    def follow_seats(self, limits: dict[str, int]) -> None:
        """Take the keys' ``concurrency`` of a new routes table (key name -> limit; others have none)."""
        self._seat_limits = limits
        for key in [k for k in self._seats if k not in limits]:
            del self._seats[key]
        for key, seats in self._seats.items():
            seats.limit = limits[key]

    def seats(self, key: str) -> HeldSeats | None:
        """The seats held of ``key`` (which has a ``concurrency``); None while the server lends no seats (it
        answered without them, or has no allowances endpoint): the process counts alone then."""
        if self.seats_supported is False or not self.active:
            return None
        seats = self._seats.get(key)
        if seats is None:
            seats = self._seats[key] = HeldSeats(self._seat_limits.get(key, 0))
        return seats

    def seats_wait(self, key: str) -> float | None:
        """Seconds until a seat of ``key`` is worth asking for; None when it is now (:meth:`refresh`): the
        last answer did not find the fleet's seats taken, and the server answers."""
        seats = self._seats.get(key)
        left = seats.full_until - self.clock() if seats is not None else 0.0
        if left > 0:
            return left
        return None if self.up or self.supported is None else self.period

    def _lease(self, key: str) -> _Lease:
        lease = self._leases.get(key)
        if lease is None:
            lease = self._leases[key] = _Lease()
            lease.window_start = self.clock()
        return lease

    # -- exchanges ---------------------------------------------------------------------------------

    async def refresh(self, key: str) -> None:
        """Ask the server now for ``key``; returns once it answered (or failed). Callers own the deadline."""
        lease = self._leases.get(key)
        seats = self._seats.get(key)
        for waiter in (lease, seats):
            if waiter is not None:
                waiter.waiting += 1
        answered = self._answered
        self._wake.set()
        try:
            await answered.wait()
        finally:
            for waiter in (lease, seats):
                if waiter is not None:
                    waiter.waiting -= 1

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Exchange with the server every period, and when a request waits; until cancelled."""
        task_status.started()
        while True:
            with trio.move_on_after(self.period):
                await self._wake.wait()
            self._wake = trio.Event()
            answered, self._answered = self._answered, trio.Event()
            try:
                if self._leases or self._seats or self._usage or self.budgeted:
                    await self.exchange()
            finally:
                answered.set()

    async def close(self) -> None:
        """The last exchange of a gateway that stops: report the usage not reported yet and give back every
        request held, asking for none. Called once no request is in flight; callers own the deadline.

        A gateway killed (SIGKILL) loses what it had not reported: at most one period of its answers."""
        if self.supported is not True or not self.up:  # never answered, no such endpoint, or unreachable now
            return
        await self.exchange(last=True)

    async def exchange(self, *, last: bool = False) -> None:
        """One request and its answer: report the keys' demand and tokens, take what is lent (``last``:
        give back everything held and ask for nothing: the gateway stops)."""
        demands: dict[str, KeyDemand] = {}
        sent: dict[str, tuple[int, int]] = {}
        returned: dict[str, int] = {}
        now = self.clock()
        for key, lease in self._leases.items():
            if now - lease.window_start >= self.period:  # a new window: the last one's count is the demand
                lease.before = lease.asked if now - lease.window_start < 2 * self.period else 0
                lease.asked, lease.window_start = 0, now
            wanted = max(lease.waiting, lease.before, lease.asked) - lease.held
            if lease.held and (last or now - lease.last_seen >= self.period):  # unused: back to the fleet
                returned[key], lease.held, wanted = lease.held, 0, 0
            elif (wanted <= 0 or last) and not lease.tokens:
                continue
            if last:
                wanted = 0
            demands[key] = KeyDemand(key, max(0, wanted), lease.tokens, returned.get(key, 0))
            sent[key] = (lease.tokens, lease.waiting)
        seats_asked = self._seat_demands(demands, now, last)
        usage, self._usage = self._usage, {}
        if not demands and not usage and not self.budgeted:
            return
        reports = tuple(UsageReport(key, model, *counts) for (key, model), counts in usage.items())
        reply = await self._post(AllowanceRequest(self.gateway, tuple(demands.values()), reports))
        if reply is None:
            for key, count in returned.items():  # not given back: still this gateway's
                if key in self._leases:
                    self._leases[key].held += count
            for (key, model), counts in usage.items():  # reported with the next exchange
                for index, count in enumerate(counts):
                    self._usage.setdefault((key, model), [0, 0, 0])[index] += count
            return
        self.spent = {spent.key: spent for spent in reply.spent}
        sent_at, now = now, self.clock()
        self.seats_supported = reply.seat_ttl is not None
        for key, (tokens, _) in sent.items():  # what came in meanwhile stays for the next exchange
            lease = self._leases.get(key)
            if lease is not None:
                lease.tokens -= min(tokens, lease.tokens)
        for allowance in reply.keys:
            seats, asked = self._seats.get(allowance.key), seats_asked.get(allowance.key)
            if seats is not None and asked is not None and allowance.seats is not None and reply.seat_ttl:
                seats.lent(allowance.seats, sent_at, reply.seat_ttl, now, self.period, asked)
            lease = self._leases.get(allowance.key)
            if lease is None:
                continue
            lease.held += allowance.granted
            lease.reserved = min(lease.held, sent[allowance.key][1]) if allowance.key in sent else 0
            lease.requests_until = now + allowance.requests_wait
            lease.tokens_until = now + allowance.tokens_wait
        self.period = min(max(reply.period, 0.05), 60.0)

    def _seat_demands(self, demands: dict[str, KeyDemand], now: float, last: bool) -> dict[str, tuple]:
        """Add the seats of each key with something to say (held, in use or wanted) to ``demands``; seats
        held beyond those wanted are given back at once. Returns key -> (seats needed, requests waiting)."""
        asked: dict[str, tuple] = {}
        if self.seats_supported is False:
            return asked
        for key, seats in self._seats.items():
            held = seats.valid(now)
            wanted, needed = seats.wanted(now, self.period, last=last)
            if not (held or seats.used or wanted):
                continue
            counts = {"seats_held": min(held, wanted), "seats_used": seats.used, "seats_wanted": wanted}
            demand = demands.get(key)
            demands[key] = attrs.evolve(demand, **counts) if demand is not None else KeyDemand(key, **counts)
            asked[key] = (needed, seats.waiting)
        return asked

    async def _post(self, request: AllowanceRequest) -> AllowanceReply | None:
        response, answer, why = await post_to_leader(
            self.pool, self.servers, ALLOWANCES_PATH, request, within=self.timeout, limit=4 * 1024 * 1024
        )
        if response is not None and response.status == 404 and self.supported is not True:
            log.warning("the server has no %s (an older llmgw): limits count per process", ALLOWANCES_PATH)
            self.supported = False
            return None
        if response is not None and response.status == 200:
            try:
                reply = from_json(answer, AllowanceReply)
            except WireError as exc:
                why = str(exc)
            else:
                if not self.up:
                    log.info("leasing key limits from %s", self.servers.current)
                self.supported = self.up = True
                self.exchanges += 1
                return reply
        elif response is not None:
            why = f"HTTP {response.status}: {(response.content or b'')[:200].decode(errors='replace')}"
        if self.up:
            log.warning("cannot renew key limit leases: %s; admitting from what is held", why)
        self.up = False
        return None
