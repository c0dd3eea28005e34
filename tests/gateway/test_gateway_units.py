"""The gateway's pure parts: the routes document, the circuit breaker, the balancer."""

from __future__ import annotations

import random

import pytest

from llmgw.gateway.balancer import Balancer, Breaker, BreakerState
from llmgw.wire import Route, RouteTable, WireError, from_json


def upstreams(*names: str) -> list[Route]:
    return [Route(name, f"http://10.0.0.{i}:8000") for i, name in enumerate(names, 1)]


class TestRouteTable:
    """from_json(data, RouteTable) reads the server's routes document."""

    def test_reads_routes_models_and_keys(self):
        """Replicas, the catalog's models and key hashes come through; models with routes count as known."""
        table = from_json(
            {
                "revision": 4,
                "models": ["a", "b"],
                "routes": {"a": [{"replica": "a-0", "url": "http://h:1/"}], "b": [], "c": []},
                "keys": {"ABCDEF": "alice"},
            },
            RouteTable,
        )
        assert table.revision == 4
        assert table.models == ("a", "b")
        assert table.routes == {"a": (Route("a-0", "http://h:1"),)}
        assert table.keys == {"abcdef": "alice"}

    def test_absent_keys_means_no_keys(self):
        """A document without "keys" (a server that has none yet) gives keys=None."""
        assert from_json({"revision": 1, "models": [], "routes": {}}, RouteTable).keys is None

    @pytest.mark.parametrize(
        ("document", "message"),
        [
            ([], "malformed RouteTable"),
            ({"revision": "1"}, r"expected an integer, got '1' @ RouteTable\.revision"),
            ({"revision": 1, "models": "a"}, r"expected a list, got 'a' @ RouteTable\.models"),
            (
                {"revision": 1, "routes": {"a": [{"replica": "a-0", "url": "ftp://x"}]}},
                r"url: expected an http\(s\) URL, got 'ftp://x' @ RouteTable\.routes\['a'\]\[0\]",
            ),
            ({"revision": 1, "keys": ["x"]}, r"expected a mapping, got \['x'\] @ RouteTable\.keys"),
        ],
    )
    def test_malformed_documents_name_the_part(self, document, message):
        """A document of the wrong shape is refused, naming where."""
        with pytest.raises(WireError, match=message):
            from_json(document, RouteTable)


class TestBreaker:
    """The circuit breaker's states."""

    def test_opens_after_consecutive_failures(self):
        """failures_to_open failures in a row open it; a success in between resets the count."""
        breaker = Breaker(failures_to_open=3, open_for=5)
        assert not breaker.failed(0)
        assert not breaker.failed(0)
        breaker.succeeded()
        assert not breaker.failed(0)
        assert not breaker.failed(0)
        assert breaker.failed(1)
        assert breaker.state is BreakerState.OPEN
        assert not breaker.allows(5.9)
        assert breaker.reopens_in(2) == pytest.approx(4)

    def test_half_open_lets_one_probe_through(self):
        """After open_for, exactly one request may go; its success closes the breaker."""
        breaker = Breaker(failures_to_open=1, open_for=5)
        breaker.failed(0)
        assert breaker.allows(5)
        assert breaker.state is BreakerState.HALF_OPEN
        breaker.attempt()
        assert not breaker.allows(5.1)
        assert breaker.succeeded()
        assert breaker.state is BreakerState.CLOSED
        assert breaker.allows(5.2)

    def test_failed_probe_opens_again(self):
        """A failed probe opens the breaker for another open_for."""
        breaker = Breaker(failures_to_open=2, open_for=5)
        breaker.failed(0)
        breaker.failed(0)
        assert breaker.allows(5)
        breaker.attempt()
        assert breaker.failed(6)
        assert breaker.state is BreakerState.OPEN
        assert not breaker.allows(10)
        assert breaker.allows(11)

    def test_abandoned_probe_frees_the_slot(self):
        """A probe whose client left lets the next request probe."""
        breaker = Breaker(failures_to_open=1, open_for=1)
        breaker.failed(0)
        assert breaker.allows(1)
        breaker.attempt()
        assert not breaker.allows(1)
        breaker.abandoned()
        assert breaker.allows(1)


class TestBalancer:
    """Choosing a replica."""

    def test_least_outstanding_of_two(self):
        """With two replicas, the one with fewer requests in flight is chosen every time."""
        balancer = Balancer(rng=random.Random(1))
        balancer.update({"m": upstreams("a", "b")})
        a, b = balancer.replicas("m")
        a.begin()
        a.begin()
        b.begin()
        assert all(balancer.choose("m", 0) is b for _ in range(20))

    def test_power_of_two_spreads_load(self):
        """Requests that stay in flight spread evenly over four replicas."""
        balancer = Balancer(rng=random.Random(7))
        balancer.update({"m": upstreams("a", "b", "c", "d")})
        for _ in range(400):
            balancer.choose("m", 0).begin()
        counts = sorted(r.in_flight for r in balancer.replicas("m"))
        assert counts[0] >= 80 and counts[-1] <= 120, counts

    def test_session_affinity_is_stable_and_spreads(self):
        """One session always gets one replica; many sessions use all replicas."""
        balancer = Balancer()
        balancer.update({"m": upstreams("a", "b", "c")})
        for session in ("s1", "s2", "s3"):
            chosen = {balancer.choose("m", 0, session=session).name for _ in range(10)}
            assert len(chosen) == 1
        spread = {balancer.choose("m", 0, session=f"user-{i}").name for i in range(50)}
        assert spread == {"a", "b", "c"}

    def test_session_moves_only_when_its_replica_leaves(self):
        """Removing a replica moves only the sessions it had."""
        balancer = Balancer()
        balancer.update({"m": upstreams("a", "b", "c")})
        before = {f"s{i}": balancer.choose("m", 0, session=f"s{i}").name for i in range(60)}
        balancer.update({"m": [u for u in upstreams("a", "b", "c") if u.replica != "c"]})
        after = {s: balancer.choose("m", 0, session=s).name for s in before}
        moved = {s for s in before if before[s] != after[s]}
        assert moved == {s for s in before if before[s] == "c"}

    def test_excluded_and_open_replicas_are_skipped(self):
        """A replica already tried, or whose breaker is open, is not chosen; none left gives None."""
        balancer = Balancer(breaker_failures=1, breaker_open_for=5)
        balancer.update({"m": upstreams("a", "b")})
        a, b = balancer.replicas("m")
        a.failed(0, "refused")
        assert all(balancer.choose("m", 1) is b for _ in range(10))
        assert balancer.choose("m", 1, exclude=[b]) is None
        assert balancer.choose("m", 1, session="s", exclude=[b]) is None
        assert balancer.retry_after("m", 1) == 0
        b.failed(2, "refused")
        assert balancer.choose("m", 2) is None
        assert balancer.retry_after("m", 2) == pytest.approx(3)

    def test_update_keeps_state_of_replicas_that_stay(self):
        """A replica that stays in the routes keeps its in-flight count and breaker."""
        balancer = Balancer(breaker_failures=1)
        balancer.update({"m": upstreams("a", "b")})
        a = balancer.replicas("m")[0]
        a.begin()
        a.failed(0, "x")
        balancer.update({"m": upstreams("a"), "n": [Route("n-0", "http://n:1")]})
        assert balancer.replicas("m") == (a,)
        assert a.in_flight == 1 and a.breaker.state is BreakerState.OPEN
        assert [r.name for r in balancer.replicas()] == ["a", "n-0"]
        assert balancer.replicas("gone") == ()
