"""Admission by key limits, on a fake clock: token buckets for rpm and tpm, concurrency, allowed models."""

from __future__ import annotations

import time

import pytest

from llmgw.gateway.admission import Admission, Cause, Refused, Ticket
from llmgw.gateway.leases import Leases
from llmgw.net.client import ConnectionPool
from llmgw.tenancy.bucket import TokenBucket
from llmgw.testing.clock import FakeClock
from llmgw.wire import KeyLimits, SpentKey


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


def admission(clock: FakeClock, **limits: KeyLimits) -> Admission:
    made = Admission(clock)
    made.update(limits)
    return made


class TestTokenBucket:
    """One bucket: full at first, refilled per second, never above its size, may go negative."""

    def test_refills_at_its_rate_up_to_its_size(self, clock):
        """A bucket of 60 a minute refills one a second and stops at 60."""
        bucket = TokenBucket(60, clock())
        bucket.take(60, clock())
        assert bucket.wait(1, clock()) == pytest.approx(1.0)
        clock.now += 10
        assert bucket.refill(clock()) == pytest.approx(10)
        clock.now += 3600
        assert bucket.refill(clock()) == 60

    def test_negative_level_waits_until_positive(self, clock):
        """Charged 90 of 60, the bucket needs 30 tokens' time (30 s at 1/s) before it is positive again."""
        bucket = TokenBucket(60, clock())
        bucket.take(90, clock())
        assert bucket.wait(1e-9, clock()) == pytest.approx(30.0)

    def test_resize_keeps_what_was_used(self, clock):
        """A smaller limit keeps the level (at most the new size); a larger one refills at its new rate."""
        bucket = TokenBucket(60, clock())
        bucket.take(50, clock())
        bucket.resize(6, clock())
        assert bucket.refill(clock()) == pytest.approx(6)
        bucket.take(6, clock())
        bucket.resize(600, clock())
        clock.now += 1
        assert bucket.refill(clock()) == pytest.approx(10)


class TestRequestsPerMinute:
    """rpm: a key gets its limit at once, then one request per 60/rpm seconds."""

    def test_fourth_request_in_a_minute_is_refused_with_when_to_retry(self, clock):
        """With rpm 3, three requests pass and the fourth is refused, retry in 20 s, and passes then."""
        gate = admission(clock, alice=KeyLimits(rpm=3))
        for _ in range(3):
            ticket = gate.admit("alice", "m")
            assert isinstance(ticket, Ticket)
            ticket.done(None)
        refused = gate.admit("alice", "m")
        assert refused == Refused(Cause.RPM, "alice", 3, pytest.approx(20.0))
        assert refused.status == 429 and refused.retry_seconds() == 20
        expected = "'alice' is over its limit of 3 requests per minute (rpm); retry in 20 s"
        assert expected in refused.message("m")
        clock.now += 19.9
        assert isinstance(gate.admit("alice", "m"), Refused)
        clock.now += 0.2
        assert isinstance(gate.admit("alice", "m"), Ticket)

    def test_a_refused_request_takes_nothing(self, clock):
        """Refusals do not drain the bucket: after the wait named, the next request passes."""
        gate = admission(clock, alice=KeyLimits(rpm=1))
        gate.admit("alice", "m")
        for _ in range(100):
            refused = gate.admit("alice", "m")
        clock.now += refused.retry_after
        assert isinstance(gate.admit("alice", "m"), Ticket)

    def test_other_keys_are_not_affected(self, clock):
        """One key over its limit leaves another limited key and an unlimited key alone."""
        gate = admission(clock, alice=KeyLimits(rpm=1), bob=KeyLimits(rpm=1))
        gate.admit("alice", "m")
        assert isinstance(gate.admit("alice", "m"), Refused)
        assert isinstance(gate.admit("bob", "m"), Ticket)
        assert all(gate.admit("carol", "m") is None for _ in range(1000))


class TestTokensPerMinute:
    """tpm: tokens are charged when the answer ends; refused while the bucket is not positive."""

    def test_charged_after_the_answer_and_refused_while_negative(self, clock):
        """tpm 600: an answer of 700 tokens leaves the bucket at -100: refused for 10 s, then admitted."""
        gate = admission(clock, alice=KeyLimits(tpm=600))
        first, second = gate.admit("alice", "m"), gate.admit("alice", "m")  # both start before any usage
        assert isinstance(first, Ticket) and isinstance(second, Ticket)
        first.done((200, 500))
        second.done(None)  # no usage reported: nothing charged
        refused = gate.admit("alice", "m")
        assert refused.cause is Cause.TPM and refused.retry_after == pytest.approx(10.0)
        assert "600 tokens per minute (tpm)" in refused.message("m")
        clock.now += 10.01
        assert isinstance(gate.admit("alice", "m"), Ticket)

    def test_done_twice_charges_once(self, clock):
        """A ticket ended twice (response over, then client gone) counts its tokens and place once."""
        gate = admission(clock, alice=KeyLimits(tpm=100, concurrency=1))
        ticket = gate.admit("alice", "m")
        ticket.done((50, 0))
        ticket.done((50, 0))
        assert gate.in_flight("alice") == 0
        assert isinstance(gate.admit("alice", "m"), Ticket)


class TestConcurrency:
    """concurrency: requests in flight at once; a place frees when an answer ends."""

    def test_refused_while_full_and_admitted_once_one_ends(self, clock):
        """With concurrency 2, a third request in flight is refused until one of the two ends."""
        gate = admission(clock, alice=KeyLimits(concurrency=2))
        one, _two = gate.admit("alice", "m"), gate.admit("alice", "m")
        refused = gate.admit("alice", "m")
        assert refused.cause is Cause.CONCURRENCY and refused.retry_seconds() == 1
        assert "2 requests at once (concurrency)" in refused.message("m")
        one.done(None)
        assert isinstance(gate.admit("alice", "m"), Ticket)
        assert gate.in_flight("alice") == 2


class TestModels:
    """models: a key limited to some models is refused the others (403), whatever its rates."""

    def test_a_model_not_allowed_is_forbidden_naming_model_and_key(self, clock):
        """`n` is refused with 403 for a key allowed only `m`, which passes."""
        gate = admission(clock, alice=KeyLimits(models=("m",)))
        refused = gate.forbidden("alice", "n")
        assert refused is not None and refused.status == 403 and refused.cause is Cause.MODELS
        expected = "API key 'alice' may not use the model `n`; ask an operator to allow it."
        assert refused.message("n") == expected
        assert gate.admit("alice", "n") == refused
        assert gate.forbidden("alice", "m") is None and isinstance(gate.admit("alice", "m"), Ticket)
        assert gate.forbidden("bob", "n") is None


class TestUpdate:
    """New limits from the routes feed: kept buckets for unchanged keys, followed for changed ones."""

    def test_unchanged_limits_keep_their_use(self, clock):
        """A new routes table with the same limits does not refill a key's bucket."""
        gate = admission(clock, alice=KeyLimits(rpm=1))
        gate.admit("alice", "m")
        gate.update({"alice": KeyLimits(rpm=1), "bob": KeyLimits(rpm=5)})
        assert isinstance(gate.admit("alice", "m"), Refused)

    def test_changed_limits_apply_at_once_and_lifted_ones_free_the_key(self, clock):
        """Lowering rpm caps what is left; a key no longer limited is admitted freely."""
        gate = admission(clock, alice=KeyLimits(rpm=100))
        gate.update({"alice": KeyLimits(rpm=1)})
        assert isinstance(gate.admit("alice", "m"), Ticket)
        assert gate.admit("alice", "m").cause is Cause.RPM
        gate.update({})
        assert gate.admit("alice", "m") is None


class TestBudgetRetryAfter:
    """A spent key's Retry-After counts to its period's end on the wall clock, not the monotonic one."""

    def test_retry_after_is_the_wall_time_left_until_the_budget_resets(self, clock):
        """The monotonic clock reads 1000 s; the server says the budget resets 90.4 s from now (UNIX time):
        Retry-After is 91, and the message names that UTC minute."""
        leases = Leases(ConnectionPool(), "http://127.0.0.1:1", clock)
        gate = Admission(clock, leases)
        gate.update({"k": KeyLimits(budget=100)})
        resets_at = time.time() + 90.4
        leases.spent = {"k": SpentKey("k", 100, "day", resets_at)}
        refused = gate.admit("k", "m")
        assert isinstance(refused, Refused) and refused.cause is Cause.BUDGET
        assert refused.retry_seconds() in (90, 91)  # 91, or 90 if a second passed since
        assert time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(resets_at)) in refused.message("m")
