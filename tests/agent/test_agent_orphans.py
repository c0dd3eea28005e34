"""An agent killed with -9 leaves no orphan engine; a new agent gets the replica ready again.

The agent runs as a real process (``llmgw agent``) against a real server, with
the sim engine. What is proven: the shards stop with the agent (its
launchers end their groups when its pipe closes), nothing is left holding
the engine's port, and the next agent reports the old shard ``exited`` so
the server rebuilds the replica, which becomes ready again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from llmgw.testing import make_gpus, write_fake_nvidia_smi
from llmgw.testing.agent import ADDRESS, SIM, Server, group_alive, kill_group, port_free
from llmgw.testing.processes import ProcessSet, free_port, wait_for

#: runs the click command directly, so these tests do not depend on where `agent` is registered
RUNNER = "import sys; from llmgw.agent.cli import agent; agent(sys.argv[1:], prog_name='llmgw agent')"


@pytest.fixture
async def server(nursery, test_pki, tmp_path):
    """A running server (``Server``) on 127.0.0.1."""
    server = Server(nursery, test_pki, tmp_path / "server")
    await server.start()
    return server


@pytest.fixture
def procs(tmp_path):
    """Processes of this test; each process group is killed when it ends, pass or fail."""
    started = ProcessSet(tmp_path / "processes")
    try:
        yield started
    finally:
        started.kill_all()


@pytest.fixture
def agent_files(tmp_path, test_pki, server):
    """An agent.toml (fast probes and retries) and its state directory; recorded groups killed at the end."""
    issued = test_pki.client("node", "node-1")
    smi = write_fake_nvidia_smi(tmp_path / "nvidia-smi", make_gpus(8, seed="node-1"))
    state = tmp_path / "agent-state"
    low = free_port(ADDRESS)
    config = tmp_path / "agent.toml"
    config.write_text(
        f"""
node = "node-1"
server = "{server.url}"
address = "{ADDRESS}"
cert = "{issued.cert_path}"
key = "{issued.key_path}"
ca = "{test_pki.ca.cert_path}"
state_dir = "{state}"
models_dir = "{tmp_path / 'models'}"
peer_port = 0
nvidia_smi = "{smi}"
ib_root = "{tmp_path / 'no-ib'}"
port_range = [{low}, {min(low + 50, 65535)}]
stop_grace = 3

[engines.sim]
"llmgw-sim" = "{SIM}"

[health]
interval = 0.1

[sync]
backoff_initial = 0.05
backoff_max = 0.5
"""
    )
    yield config, state
    for path in (state / "run" / "groups").glob("*.json"):
        kill_group(json.loads(path.read_text())["pgid"])


def start_agent(procs: ProcessSet, config: Path):
    """``llmgw agent --config agent.toml`` as a real process."""
    return procs.start([sys.executable, "-c", RUNNER, "--config", str(config)], name="agent")


async def ready_replica(server: Server, procs: ProcessSet, *, not_attempt: int | None = None) -> dict:
    """Wait, by the caller's deadline, for the replica and its shard ready (by a new attempt, if asked)."""

    async def ready():
        replicas = (await server.get("/v1/admin/replicas"))["replicas"]
        if not replicas:
            return None
        replica = replicas[0]
        fresh = replica["attempt"] != not_attempt
        shard_ready = replica["shards"][0]["state"] == "ready"
        return replica if fresh and replica["state"] == "ready" and shard_ready else None

    return await wait_for(ready, "the replica to be ready", procs)


def pgid_of(pid: int) -> int:
    """The process group of ``pid``."""
    return int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[2])


async def test_kill_9_of_the_agent_leaves_no_orphan(server, procs, agent_files):
    """kill -9 of the agent ends its engine's group and frees its port; a new agent gets it ready again."""
    config, state = agent_files
    agent = start_agent(procs, config)
    await server.apply(replicas=1)
    with trio.fail_after(30):
        first = await ready_replica(server, procs)
    shard = first["shards"][0]
    pgid = pgid_of(shard["pid"])
    assert pgid != agent.pid and group_alive(pgid) and not port_free(ADDRESS, shard["port"])

    agent.signal(signal.SIGKILL)
    with trio.fail_after(5):
        await agent.wait_exit_trio()
    with trio.fail_after(10):
        await wait_for(lambda: not group_alive(pgid), "the engine's process group to end", procs)
    with trio.fail_after(5):
        await wait_for(lambda: port_free(ADDRESS, shard["port"]), "the engine's port to be free")

    again = start_agent(procs, config)
    with trio.fail_after(30):
        second = await ready_replica(server, procs, not_attempt=first["attempt"])
    assert second["shards"][0]["pid"] != shard["pid"]
    with trio.fail_after(5):
        await again.wait_for_stderr_trio("was running under the previous agent: reporting it exited")
    # the new agent reported the model sources from its first sync: the replica was rebuilt in place,
    # and an agent restart is no failure of the replica's (no backoff, no count)
    messages = [e["message"] for e in (await server.get("/v1/admin/events"))["events"]]
    assert any(m.startswith("starting again: the agent of ") and "restarted" in m for m in messages), messages
    assert not any(m.startswith(("failed", "removed")) for m in messages), messages
    assert second["failures"] == 0

    # and a clean stop: SIGTERM stops every shard and exits 0
    new_pgid = pgid_of(second["shards"][0]["pid"])
    again.signal(signal.SIGTERM)
    with trio.fail_after(15):
        assert await again.wait_exit_trio() == 0
    assert not group_alive(new_pgid)
    assert "ended by SIGTERM" in again.stderr()


async def test_new_agent_ends_groups_its_launchers_did_not(server, procs, agent_files):
    """If the launcher dies with the agent, the engine is orphaned: the next agent ends it at start."""
    config, state = agent_files
    agent = start_agent(procs, config)
    await server.apply(replicas=1)
    with trio.fail_after(30):
        first = await ready_replica(server, procs)
    shard = first["shards"][0]
    pgid = pgid_of(shard["pid"])

    agent.signal(signal.SIGKILL)
    os.kill(pgid, signal.SIGKILL)  # the launcher leads the group; its engine lives on, orphaned
    with trio.fail_after(5):
        await agent.wait_exit_trio()
    assert group_alive(pgid) and not port_free(ADDRESS, shard["port"])

    again = start_agent(procs, config)
    with trio.fail_after(10):
        await again.wait_for_stderr_trio("left by an earlier agent: process group")
    assert not group_alive(pgid) and port_free(ADDRESS, shard["port"])
    with trio.fail_after(30):
        second = await ready_replica(server, procs, not_attempt=first["attempt"])
    assert second["shards"][0]["pid"] != shard["pid"]
