"""A key's concurrency for the fleet: the server's seats on a fake clock, gateway processes holding them."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from llmgw.gateway.admission import Admission, Cause, Refused, Ticket
from llmgw.gateway.seats import HeldSeats
from llmgw.net.server import HttpServer
from llmgw.server.state.allowances import Lender
from llmgw.server.state.seats import SEAT_TTL
from llmgw.testing.clock import FakeClock
from llmgw.wire import AllowanceRequest, KeyDemand, KeyLimits
from tests.gateway.test_leases import FleetServer, admit, gateway, unstarted, waiting_for_an_exchange

LIMITS = {"k": KeyLimits(concurrency=4)}


def seats(lender: Lender, holder: str, now: float, *, held: int = 0, used: int = 0, wanted: int = 0) -> int:
    """What ``lender`` answers process ``holder`` saying it holds, uses and wants so many seats of k."""
    demand = KeyDemand("k", seats_held=held, seats_used=used, seats_wanted=wanted)
    (allowance,) = lender.lend(LIMITS, AllowanceRequest(holder, (demand,)), now).keys
    return allowance.seats


class TestSeatBook:
    """The leader's seats: never more than the limit held in all, back when a process goes silent."""

    def test_lends_no_more_seats_than_the_limit_across_processes(self):
        """concurrency 4: a gets the 3 it asks, b 1 of its 3, c none; a giving 2 back lets c have them."""
        lender = Lender()
        assert seats(lender, "a", 0.0, wanted=3) == 3
        assert seats(lender, "b", 0.0, wanted=3) == 1
        assert seats(lender, "c", 0.0, wanted=1) == 0
        assert seats(lender, "a", 0.5, held=3, used=1, wanted=1) == 1
        assert seats(lender, "c", 0.5, wanted=2) == 2
        assert lender.seats.lent("k", 0.5) == 4

    def test_two_processes_asking_for_the_last_seat_at_once_one_gets_it(self):
        """Three seats held, two processes ask for the fourth at the same instant: exactly one gets it."""
        lender = Lender()
        assert seats(lender, "a", 0.0, used=3, wanted=3) == 3
        answers = [seats(lender, name, 1.0, wanted=1) for name in ("b", "c")]
        assert sorted(answers) == [0, 1]

    def test_a_silent_process_seats_expire_after_the_ttl(self):
        """A process holding all 4 seats stops reporting (killed): nobody gets one before the TTL passed."""
        lender = Lender()
        assert seats(lender, "a", 0.0, wanted=4) == 4
        assert seats(lender, "b", SEAT_TTL - 0.01, wanted=4) == 0
        assert seats(lender, "b", SEAT_TTL, wanted=4) == 4

    def test_seats_in_use_are_never_taken_back(self):
        """A process whose seats expired with 3 requests running reports them: it keeps 3, over the limit
        lowered to 2, and the others get none until they end."""
        lender = Lender()
        assert seats(lender, "a", 0.0, used=3, wanted=3) == 3
        lowered = {"k": KeyLimits(concurrency=2)}
        demand = KeyDemand("k", seats_used=3, seats_wanted=3)
        assert lender.lend(lowered, AllowanceRequest("a", (demand,)), 1.0).keys[0].seats == 3
        demand = KeyDemand("k", seats_wanted=1)
        assert lender.lend(lowered, AllowanceRequest("b", (demand,)), 1.0).keys[0].seats == 0

    def test_a_new_leader_lends_no_seat_beyond_what_processes_report_until_the_ttl(self):
        """A leader beginning at 100 s with key k: a process reporting 2 held keeps 2 but gets no third, a
        new one gets none; after the TTL and a period every seat the last leader lent has reported or
        ended, and the seats left are lent again; a key made after it began is lent at once."""
        lender = Lender()
        lender.carry(["k"], 100.0)
        assert seats(lender, "a", 101.0, held=2, used=1, wanted=3) == 2
        assert seats(lender, "b", 101.0, wanted=1) == 0
        assert seats(lender, "a", 104.0, held=2, used=2, wanted=3) == 2
        after = 100.0 + SEAT_TTL + lender.period
        assert seats(lender, "b", after, wanted=4) == 2
        later = {"later": KeyLimits(concurrency=4)}
        reply = lender.lend(later, AllowanceRequest("b", (KeyDemand("later", seats_wanted=4),)), 101.0)
        assert reply.keys[0].seats == 4

    def test_a_key_without_concurrency_gets_no_seats(self):
        """A key with only rpm is answered seats None; the reply says the server lends seats (its TTL)."""
        reply = Lender().lend({"k": KeyLimits(rpm=5)}, AllowanceRequest("a", (KeyDemand("k", 1),)), 0.0)
        assert reply.keys[0].seats is None and reply.seat_ttl == SEAT_TTL


class TestHeldSeats:
    """A process's seats of one key: what it asks for, and who may take a free one."""

    def test_a_request_coming_while_an_exchange_is_out_leaves_the_free_seats_to_those_waiting(self):
        """Two seats held, one in use, one request waiting for the exchange being sent: a request coming while
        it is out is refused (the free seat is the waiting one's, or the answer would find it taken)."""
        seats = HeldSeats(10)
        seats.lent(2, 0.0, SEAT_TTL, 0.0, 1.0, (2, 0))
        seats.take(0.0)
        seats.waiting = 1
        assert seats.wanted(0.1, 1.0) == (4, 2)  # twice what the one in flight and the one waiting need
        assert not seats.may_take(0.1)
        assert seats.may_take(0.1, again=True)

    def test_seats_unused_for_a_period_are_given_back_and_a_grant_short_of_the_need_is_full(self):
        """Four seats used at once, then one: a period later it asks for one; lent fewer than it needs,
        new requests are refused without an exchange for a period."""
        seats = HeldSeats(10)
        seats.lent(4, 0.0, SEAT_TTL, 0.0, 1.0, (4, 0))
        for _ in range(4):
            seats.take(0.0)
        for _ in range(3):
            seats.release()
        assert seats.wanted(0.5, 1.0) == (4, 4)
        assert seats.wanted(1.5, 1.0) == (1, 1) and seats.held == 1
        seats.lent(0, 1.5, SEAT_TTL, 1.6, 1.0, (1, 0))
        assert seats.full_until == pytest.approx(2.6) and seats.free(1.6) == -1


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(5000.0)


async def fleet(nursery, clock: FakeClock, count: int, limits=LIMITS) -> tuple[FleetServer, list[Admission]]:
    """A server lending ``limits`` and ``count`` gateway processes leasing from it."""
    server = FleetServer(limits, clock)
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    return server, [await gateway(nursery, f"http://{host}:{port}", clock, limits) for _ in range(count)]


async def test_three_gateways_admit_the_concurrency_in_all(nursery, clock):
    """concurrency 4 through three gateway processes, 12 requests held open in turn: 4 admitted in all (not
    12), the rest refused naming the limit; one ending frees its seat for another gateway within a period."""
    server, gateways = await fleet(nursery, clock, 3)
    answers = [await admit(gateways[i % 3]) for i in range(12)]
    tickets = [a for a in answers if isinstance(a, Ticket)]
    assert len(tickets) == 4
    assert {a.cause for a in answers if isinstance(a, Refused)} == {Cause.CONCURRENCY}
    assert server.lender.seats.lent("k", clock()) == 4
    holder = next(i for i, a in enumerate(answers) if isinstance(a, Ticket)) % 3
    other = gateways[(holder + 1) % 3]
    tickets[0].done(None)
    clock.now += 1.5  # the seat, unused for a period, goes back with the holder's next exchange
    with trio.fail_after(5):
        await gateways[holder].leases.exchange()
    assert isinstance(await admit(other), Ticket)
    assert server.lender.seats.lent("k", clock()) == 4


async def test_a_key_with_a_rate_and_a_concurrency_asks_for_both_on_one_exchange(nursery, clock):
    """rpm 10 and concurrency 2: the first request waits for one exchange, lent it a seat and a request at
    once, and is admitted; 2 of 3 requests are admitted, the third refused for concurrency."""
    limits = {"k": KeyLimits(rpm=10, concurrency=2)}
    server, (a,) = await fleet(nursery, clock, 1, limits)
    answers = [await admit(a) for _ in range(3)]
    assert [isinstance(x, Ticket) for x in answers] == [True, True, False]
    assert answers[2].cause is Cause.CONCURRENCY
    assert (server.asked[0].keys[0].wanted, server.asked[0].keys[0].seats_wanted) == (1, 2)  # a ramp: twice


async def test_gateways_asking_for_the_last_seat_at_once_admit_one(nursery, clock):
    """concurrency 1: two gateway processes each with a request waiting for an exchange at the same time:
    exactly one is admitted."""
    _, (a, b) = await fleet(nursery, clock, 2, {"k": KeyLimits(concurrency=1)})
    answers: list = []

    async def one(admission: Admission) -> None:
        answers.append(await admit(admission))

    with trio.fail_after(5):
        async with trio.open_nursery() as inner:
            inner.start_soon(one, a)
            inner.start_soon(one, b)
    assert sorted(isinstance(x, Ticket) for x in answers) == [False, True]


async def test_a_gateway_killed_holding_seats_frees_them_after_the_ttl(nursery, clock):
    """A gateway holding all 4 seats dies (its exchanges stop): another gets none before the TTL, and all
    four after it."""
    server, (b,) = await fleet(nursery, clock, 1)
    async with trio.open_nursery() as dying:
        killed = await gateway(dying, b.leases.servers.current, clock, LIMITS)
        held = [await admit(killed) for _ in range(4)]
        assert all(isinstance(a, Ticket) for a in held)
        dying.cancel_scope.cancel()  # nothing more is reported for it
    assert isinstance(await admit(b), Refused)
    clock.now += SEAT_TTL - 0.5
    with trio.fail_after(5):
        await b.leases.exchange()
    assert isinstance(await admit(b), Refused) and server.lender.seats.lent("k", clock()) == 4
    clock.now += 0.5
    with trio.fail_after(5):
        await b.leases.exchange()
    answers = [await admit(b) for _ in range(5)]
    assert [isinstance(x, Ticket) for x in answers] == [True] * 4 + [False]


async def test_a_gateway_that_loses_the_server_admits_on_its_seats_until_they_expire(nursery, clock):
    """With the server gone, a gateway admits on the seats it holds; once their TTL from its last answered
    exchange has passed it refuses (429, not worth an exchange) until the server answers again."""
    server = FleetServer(LIMITS, clock)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            host, port = await inner.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
            admission = await gateway(nursery, f"http://{host}:{port}", clock, LIMITS)
            first = await admit(admission)
            second = await admit(admission)
            assert isinstance(first, Ticket) and isinstance(second, Ticket)
            scope.cancel()
    first.done(None)
    assert isinstance(await admit(admission), Ticket)  # its seat, held: no exchange needed
    assert admission.leases.seats("k").used == 2
    clock.now += SEAT_TTL
    with trio.fail_after(5):
        await admission.leases.exchange()
    assert admission.leases.up is False
    refused = await admit(admission)
    assert isinstance(refused, Refused) and refused.cause is Cause.CONCURRENCY and not refused.renewable


class _OlderLender(Lender):
    """A server from before seats: its answers say no seat TTL."""

    def lend(self, *args, **kwargs):
        return attrs.evolve(super().lend(*args, **kwargs), seat_ttl=None)


async def test_a_server_without_seats_leaves_concurrency_to_each_process(nursery, clock):
    """Against a server that answers no seat TTL (from before seats), each process counts alone: 4 each."""
    server = FleetServer(LIMITS, clock)
    server.lender = _OlderLender()
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    a, b = [await gateway(nursery, f"http://{host}:{port}", clock, LIMITS) for _ in range(2)]
    answers = [await admit(g) for g in (a, b) for _ in range(5)]
    assert [isinstance(x, Ticket) for x in answers] == ([True] * 4 + [False]) * 2
    assert a.leases.seats_supported is False


async def test_requests_waiting_for_seats_get_them_before_newcomers(nursery, clock):
    """Three requests of a key with concurrency 3 wait for an exchange, which lends three seats; a request
    arriving after the answer, before they ask again, is refused and waits for the next; all three are
    admitted."""
    server, leases, admission = await unstarted(nursery, clock, {"k": KeyLimits(concurrency=3)})
    with trio.fail_after(5):
        async with trio.open_nursery() as inner:
            answers = await waiting_for_an_exchange(inner, admission, 3)
            await leases.exchange()
            assert server.asked[-1].keys[0].seats_wanted == 3
            newcomer = admission.admit("k", "m")
            leases._answered.set()  # what the exchange task does once the exchange ended: the three ask again
            await trio.testing.wait_all_tasks_blocked()
            inner.cancel_scope.cancel()
    assert isinstance(newcomer, Refused) and newcomer.cause is Cause.CONCURRENCY
    assert len(answers) == 3 and all(isinstance(a, Ticket) for a in answers)


async def test_a_stopping_gateway_gives_its_seats_back(nursery, clock):
    """close(): the seats held go back, and another gateway is lent them at once."""
    _, (a, b) = await fleet(nursery, clock, 2)
    tickets = [await admit(a) for _ in range(4)]
    for ticket in tickets:
        ticket.done(None)
    with trio.fail_after(5):
        await a.leases.close()
    answers = [await admit(b) for _ in range(5)]
    assert [isinstance(x, Ticket) for x in answers] == [True] * 4 + [False]
