"""Rank 0's liveness under the real supervisor: a hung sim whose /health answers 200, a busy one, a stop.

The sim's canary (a one-token completion every 2 s, 5 s to answer) is judged by its
``/metrics`` token counters; the timing of the judgement is tested with trio's clock in
``test_agent_liveness_clock.py``.
"""

from __future__ import annotations

import logging

import httpx
import pytest
import trio
from llmgw_engine_sim import SimEngine

from llmgw.agent.supervisor import HUNG_STOP_GRACE, ShardSupervisor
from llmgw.testing.agent import (
    ScriptEngine,
    agent_config,
    desired,
    group_alive,
    kill_group,
    wait_state,
    write_scripts,
)
from llmgw.testing.processes import free_port

CANARY = SimEngine.liveness_probe


@pytest.fixture
def start(nursery, tmp_path):
    """``start(shard, **config)`` runs a supervisor; every process group it started is killed at the end."""
    groups: list[int] = []
    engine_script, _ = write_scripts(tmp_path / "scripts")

    def run(shard, **config_changes) -> tuple[ShardSupervisor, list]:
        states: list = []
        engine = SimEngine() if shard.engine == "sim" else ScriptEngine(engine_script)
        supervisor = ShardSupervisor(
            shard,
            engine,
            agent_config(tmp_path, **config_changes),
            states.append,
            on_spawn=lambda child: groups.append(child.pgid),
        )
        nursery.start_soon(supervisor.run)
        return supervisor, states

    try:
        yield run
    finally:
        for pgid in groups:
            kill_group(pgid)


async def test_sim_hung_with_health_200_is_unhealthy_and_killed_fast(start):
    """A sim that stops answering (health still 200) is `unhealthy` naming the hang; its stop is quick."""
    port = free_port("127.0.0.1")
    supervisor, states = start(desired("sim", port, extra_args=["--hang-after-requests", "1"]), stop_grace=30)
    with trio.fail_after(15):
        await wait_state(states, {"ready"})
    url = f"http://127.0.0.1:{port}"
    # the canary's first completion is answered, the second hangs
    with trio.fail_after(2 * CANARY.interval + CANARY.timeout + 5):
        unhealthy = await wait_state(states, {"unhealthy", "exited"})
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/health")).status_code == 200, "the hang should not show on /health"
    assert unhealthy.state == "unhealthy"
    assert unhealthy.detail == (
        f"liveness probe POST {url}/v1/completions got no answer within 5 s and no token was produced "
        "meanwhile with 1 requests running (health still passes): hung"
    )
    started = trio.current_time()
    supervisor.stop()
    with trio.fail_after(HUNG_STOP_GRACE + 3):
        await supervisor.engine_child.exited.wait()
    assert trio.current_time() - started < HUNG_STOP_GRACE + 3, "the hung engine waited the 30 s grace"
    assert not group_alive(supervisor.engine_child.pgid)


async def test_busy_sim_producing_tokens_stays_ready(start, caplog):
    """A sim whose one seat is always taken keeps its canary waiting, yet stays `ready` (non-event, 16 s)."""
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    port = free_port("127.0.0.1")
    args = ["--max-num-seqs", "1", "--tokens-per-second", "10"]
    supervisor, states = start(desired("sim", port, extra_args=args))
    with trio.fail_after(15):
        await wait_state(states, {"ready"})
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def load(client: httpx.AsyncClient, worker: int) -> None:
        for number in range(1000):
            body = {"model": "m", "prompt": f"busy {worker} {number}", "max_tokens": 60}
            await client.post(url, json=body)

    async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as clients:
        for worker in range(4):
            clients.start_soon(load, client, worker)
        await trio.sleep(16)
        clients.cancel_scope.cancel()
    assert [s.state for s in states] == ["running", "ready"]
    busy = [r.getMessage() for r in caplog.records if "busy, not hung" in r.getMessage()]
    assert busy, "the canary was never kept waiting: the test did not load the sim enough"


async def test_engine_hung_on_health_ignoring_sigterm_is_sigkilled_after_the_short_grace(start):
    """An engine whose health hangs and that ignores SIGTERM is SIGKILLed by the agent, not after 30 s."""
    port = free_port("127.0.0.1")
    shard = desired("script", port, extra_args=["--healthy", "3", "--ignore-sigterm"])
    supervisor, states = start(shard, stop_grace=30)
    with trio.fail_after(10):
        unhealthy = await wait_state(states, {"unhealthy"})
    assert unhealthy.detail.startswith("health check failed 3 times in a row")
    started = trio.current_time()
    supervisor.stop()
    with trio.fail_after(HUNG_STOP_GRACE + 3):
        await supervisor.engine_child.exited.wait()
    assert trio.current_time() - started >= HUNG_STOP_GRACE
    assert supervisor.engine_child.stopped_by == "SIGKILL (agent)"
    assert not group_alive(supervisor.engine_child.pgid)
