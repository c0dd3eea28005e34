"""Fleet-wide key rates: the server's Lender on a fake clock, and gateway processes' Leases against it."""

from __future__ import annotations

import time

import attrs
import pytest
import trio
import trio.testing

from llmgw.gateway.admission import Admission, Cause, Refused, Ticket
from llmgw.gateway.leases import ALLOWANCES_PATH, Leases
from llmgw.net.client import ConnectionPool
from llmgw.net.server import HttpServer, Request, Response
from llmgw.server.state.allowances import Lender
from llmgw.server.state.budgets import Budgets
from llmgw.testing.clock import FakeClock
from llmgw.wire import (
    AllowanceReply,
    AllowanceRequest,
    KeyAllowance,
    KeyDemand,
    KeyLimits,
    from_json,
    to_json,
)


def ask(gateway: str, *demands: KeyDemand) -> AllowanceRequest:
    return AllowanceRequest(gateway, demands)


class TestLender:
    """The server's buckets: never lend more than the limit, charge every gateway's tokens."""

    def test_lends_no_more_than_the_bucket_holds_across_gateways(self):
        """rpm 20: a gateway gets the 15 it asks, the next 5 of its 15, a third none and when to ask again."""
        lender, now = Lender(), 0.0
        limits = {"k": KeyLimits(rpm=20)}
        first = lender.lend(limits, ask("a", KeyDemand("k", wanted=15)), now)
        second = lender.lend(limits, ask("b", KeyDemand("k", wanted=15)), now)
        third = lender.lend(limits, ask("c", KeyDemand("k", wanted=1)), now)
        assert first == AllowanceReply((KeyAllowance("k", 15, 0.0, 0.0),), 1.0, seat_ttl=5.0)
        assert second.keys[0].granted == 5 and second.keys[0].requests_wait == pytest.approx(3.0)
        assert third.keys[0].granted == 0 and third.keys[0].requests_wait == pytest.approx(3.0)
        assert lender.lend(limits, ask("c", KeyDemand("k", wanted=1)), now + 3.0).keys[0].granted == 1

    def test_returned_requests_can_be_lent_again(self):
        """Requests a gateway gives back unused go to the next one that asks (never above the limit)."""
        lender = Lender()
        limits = {"k": KeyLimits(rpm=4)}
        lender.lend(limits, ask("a", KeyDemand("k", wanted=4)), 0.0)
        back = lender.lend(limits, ask("a", KeyDemand("k", returned=9)), 0.0)
        assert back.keys[0].requests_wait == 0.0
        assert lender.lend(limits, ask("b", KeyDemand("k", wanted=9)), 0.0).keys[0].granted == 4

    def test_tokens_of_every_gateway_are_charged_to_one_bucket(self):
        """tpm 600: 400 tokens from each of two gateways leave the fleet 200 below zero: 20 s to wait."""
        lender = Lender()
        limits = {"k": KeyLimits(tpm=600)}
        assert lender.lend(limits, ask("a", KeyDemand("k", tokens=400)), 0.0).keys[0].tokens_wait == 0.0
        reply = lender.lend(limits, ask("b", KeyDemand("k", tokens=400)), 0.0)
        assert reply.keys[0] == KeyAllowance("k", 0, 0.0, pytest.approx(20.0))

    def test_keys_without_a_rate_are_left_out_and_changes_followed(self):
        """Keys without rpm, tpm or concurrency (or unknown) get no answer; a changed limit applies next."""
        lender = Lender()
        limits = {"k": KeyLimits(rpm=2), "free": KeyLimits(budget=3)}
        demands = (KeyDemand("k", wanted=5), KeyDemand("free", wanted=5), KeyDemand("gone", wanted=5))
        reply = lender.lend(limits, AllowanceRequest("a", demands), 0.0)
        assert [(a.key, a.granted) for a in reply.keys] == [("k", 2)]
        faster = {"k": KeyLimits(rpm=600)}
        assert lender.lend(faster, ask("a", KeyDemand("k", wanted=5)), 1.0).keys[0].granted == 0
        reply = lender.lend(faster, ask("a", KeyDemand("k", wanted=5)), 1.5)
        assert reply.keys[0].granted == 5  # the bucket kept what was used, and refills at the new rate

    def test_a_new_leader_lends_the_keys_it_found_from_an_empty_bucket(self):
        """A leader that began at 100 s with key k (rpm 60) made before: k is lent its rate from then (10 at
        110 s), never a fresh minute; from 90 s to 150 s the two leaders lent 110, within what one leader
        may (rpm * (1 + 60/60)); a key made after the leader began is lent its whole minute."""
        old, new = Lender(), Lender()
        limits = {"k": KeyLimits(rpm=60), "later": KeyLimits(rpm=60)}
        assert old.lend(limits, ask("a", KeyDemand("k", wanted=60)), 90.0).keys[0].granted == 60
        new.carry(["k"], 100.0)  # the old leader dies; the new one loads the keys at 100 s
        reply = new.lend(limits, ask("a", KeyDemand("k", wanted=60), KeyDemand("later", wanted=60)), 110.0)
        assert [(a.key, a.granted) for a in reply.keys] == [("k", 10), ("later", 60)]
        assert new.lend(limits, ask("a", KeyDemand("k", wanted=60)), 150.0).keys[0].granted == 40


class FleetServer:
    """``POST /v1/gateway/allowances`` over plain HTTP from a Lender on a fake clock (or 404, or down)."""

    def __init__(self, limits: dict[str, KeyLimits], clock: FakeClock) -> None:
        self.lender = Lender()
        self.budgets = Budgets()
        self.limits = limits
        self.clock = clock
        self.missing = False
        self.asked: list[AllowanceRequest] = []

    async def handle(self, request: Request) -> Response:
        if self.missing or request.path != ALLOWANCES_PATH:
            return Response.json(404, {"error": {"message": f"no such endpoint: {request.path}"}})
        asked = from_json(request.json(), AllowanceRequest)
        self.asked.append(asked)
        self.budgets.add(asked.usage, time.time())
        reply = self.lender.lend(self.limits, asked, self.clock())
        reply = attrs.evolve(reply, spent=self.budgets.spent(self.limits, time.time()))
        return Response.json(200, to_json(reply))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(5000.0)


async def gateway(nursery, url: str, clock: FakeClock, limits: dict[str, KeyLimits]) -> Admission:
    """One gateway process's admission, leasing from ``url`` (its exchange task runs in ``nursery``)."""
    pool = ConnectionPool(connect_timeout=1.0)
    leases = Leases(pool, url, clock, timeout=2.0)
    admission = Admission(clock, leases)
    admission.update(limits)
    await nursery.start(leases.run)
    return admission


async def admit(admission: Admission, key: str = "k") -> Ticket | Refused | None:
    """What the gateway app does: admit, and on a refusal the fleet may lift, one exchange and again."""
    admitted = admission.admit(key, "m")
    if isinstance(admitted, Refused) and admitted.renewable:
        with trio.fail_after(5):
            await admission.leases.refresh(key)
        admitted = admission.admit(key, "m", again=True)
    return admitted


async def unstarted(nursery, clock: FakeClock, limits: dict) -> tuple:
    """A server and one gateway process without its exchange task: the test makes each exchange."""
    server = FleetServer(limits, clock)
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    leases = Leases(ConnectionPool(connect_timeout=1.0), f"http://{host}:{port}", clock, timeout=2.0)
    admission = Admission(clock, leases)
    admission.update(limits)
    return server, leases, admission


async def waiting_for_an_exchange(inner: trio.Nursery, admission: Admission, count: int) -> list:
    """``count`` requests of key k refused as renewable (nothing held), each waiting in ``inner`` for the next
    exchange, then asking again: the list their answers go to."""
    answers: list = []

    async def waiting() -> None:
        await admission.leases.refresh("k")
        answers.append(admission.admit("k", "m", again=True))

    for _ in range(count):
        refused = admission.admit("k", "m")
        assert isinstance(refused, Refused) and refused.renewable
        inner.start_soon(waiting)
    await trio.testing.wait_all_tasks_blocked()
    return answers


async def test_three_gateways_admit_the_limit_in_all(nursery, clock):
    """rpm 12 through three gateway processes taking turns: 12 admitted in all, not 36, then one per 5 s."""
    limits = {"k": KeyLimits(rpm=12)}
    server = FleetServer(limits, clock)
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    gateways = [await gateway(nursery, f"http://{host}:{port}", clock, limits) for _ in range(3)]
    answers = [await admit(gateways[i % 3]) for i in range(36)]
    assert sum(isinstance(a, Ticket) for a in answers) == 12
    refused = [a for a in answers if isinstance(a, Refused)]
    assert {a.cause for a in refused} == {Cause.RPM}
    assert all(a.retry_seconds() == 5 for a in refused[-3:]), refused[-3:]  # the fleet's wait, not a guess
    clock.now += 5
    later = [await admit(g) for g in gateways]
    assert sum(isinstance(a, Ticket) for a in later) == 1


async def test_tokens_reported_by_one_gateway_hold_back_another(nursery, clock):
    """tpm 60: 90 tokens used through gateway A, once reported, make gateway B refuse until 30 s later."""
    limits = {"k": KeyLimits(tpm=60)}
    server = FleetServer(limits, clock)
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    a, b = [await gateway(nursery, f"http://{host}:{port}", clock, limits) for _ in range(2)]
    ticket = await admit(a)
    ticket.done((30, 60))
    with trio.fail_after(5):
        await b.leases.refresh("k")  # B's next exchange comes after A's report of the tokens
        while not isinstance(await admit(b), Refused):
            await b.leases.refresh("k")
    refused = await admit(b)
    assert refused.cause is Cause.TPM and refused.retry_seconds() == 30
    clock.now += 30.5
    with trio.fail_after(5):
        await b.leases.refresh("k")
    assert isinstance(await admit(b), Ticket)


async def test_a_server_without_leases_leaves_counting_to_each_process(nursery, clock):
    """Against a server that answers 404 (an older llmgw) a gateway counts alone: its whole rpm."""
    limits = {"k": KeyLimits(rpm=3)}
    server = FleetServer(limits, clock)
    server.missing = True
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    admission = await gateway(nursery, f"http://{host}:{port}", clock, limits)
    answers = [await admit(admission) for _ in range(4)]
    assert [isinstance(a, Ticket) for a in answers] == [True, True, True, False]
    assert admission.leases.supported is False
    admission.leases.used("k", "m", (1, 2))  # no usage kept for a server that takes none
    assert not admission.leases._usage


async def test_a_gateway_that_loses_the_server_admits_what_it_holds_then_refuses(nursery, clock):
    """With the server gone, a gateway admits the requests it was lent and refuses the rest at once."""
    limits = {"k": KeyLimits(rpm=60)}
    server = FleetServer(limits, clock)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as inner:
            host, port = await inner.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
            admission = await gateway(nursery, f"http://{host}:{port}", clock, limits)
            for _ in range(3):
                admission.admit("k", "m")  # three refused requests: the next exchange asks for three
            assert isinstance(await admit(admission), Ticket)
            scope.cancel()
    held = admission.leases._leases["k"].held
    assert held >= 1
    answers = [await admit(admission) for _ in range(held + 2)]
    assert all(isinstance(a, Ticket) for a in answers[:held])
    assert admission.leases.up is False  # the exchange for the next one found the server gone
    assert all(isinstance(a, Refused) and not a.renewable for a in answers[held:])


async def test_requests_held_unused_for_a_period_go_back_to_the_fleet(nursery, clock):
    """A gateway lent 4 that used 1 gives 3 back after a quiet period; another gateway is lent them."""
    limits = {"k": KeyLimits(rpm=4)}
    server = FleetServer(limits, clock)
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    a, c = [await gateway(nursery, f"http://{host}:{port}", clock, limits) for _ in range(2)]
    for _ in range(3):
        a.admit("k", "m")  # demand seen: the next exchange asks for 4
    assert isinstance(await admit(a), Ticket)
    assert a.leases._leases["k"].held == 3
    clock.now += 1.0
    with trio.fail_after(5):
        await a.leases.exchange()
    assert a.leases._leases["k"].held == 0 and server.asked[-1].keys[0].returned == 3
    later = [await admit(c) for _ in range(4)]
    assert [isinstance(x, Ticket) for x in later] == [True, True, True, False]


async def test_every_keys_usage_is_reported_and_a_spent_key_refused_until_its_period_ends(nursery, clock):
    """Answers of any key are reported per key and model; a key with a budget of 100 tokens a day is
    refused by every gateway (429 naming the budget, Retry-After until UTC midnight) once the server
    counted 100, and another key is not."""
    limits = {"k": KeyLimits(budget=100)}
    server = FleetServer(limits, clock)
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    a, b = [await gateway(nursery, f"http://{host}:{port}", clock, limits) for _ in range(2)]
    assert a.admit("k", "m") is not None  # a ticket: the budget is not spent yet
    a.leases.used("k", "m", (60, 40))
    a.leases.used("free", "m", (1, 2))
    with trio.fail_after(5):
        await a.leases.refresh("k")
        while "k" not in b.leases.spent:
            await b.leases.refresh("k")
    reported = [u for asked in server.asked for u in asked.usage]
    assert {(u.key, u.model, u.requests, u.prompt_tokens, u.completion_tokens) for u in reported} == {
        ("k", "m", 1, 60, 40),
        ("free", "m", 1, 1, 2),
    }
    refused = b.admit("k", "m")
    assert isinstance(refused, Refused) and refused.cause is Cause.BUDGET and refused.status == 429
    midnight = (int(time.time()) // 86400 + 1) * 86400
    assert abs(refused.retry_seconds() - (midnight - time.time())) <= 2
    assert refused.message("m").startswith(
        "API key 'k' has used its budget of 100 tokens per day (budget); it resets at "
    )
    assert b.admit("free", "m") is None


async def test_a_steady_key_is_lent_a_period_of_requests_not_one_per_exchange(nursery, clock):
    """A key far below its rpm, sent 20 requests per period one at a time: after its first period the
    gateway holds enough for the next, so the 20 requests of the second period take at most 2 exchanges
    (not one each), and none is refused."""
    limits = {"k": KeyLimits(rpm=10**6)}
    server = FleetServer(limits, clock)
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    admission = await gateway(nursery, f"http://{host}:{port}", clock, limits)
    first = [await admit(admission) for _ in range(20)]
    clock.now += 1.0
    before = admission.leases.exchanges
    with trio.fail_after(5):
        await admission.leases.exchange()  # the periodic exchange at the period's end
    second = [await admit(admission) for _ in range(20)]
    assert all(isinstance(a, Ticket) for a in first + second)
    assert admission.leases.exchanges - before <= 2


async def test_a_stopping_gateway_reports_its_last_usage_and_gives_back_what_it_holds(nursery, clock):
    """close(): the tokens of answers not reported yet reach the server (they count against budgets), and
    the requests held unused go back to the fleet, where another gateway is lent them at once."""
    limits = {"k": KeyLimits(rpm=4, budget=10**6)}
    server = FleetServer(limits, clock)
    host, port = await nursery.start(HttpServer(server.handle).serve, "127.0.0.1", 0)
    a, c = [await gateway(nursery, f"http://{host}:{port}", clock, limits) for _ in range(2)]
    for _ in range(3):
        a.admit("k", "m")  # demand seen: the next exchange asks for 4
    assert isinstance(await admit(a), Ticket) and a.leases._leases["k"].held == 3
    a.leases.used("k", "m", (7, 5))
    with trio.fail_after(5):
        await a.leases.close()
    assert server.asked[-1].keys[0].returned == 3 and server.asked[-1].keys[0].wanted == 0
    assert ("k", "m", 1, 7, 5) in {(u.key, u.model, u.requests, u.prompt_tokens, u.completion_tokens)
                                   for u in server.asked[-1].usage}  # fmt: skip
    later = [await admit(c) for _ in range(4)]
    assert [isinstance(x, Ticket) for x in later] == [True, True, True, False]


async def test_requests_waiting_for_an_exchange_get_what_it_lent_before_newcomers(nursery, clock):
    """Ten requests of an idle key wait for an exchange, which lends ten; a request arriving after the answer
    but before they ask again is refused and waits for the next exchange, and all ten are admitted."""
    limits = {"k": KeyLimits(rpm=10**6)}
    _, leases, admission = await unstarted(nursery, clock, limits)
    answered = leases._answered
    with trio.fail_after(5):
        async with trio.open_nursery() as inner:
            answers = await waiting_for_an_exchange(inner, admission, 10)
            await leases.exchange()
            assert leases._leases["k"].held == 10
            newcomer = admission.admit("k", "m")
            leases._answered = trio.Event()  # the next exchange's, as the exchange task swaps them
            inner.start_soon(leases.refresh, "k")  # the newcomer waits for the next exchange...
            await trio.testing.wait_all_tasks_blocked()
            answered.set()  # ...and takes nothing from those that waited for this one
            await trio.testing.wait_all_tasks_blocked()
            inner.cancel_scope.cancel()
    assert isinstance(newcomer, Refused) and newcomer.renewable
    assert len(answers) == 10 and all(isinstance(a, Ticket) for a in answers)
