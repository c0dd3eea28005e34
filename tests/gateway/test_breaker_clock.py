"""The proxy's retry backoff and circuit breaker, driven by trio's autojump clock.

The proxy reads only trio's clock (``trio.current_time`` and ``trio.sleep``), so with a connection pool
that needs no sockets, a test can let minutes of backoff and cool-down pass in no real time.
"""

from __future__ import annotations

import types

import pytest
import trio

from llmgw.gateway import proxy as proxy_module
from llmgw.gateway.balancer import Balancer, BreakerState
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.proxy import Call, Proxy, ProxySettings
from llmgw.net.client import ConnectError
from llmgw.wire import Route


class Answer:
    """A replica's ``200`` JSON answer, as the pool's ``ClientResponse`` gives it."""

    status = 200
    headers = (("content-type", "application/json"), ("content-length", "2"))

    def header(self, name: str) -> str | None:
        return dict(self.headers).get(name)

    async def read(self, limit: int | None = None) -> bytes:
        return b"{}"

    def close(self) -> None:
        pass


class Pool:
    """A connection pool without sockets: replicas whose URL is in ``down`` refuse connections."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        #: (trio time, URL) of every request sent
        self.sent: list[tuple[float, str]] = []

    async def send(self, method: str, url: str, *, headers=(), body: bytes = b"", watch=None) -> Answer:
        self.sent.append((trio.current_time(), url))
        await trio.lowlevel.checkpoint()
        if any(url.startswith(base) for base in self.down):
            raise ConnectError(f"connection to {url} refused")
        return Answer()


def gateway(names: tuple[str, ...], *, failures: int, open_for: float, **settings) -> tuple[Proxy, Pool]:
    """A proxy over replicas ``names`` of model ``m`` (``http://NAME``), and its pool."""
    balancer = Balancer(breaker_failures=failures, breaker_open_for=open_for)
    balancer.update({"m": [Route(name, f"http://{name}") for name in names]})
    pool = Pool()
    proxy = Proxy(pool, balancer, GatewayMetrics(balancer, lambda: None), ProxySettings(**settings))
    return proxy, pool


async def forward(proxy: Proxy) -> int:
    """One chat request through ``proxy``; the status the client gets."""
    call = Call("m", "chat/completions", "/v1/chat/completions", b"{}", "req", None, trio.current_time())
    return (await proxy.forward(call)).status


async def test_retries_wait_a_backoff_that_doubles(autojump_clock, monkeypatch):
    """Each retry goes to another replica after a backoff of at most retry_backoff * 2**(attempt-2)."""
    monkeypatch.setattr(proxy_module, "random", types.SimpleNamespace(uniform=lambda low, high: high))
    proxy, pool = gateway(("a", "b", "c"), failures=10, open_for=60, max_attempts=3, retry_backoff=1.0)
    pool.down = {"http://a", "http://b", "http://c"}
    assert await forward(proxy) == 502
    times = [at for at, _ in pool.sent]
    assert len({url for _, url in pool.sent}) == 3, pool.sent
    waits = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    assert waits == pytest.approx([1.0, 2.0])


async def test_backoff_is_jittered_within_its_bound(autojump_clock):
    """With real jitter, the waits between attempts stay within [0, retry_backoff * 2**(attempt-2)]."""
    proxy, pool = gateway(("a", "b", "c"), failures=100, open_for=60, max_attempts=3, retry_backoff=1.0)
    pool.down = {"http://a", "http://b", "http://c"}
    for _ in range(20):
        pool.sent.clear()
        await forward(proxy)
        (first, _), (second, _), (third, _) = pool.sent
        assert 0 <= second - first <= 1.0 and 0 <= third - second <= 2.0


async def test_breaker_opens_after_failures_and_probes_after_the_cool_down(autojump_clock):
    """N failures open the breaker (503, no attempt); after open_for one probe goes; its success closes it."""
    proxy, pool = gateway(("a",), failures=3, open_for=30, max_attempts=1)
    (replica,) = proxy.balancer.replicas("m")
    pool.down = {"http://a"}
    assert [await forward(proxy) for _ in range(3)] == [502, 502, 502]
    assert replica.breaker.state is BreakerState.OPEN

    sent = len(pool.sent)
    assert await forward(proxy) == 503
    await trio.sleep(29.5)
    assert await forward(proxy) == 503
    assert len(pool.sent) == sent, "a request went to a replica whose breaker is open"

    await trio.sleep(0.5)
    pool.down = set()
    assert await forward(proxy) == 200
    assert replica.breaker.state is BreakerState.CLOSED


async def test_failed_probe_opens_the_breaker_for_another_cool_down(autojump_clock):
    """A probe that fails opens the breaker again, counted from the probe, not from the first opening."""
    proxy, pool = gateway(("a",), failures=1, open_for=10, max_attempts=1)
    (replica,) = proxy.balancer.replicas("m")
    pool.down = {"http://a"}
    assert await forward(proxy) == 502
    await trio.sleep(10)
    assert await forward(proxy) == 502  # the probe, refused
    assert replica.breaker.state is BreakerState.OPEN
    await trio.sleep(9.5)
    assert await forward(proxy) == 503
    await trio.sleep(0.5)
    pool.down = set()
    assert await forward(proxy) == 200


async def test_unavailable_answer_says_when_to_retry(autojump_clock):
    """The 503 of a model whose breakers are all open carries Retry-After: the seconds to the next probe."""
    proxy, pool = gateway(("a",), failures=1, open_for=30, max_attempts=1)
    pool.down = {"http://a"}
    await forward(proxy)
    await trio.sleep(19.6)
    call = Call("m", "chat/completions", "/v1/chat/completions", b"{}", "req", None, trio.current_time())
    response = await proxy.forward(call)
    assert response.status == 503
    assert dict(response.headers)["retry-after"] == "11"
