"""Sidecars with ``{port}``: two replicas of one profile on one node get a port each, and both serve."""

from __future__ import annotations

import sys

import trio

from llmgw.agent.sidecar_args import fill_sidecar
from llmgw.agent.supervisor import shard_log_path
from llmgw.models import LaunchSpec, Sidecar
from llmgw.testing.agent import desired, wait_state
from llmgw.testing.processes import free_port
from tests.agent.test_agent_supervisor import harness, stopped  # noqa: F401 - the fixture


def test_placeholders_are_filled_for_the_shard():
    """{host}, {engine_port}, {gpus}, {model}, {rank}, {replica} and {port}; other braces stay."""
    spec = LaunchSpec(model_source="/m/llama", served_name="llama", host="127.0.0.1", port=20000, gpus=(2, 3))
    sidecar = Sidecar(
        name="proxy",
        argv=["proxy", "{host}:{port}", "--up", "{host}:{engine_port}", "{gpus}", "{model}", "{rank}",
              "{replica}", '{"literal": 1}', "{unknown}"],
        ready="http:{port}/health",
    )  # fmt: skip
    filled = fill_sidecar(sidecar, spec, "llama-0")
    port = filled.argv[1].split(":")[1]
    assert port.isdigit() and port != "20000"
    assert filled.argv[2:] == (
        "--up", "127.0.0.1:20000", "2,3", "/m/llama", "0", "llama-0", '{"literal": 1}', "{unknown}",
    )  # fmt: skip
    assert filled.ready == f"http:{port}/health"


async def test_two_shards_with_one_sidecar_definition_on_one_node_both_become_ready(harness):  # noqa: F811
    """The same sidecar (argv and ready with {port}) for two shards on one address: no collision."""
    sidecar = Sidecar(
        name="web",
        argv=[sys.executable, str(harness.engine_script), "--host", "{host}", "--port", "{port}"],
        ready="http:{port}/healthz",
    )
    shards = [desired("script", free_port(), replica=f"m-{i}", sidecars=[sidecar]) for i in range(2)]
    started = [harness.start(shard) for shard in shards]
    with trio.fail_after(20):
        for _, states in started:
            assert (await wait_state(states, {"ready", "exited", "unhealthy"})).state == "ready", states
    logs = [shard_log_path(harness.tmp_path / "agent" / "logs", shard, "web") for shard in shards]
    serving = {next(line for line in log.read_text().splitlines() if "serving on" in line) for log in logs}
    assert len(serving) == 2, serving  # "fake engine serving on 127.0.0.1:PORT", a port each
    for supervisor, _ in started:
        await stopped(supervisor)
