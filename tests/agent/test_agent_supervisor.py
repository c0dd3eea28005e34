"""One shard under the agent's supervisor: real processes (the sim engine, fake engines, sidecars)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import attrs
import httpx
import pytest
import trio
from llmgw_engine_sim import SimEngine

from llmgw.agent.records import ProcessRecords
from llmgw.agent.supervisor import ShardSupervisor, shard_log_path
from llmgw.agent.sync import Agent
from llmgw.models import NodeFacts, Sidecar
from llmgw.testing.agent import (
    ScriptEngine,
    agent_config,
    desired,
    group_alive,
    kill_group,
    pid_alive,
    port_free,
    wait_state,
    write_scripts,
)
from llmgw.testing.processes import WaitTimeout, free_port, wait_for
from llmgw.wire import SyncReply


class Harness:
    """Runs supervisors in a nursery; kills every process group they started when the test ends."""

    def __init__(self, nursery: trio.Nursery, tmp_path) -> None:
        self.nursery = nursery
        self.tmp_path = tmp_path
        self.engine_script, self.sidecar_script = write_scripts(tmp_path / "scripts")
        self.groups: list[int] = []

    def engine(self, name: str):
        return SimEngine() if name == "sim" else ScriptEngine(self.engine_script)

    def start(self, shard, **config_changes) -> tuple[ShardSupervisor, list]:
        states: list = []
        config = agent_config(self.tmp_path, **config_changes)
        supervisor = ShardSupervisor(
            shard, self.engine(shard.engine), config, states.append,
            on_spawn=lambda child: self.groups.append(child.pgid),
        )
        self.nursery.start_soon(supervisor.run)
        return supervisor, states

    def cleanup(self) -> None:
        for pgid in self.groups:
            kill_group(pgid)


@pytest.fixture
async def harness(nursery, tmp_path):
    """Supervisors for one test; their process groups are killed however the test ends."""
    h = Harness(nursery, tmp_path)
    try:
        yield h
    finally:
        h.cleanup()


async def stopped(supervisor: ShardSupervisor) -> None:
    """Stop a supervisor and wait until every one of its processes is gone (by a 10 s deadline)."""
    supervisor.stop()
    children = [c for c in [supervisor.engine_child, *supervisor.sidecars] if c is not None]
    with trio.fail_after(10):
        for child in children:
            await child.exited.wait()


class TestEngine:
    """The engine process: start, readiness, stop, exit."""

    async def test_sim_shard_becomes_ready(self, harness):
        """A sim shard goes starting → running → ready, reports the engine's pid, and logs to its file."""
        port = free_port("127.0.0.1")
        supervisor, states = harness.start(desired("sim", port))
        with trio.fail_after(15):
            ready = await wait_state(states, {"ready", "exited", "unhealthy"})
        assert ready.state == "ready", ready
        assert [s.state for s in states][:2] == ["running", "ready"]
        assert ready.pid == supervisor.engine_child.pid and pid_alive(ready.pid)
        assert ready.port == port
        log = shard_log_path(harness.tmp_path / "agent" / "logs", supervisor.desired)
        assert log.name == "m-0-1-r0.log" and log.exists()
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200

    async def test_the_command_environment_log_and_engine_version_are_reported(self, harness):
        """What the shard runs is reported with it: argv, the environment llmgw set, its log, the version."""
        port = free_port("127.0.0.1")
        shard = attrs.evolve(desired("sim", port), spec=attrs.evolve(desired("sim", port).spec, gpus=(2, 3)))
        config = agent_config(harness.tmp_path)
        states: list = []
        supervisor = ShardSupervisor(
            shard, SimEngine(), config, states.append, on_spawn=lambda c: harness.groups.append(c.pgid),
            engine_version="0.2.0",
        )
        assert supervisor.observed.log_path == str(shard_log_path(config.logs_dir, shard))
        harness.nursery.start_soon(supervisor.run)
        with trio.fail_after(15):
            ready = await wait_state(states, {"ready", "exited"})
        assert ready.state == "ready", ready
        assert ready.argv[1:3] == ("--model", "tiny/model") and ready.argv[0].endswith("llmgw-sim")
        assert ready.env == {"CUDA_VISIBLE_DEVICES": "2,3"}
        assert ready.engine_version == "0.2.0" and ready.log_path == str(supervisor.log_path)

    async def test_stop_ends_the_whole_group_and_frees_the_port(self, harness):
        """Stopping a shard ends its engine's whole process group with SIGTERM, and its port is free."""
        port = free_port("127.0.0.1")
        supervisor, states = harness.start(desired("sim", port))
        with trio.fail_after(15):
            await wait_state(states, {"ready"})
        child = supervisor.engine_child
        await stopped(supervisor)
        assert states[-1].state == "stopping"
        assert child.stopped_by == "SIGTERM"
        assert not group_alive(child.pgid) and not pid_alive(child.pid)
        assert port_free("127.0.0.1", port)

    async def test_engine_ignoring_sigterm_is_killed_after_the_grace(self, harness):
        """An engine that ignores SIGTERM is SIGKILLed once the grace period is over."""
        port = free_port("127.0.0.1")
        shard = desired("script", port, extra_args=["--ignore-sigterm"])
        supervisor, states = harness.start(shard, stop_grace=0.5)
        with trio.fail_after(10):
            await wait_state(states, {"ready"})
        pgid = supervisor.engine_child.pgid
        start = trio.current_time()
        await stopped(supervisor)
        assert supervisor.engine_child.stopped_by in ("SIGKILL", "SIGKILL (agent)")
        assert trio.current_time() - start >= 0.5
        assert not group_alive(pgid)

    async def test_the_profiles_stop_grace_wins_over_the_agents(self, harness):
        """A shard sent with stop_grace 0.5 is SIGKILLed 0.5 s after SIGTERM (the agent says 30 s)."""
        port = free_port("127.0.0.1")
        shard = attrs.evolve(desired("script", port, extra_args=["--ignore-sigterm"]), stop_grace=0.5)
        supervisor, states = harness.start(shard, stop_grace=30.0)
        with trio.fail_after(10):
            await wait_state(states, {"ready"})
        start = trio.current_time()
        await stopped(supervisor)
        assert supervisor.engine_child.stopped_by in ("SIGKILL", "SIGKILL (agent)")
        assert 0.5 <= trio.current_time() - start < 10

    async def test_exit_reports_code_and_last_log_line(self, harness):
        """An engine that exits is reported `exited` with its exit code and its log's last line."""
        port = free_port("127.0.0.1")
        supervisor, states = harness.start(desired("sim", port, extra_args=["--exit-after-requests", "1"]))
        with trio.fail_after(15):
            await wait_state(states, {"ready"})
        async with httpx.AsyncClient(timeout=10) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        with trio.fail_after(10):
            exited = await wait_state(states, {"exited"})
        assert exited.exit_code == 1
        log = shard_log_path(harness.tmp_path / "agent" / "logs", supervisor.desired).read_text()
        last = [line for line in log.splitlines() if line.strip() and "[llmgw-launcher]" not in line][-1]
        assert exited.detail == last.strip()
        assert "exiting with code 1" in exited.detail
        assert not group_alive(supervisor.engine_child.pgid)

    async def test_missing_program_is_reported_exited(self, harness, tmp_path):
        """An engine program that does not exist gives `exited` with code 127 and says which path."""
        shard = desired("sim", free_port("127.0.0.1"))
        supervisor, states = harness.start(shard, engines={"sim": {"llmgw-sim": str(tmp_path / "nope")}})
        with trio.fail_after(10):
            exited = await wait_state(states, {"exited"})
        assert exited.exit_code == 127
        assert "nope" in exited.detail and "No such file" in exited.detail


class TestMultiNode:
    """A two-node sim replica: rank 0 is probed, the worker is `running`; a lost peer ends both."""

    async def test_worker_runs_rank0_ready_and_a_lost_peer_ends_both(self, harness):
        """Rank 0 gets ready once the worker joined; killing the worker's engine makes rank 0 exit 1."""
        port, dist = free_port("127.0.0.1"), free_port("127.0.0.1")
        common = dict(nnodes=2, dist_init_addr=f"127.0.0.1:{dist}", extra_args=["--peer-timeout", "0.5"])
        rank0, states0 = harness.start(desired("sim", port, rank=0, **common))
        rank1, states1 = harness.start(desired("sim", free_port("127.0.0.1"), rank=1, **common))
        with trio.fail_after(15):
            assert (await wait_state(states0, {"ready", "exited"})).state == "ready"
        assert states1[-1].state == "running" and rank1.log_path.name == "m-0-1-r1.log"

        os.killpg(rank1.engine_child.pgid, signal.SIGKILL)
        with trio.fail_after(10):
            exited1 = await wait_state(states1, {"exited"})
        assert exited1.exit_code == -signal.SIGKILL and exited1.detail is not None
        with trio.fail_after(10):
            exited0 = await wait_state(states0, {"exited"})
        assert exited0.exit_code == 1
        assert not group_alive(rank0.engine_child.pgid)


class TestHealth:
    """Rank 0's health probe."""

    async def test_health_that_hangs_after_ready_makes_the_shard_unhealthy(self, harness):
        """Rank 0 whose health check stops answering after it was ready goes `unhealthy` after 3 failures."""
        port = free_port("127.0.0.1")
        supervisor, states = harness.start(desired("script", port, extra_args=["--healthy", "3"]))
        with trio.fail_after(10):
            await wait_state(states, {"ready"})
        with trio.fail_after(10):
            unhealthy = await wait_state(states, {"unhealthy"})
        assert "health check failed 3 times in a row" in unhealthy.detail
        assert f":{port}/health" in unhealthy.detail
        assert pid_alive(unhealthy.pid)  # the agent reports; the server decides to tear it down

    async def test_never_healthy_is_unhealthy_after_the_ready_timeout(self, harness):
        """Rank 0 that never answers 200 is `unhealthy` once its ready timeout passed, naming the answer."""
        port = free_port("127.0.0.1")
        shard = desired("script", port, extra_args=["--status", "503"], ready_timeout=1.0)
        supervisor, states = harness.start(shard)
        with trio.fail_after(10):
            unhealthy = await wait_state(states, {"unhealthy", "ready"})
        assert unhealthy.state == "unhealthy"
        assert unhealthy.detail.startswith("not ready within 1 s") and "HTTP 503" in unhealthy.detail


class TestSidecars:
    """Sidecars start first, each ready before the engine starts."""

    async def test_engine_starts_only_after_its_sidecar_is_ready(self, harness):
        """The engine checks the sidecar's port at startup and exits 1 if it is not listening: it must not."""
        port, side_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        sidecar = Sidecar(
            name="proxy",
            argv=[_python(), str(harness.sidecar_script), "--host", "127.0.0.1", "--port", str(side_port),
                  "--delay", "0.8"],
            ready=f"tcp:{side_port}",
        )
        shard = desired("script", port, extra_args=["--need-port", str(side_port)], sidecars=[sidecar])
        supervisor, states = harness.start(shard)
        with trio.fail_after(15):
            result = await wait_state(states, {"ready", "exited", "unhealthy"})
        assert result.state == "ready", result
        engine_log = shard_log_path(harness.tmp_path / "agent" / "logs", shard).read_text()
        assert f"sidecar port {side_port} is listening" in engine_log
        sidecar_child = supervisor.sidecars[0]
        await stopped(supervisor)
        assert not group_alive(sidecar_child.pgid) and not group_alive(supervisor.engine_child.pgid)

    async def test_http_sidecar_is_ready_when_it_answers_200(self, harness):
        """A sidecar with `ready: http:PORT/PATH` is ready once that GET answers 200; then the engine runs."""
        port, side_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        sidecar = Sidecar(
            name="web",
            argv=[_python(), str(harness.engine_script), "--host", "127.0.0.1", "--port", str(side_port)],
            ready=f"http:{side_port}/healthz",
        )
        shard = desired("script", port, extra_args=["--need-port", str(side_port)], sidecars=[sidecar])
        supervisor, states = harness.start(shard)
        with trio.fail_after(15):
            assert (await wait_state(states, {"ready", "exited", "unhealthy"})).state == "ready"
        assert shard_log_path(harness.tmp_path / "agent" / "logs", shard, "web").exists()

    async def test_sidecar_not_ready_in_time_makes_the_shard_unhealthy(self, harness):
        """A sidecar not ready within the deadline: `unhealthy`, naming it; the engine never starts."""
        port, side_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        sidecar = Sidecar(
            name="slow", argv=[_python(), str(harness.sidecar_script), "--host", "127.0.0.1", "--port",
                               str(side_port), "--delay", "30"],
            ready=f"tcp:{side_port}",
        )
        supervisor, states = harness.start(desired("script", port, sidecars=[sidecar]), sidecar_timeout=0.5)
        with trio.fail_after(10):
            unhealthy = await wait_state(states, {"unhealthy", "running", "ready"})
        assert unhealthy.state == "unhealthy"
        assert unhealthy.detail.startswith("sidecar slow not ready within 0.5 s")
        assert supervisor.engine_child is None

    async def test_sidecar_that_exits_makes_the_shard_unhealthy(self, harness, tmp_path):
        """A sidecar that exits while its shard runs makes it `unhealthy`, with the sidecar's exit."""
        port, side_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        give_up = tmp_path / "sidecar-gives-up"
        sidecar = Sidecar(
            name="flaky", argv=[_python(), str(harness.sidecar_script), "--host", "127.0.0.1", "--port",
                                str(side_port), "--exit-when", str(give_up)],
            ready=f"tcp:{side_port}",
        )
        supervisor, states = harness.start(desired("script", port, sidecars=[sidecar]))
        with trio.fail_after(10):
            await wait_state(states, {"ready"})
        give_up.touch()
        with trio.fail_after(10):
            unhealthy = await wait_state(states, {"unhealthy"})
        assert unhealthy.detail == "sidecar flaky exited with code 3 while the shard ran: sidecar giving up"


def _python() -> str:
    return sys.executable


@pytest.fixture
async def script_agent(nursery, tmp_path):
    """An agent of script engines (stop grace 1 s) in the test's nursery; its shards end with the test."""
    engine_script, _ = write_scripts(tmp_path / "scripts")
    config = agent_config(tmp_path, stop_grace=1.0)
    facts = NodeFacts(node_id="node-1", agent_version="0")
    records = ProcessRecords(config.runtime_dir)
    agent = Agent(config, {"script": ScriptEngine(engine_script)}, facts, records, ssl_context=None)
    agent.shards_nursery = nursery
    try:
        yield agent
    finally:
        for supervisor in list(agent.supervisors.values()):
            supervisor.cancel_scope.cancel()
            for child in [supervisor.engine_child, *supervisor.sidecars]:
                if child is not None:
                    kill_group(child.pgid)


class TestApply:
    """The agent applying the server's replies to its shards."""

    async def test_new_shard_waits_for_a_stopping_shard_holding_its_port(self, script_agent):
        """A shard replacing another on the same port starts only once the old one is gone."""
        agent = script_agent
        port = free_port("127.0.0.1")
        old = desired("script", port, replica="a-0", extra_args=["--ignore-sigterm"])
        new = desired("script", port, replica="b-0")
        agent.apply(SyncReply(revision=1, shards=[old]))
        with trio.fail_after(10):
            await wait_for(lambda: agent.observed[old.key].state == "ready", "the old shard ready")
        old_group = agent.supervisors[old.key].engine_child.pgid
        agent.apply(SyncReply(revision=2, shards=[new]))
        assert agent.observed[new.key].state == "starting" and agent.observed[old.key].state == "stopping"
        with trio.fail_after(10):
            await wait_for(
                lambda: agent.observed[new.key].state in ("ready", "exited"), "the new shard to start"
            )
        assert agent.observed[new.key].state == "ready", agent.observed[new.key]
        assert old.key not in agent.observed and not group_alive(old_group)
        assert pid_alive(agent.observed[new.key].pid)

    async def test_a_new_shard_waits_for_a_lingering_shard_on_its_port(self, script_agent):
        """The server gave the port of a replica that left the routes (lingering until the gateways let
        go of it: still desired, running) to a new shard: the new one starts once the old one is gone."""
        agent = script_agent
        port = free_port("127.0.0.1")
        lingering = desired("script", port, replica="a-0")
        new = desired("script", port, replica="b-0")
        agent.apply(SyncReply(revision=1, shards=[lingering]))
        with trio.fail_after(10):
            await wait_for(lambda: agent.observed[lingering.key].state == "ready", "the old shard ready")
        pid = agent.observed[lingering.key].pid
        agent.apply(SyncReply(revision=2, shards=[lingering, new]))
        waiting = agent.supervisors[new.key]
        # a shard not held back spawns its engine in well under 3 s; this one must not
        with contextlib.suppress(WaitTimeout), trio.fail_after(3):
            await wait_for(lambda: waiting.engine_child is not None, "the new shard to spawn")
        assert waiting.engine_child is None and agent.observed[new.key].state == "starting"
        assert agent.observed[lingering.key].state == "ready" and pid_alive(pid)
        agent.apply(SyncReply(revision=3, shards=[new]))
        with trio.fail_after(10):
            await wait_for(lambda: agent.observed[new.key].state in ("ready", "exited"), "the new shard")
        assert agent.observed[new.key].state == "ready", agent.observed[new.key]
        assert lingering.key not in agent.observed and not pid_alive(pid)

    async def test_a_held_worker_runs_on_until_dropped_and_is_never_started(self, script_agent):
        """A held shard runs on (one on its port waits); a held shard not running is never started."""
        agent = script_agent
        port = free_port("127.0.0.1")
        worker = desired("script", port, replica="a-0")
        new = desired("script", port, replica="b-0")
        never = attrs.evolve(desired("script", free_port("127.0.0.1"), replica="c-0"), stop_after_rank0=True)
        agent.apply(SyncReply(revision=1, shards=[worker]))
        with trio.fail_after(10):
            await wait_for(lambda: agent.observed[worker.key].state == "ready", "the worker ready")
        pid = agent.observed[worker.key].pid
        held = attrs.evolve(worker, stop_after_rank0=True)
        agent.apply(SyncReply(revision=2, shards=[held, new, never]))
        assert agent.observed[worker.key].state == "ready" and pid_alive(pid)
        assert agent.observed[new.key].state == "starting"
        assert never.key not in agent.observed and never.key not in agent.supervisors
        agent.apply(SyncReply(revision=3, shards=[new]))
        with trio.fail_after(10):
            await wait_for(lambda: agent.observed.get(new.key).state == "ready", "the new shard to start")
        assert worker.key not in agent.observed and not pid_alive(pid)
