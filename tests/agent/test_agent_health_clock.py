"""Rank 0's ready timeout and health checks, driven by trio's autojump clock.

The supervisor's probe reads only trio's clock; its HTTP client here answers from memory
(``httpx.MockTransport``), so minutes of probing pass in no real time. The real engine
processes are tested in ``test_agent_supervisor.py``.
"""

from __future__ import annotations

import types

import httpx
import pytest
import trio

from llmgw.agent import supervisor as supervisor_module
from llmgw.agent.config import HealthSettings
from llmgw.agent.supervisor import ShardSupervisor
from llmgw.testing.agent import ScriptEngine, agent_config, desired
from llmgw.testing.processes import wait_for

HEALTH = HealthSettings(interval=5.0, timeout=10.0, failures=3)


class Engine:
    """The engine's health endpoint: answers ``status`` (503 every other probe while ``flaky``), or never."""

    def __init__(self) -> None:
        self.status = 200
        self.hung = False
        self.flaky = False
        self.probes = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.probes += 1
        if self.hung:
            await trio.sleep_forever()
        return httpx.Response(503 if self.flaky and self.probes % 2 else self.status)


@pytest.fixture
def engine(monkeypatch) -> Engine:
    """The fake engine every HTTP client of the supervisor talks to."""
    fake = Engine()

    def client(*args, **kwargs) -> httpx.AsyncClient:
        return httpx.AsyncClient(*args, transport=httpx.MockTransport(fake.handle), **kwargs)

    monkeypatch.setattr(
        supervisor_module, "httpx", types.SimpleNamespace(AsyncClient=client, HTTPError=httpx.HTTPError)
    )
    return fake


def probing(nursery: trio.Nursery, tmp_path, ready_timeout: float) -> list:
    """Start rank 0's probe of a shard (no process); returns the list of states it reports."""
    states: list = []
    shard = desired("script", 8000, ready_timeout=ready_timeout)
    config = agent_config(tmp_path, health=HEALTH)
    supervisor = ShardSupervisor(shard, ScriptEngine(tmp_path / "unused.py"), config, states.append)
    nursery.start_soon(supervisor._probe)
    return states


def state(states: list) -> str | None:
    return states[-1].state if states else None


async def test_never_healthy_is_unhealthy_at_the_ready_timeout(nursery, tmp_path, engine, autojump_clock):
    """An engine answering 503 stays not ready until ready_timeout, then is `unhealthy`, naming the answer."""
    engine.status = 503
    started = trio.current_time()
    states = probing(nursery, tmp_path, ready_timeout=600)
    await trio.sleep(599)
    assert state(states) is None and engine.probes > 50
    with trio.fail_after(5):
        await wait_for(lambda: state(states) == "unhealthy", "the shard to be unhealthy")
    assert trio.current_time() - started == pytest.approx(600, abs=1)
    assert states[-1].detail == "not ready within 600 s: GET http://127.0.0.1:8000/health: HTTP 503"


async def test_hung_health_after_ready_is_unhealthy_after_the_failures(
    nursery, tmp_path, engine, autojump_clock
):
    """Once ready, `failures` probes in a row with no answer (interval + timeout each) make it unhealthy."""
    states = probing(nursery, tmp_path, ready_timeout=600)
    with trio.fail_after(1):
        await wait_for(lambda: state(states) == "ready", "the shard to be ready")
    engine.hung = True
    hung_at = trio.current_time()
    with trio.fail_after(HEALTH.failures * (HEALTH.interval + HEALTH.timeout) + 1):
        await wait_for(lambda: state(states) == "unhealthy", "the shard to be unhealthy")
    assert trio.current_time() - hung_at >= HEALTH.failures * HEALTH.timeout
    assert states[-1].detail.startswith("health check failed 3 times in a row")
    assert states[-1].detail.endswith("no answer within 10 s")


async def test_failures_not_in_a_row_never_make_it_unhealthy(nursery, tmp_path, engine, autojump_clock):
    """Health that fails every other probe for an hour keeps the shard ready (this asserts a non-event)."""
    states = probing(nursery, tmp_path, ready_timeout=600)
    with trio.fail_after(1):
        await wait_for(lambda: state(states) == "ready", "the shard to be ready")
    engine.flaky = True
    probes = engine.probes
    await trio.sleep(3600)
    assert engine.probes - probes > 300
    assert state(states) == "ready"
