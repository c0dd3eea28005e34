"""The agent's metrics of a shard's life: its start, its canaries, the hang that fails it."""

from __future__ import annotations

from functools import partial

import pytest
import trio
from llmgw_engine_sim import SimEngine

from llmgw.agent.config import AgentConfigError, load_agent_config
from llmgw.agent.metrics import AgentMetrics
from llmgw.agent.supervisor import ShardSupervisor
from llmgw.testing.agent import agent_config, desired, kill_group, wait_state
from llmgw.testing.processes import free_port

CANARY = SimEngine.liveness_probe


async def test_a_hung_sim_counts_canaries_and_a_hung_failure(nursery, tmp_path):
    """A sim hanging after 1 request: 1 start, 1 canary ``ok``, 1 ``hung``, 1 failure caused ``hung``."""
    metrics = AgentMetrics()
    states: list = []
    last: list = [None]

    def report(observed) -> None:
        metrics.shard_changed(supervisor, last[0], observed)
        last[0] = observed
        states.append(observed)

    shard = desired("sim", free_port("127.0.0.1"), extra_args=["--hang-after-requests", "1"])
    supervisor = ShardSupervisor(shard, SimEngine(), agent_config(tmp_path), report)
    supervisor.on_canary = partial(metrics.canary, supervisor)
    metrics.started(supervisor)
    last[0] = supervisor.observed
    nursery.start_soon(supervisor.run)
    try:
        with trio.fail_after(15 + 3 * CANARY.interval + CANARY.timeout):
            await wait_state(states, {"unhealthy", "exited"})
    finally:
        supervisor.stop()
        if supervisor.engine_child is not None:
            kill_group(supervisor.engine_child.pgid)

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model": "m", **labels})

    assert value("llmgw_agent_shard_starts_total") == 1
    assert value("llmgw_agent_canary_results_total", result="ok") == 1
    assert value("llmgw_agent_canary_results_total", result="hung") == 1
    assert value("llmgw_agent_canary_results_total", result="failed") == 0
    assert value("llmgw_agent_shard_failures_total", cause="hung") == 1
    assert value("llmgw_agent_shard_failures_total", cause="exited") == 0


def test_metrics_listen_is_off_by_default_and_checked(tmp_path):
    """No ``--metrics-listen``: not served; one from agent.toml is kept; a bad one names the flag."""
    from tests.agent.test_agent_config import FLAGS

    assert load_agent_config(FLAGS).metrics_listen is None
    path = tmp_path / "agent.toml"
    path.write_text('metrics_listen = "0.0.0.0:9465"\n')
    assert load_agent_config(FLAGS, path).metrics_listen == "0.0.0.0:9465"
    with pytest.raises(AgentConfigError, match=r"--metrics-listen 'nowhere': expected HOST:PORT"):
        load_agent_config({**FLAGS, "metrics_listen": "nowhere"})
