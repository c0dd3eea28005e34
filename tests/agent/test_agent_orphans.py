"""An agent process killed, stopped and paused: its engines outlive it, and a pause fails none of them.

The agent runs as a real process (``llmgw agent``) against a real server, with
the sim engine. What is proven: an agent killed with -9 leaves its engine
running, the next agent adopts it (the same pid, the same attempt, the
replica never leaves ``ready``), an agent stopped with SIGTERM leaves it too,
and with no agent for ``orphan_grace`` seconds the launcher ends the engine's
group and frees its port. A group whose launcher died cannot be adopted: the
next agent ends it, and the replica is rebuilt. An agent paused (SIGSTOP) for
longer than its canary's limit re-arms the canary when it runs again: its
healthy engine is not failed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio

from llmgw.agent.launcher import group_members
from llmgw.testing import make_gpus, write_fake_nvidia_smi
from llmgw.testing.agent import ADDRESS, SIM, Server, group_alive, kill_group, port_free
from llmgw.testing.metrics import samples
from llmgw.testing.processes import ProcessSet, free_port, wait_for

#: seconds a launcher keeps its engine with no agent attached, in these tests: the next agent starts and
#: adopts it within about 2 s (several on a loaded machine), and the first test waits this out once
ORPHAN_GRACE = 12
#: seconds an agent may take to start and get a replica ready (discovery runs programs: slow under load)
STARTUP = 90

#: runs the click command directly, so these tests do not depend on where `agent` is registered
RUNNER = "import sys; from llmgw.agent.cli import agent; agent(sys.argv[1:], prog_name='llmgw agent')"


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
    metrics = next(p for p in iter(lambda: free_port(ADDRESS), None) if not low <= p <= low + 50)
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
orphan_grace = {ORPHAN_GRACE}
metrics_listen = "{ADDRESS}:{metrics}"

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


def metrics_port(config: Path) -> int:
    """The port of the agent's ``metrics_listen`` in ``config``."""
    return int(re.search(r'metrics_listen = ".*:(\d+)"', config.read_text())[1])


async def canary_results(url: str) -> dict[str, float]:
    """The agent's ``llmgw_agent_canary_results_total`` by result."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(url)).text
    return {labels["result"]: v for labels, v in samples(text, "llmgw_agent_canary_results_total")}


async def _more(url: str, before: dict[str, float]) -> dict[str, float] | None:
    """The canary results once more canaries were judged than in ``before`` (None until then)."""
    now = await canary_results(url)
    return now if sum(now.values()) > sum(before.values()) else None


def pgid_of(pid: int) -> int:
    """The process group of ``pid``."""
    return int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[2])


async def test_kill_9_then_sigterm_leave_the_engine_to_the_next_agent_then_its_grace_ends_it(
    server, procs, agent_files
):
    """kill -9: the engine runs on and a new agent adopts it (same pid, same attempt, still ready);
    SIGTERM: the same; no agent for the orphan grace: the group ends and the port is free."""
    config, state = agent_files
    agent = start_agent(procs, config)
    await server.apply(replicas=1)
    with trio.fail_after(STARTUP):
        first = await ready_replica(server, procs)
    shard = first["shards"][0]
    pgid = pgid_of(shard["pid"])
    assert pgid != agent.pid and group_alive(pgid) and not port_free(ADDRESS, shard["port"])

    agent.signal(signal.SIGKILL)
    with trio.fail_after(5):
        await agent.wait_exit_trio()
    again = start_agent(procs, config)
    with trio.fail_after(STARTUP):
        await again.wait_for_stderr_trio("adopted 1 shards an earlier agent left running")
        await again.wait_for_stderr_trio("synced with server")
    with trio.fail_after(STARTUP):
        second = await ready_replica(server, procs)
    assert (second["attempt"], second["shards"][0]["pid"]) == (first["attempt"], shard["pid"])
    assert second["failures"] == 0 and group_alive(pgid)
    async def adopted_event() -> list[str]:  # events reach the store at the reconciler's next flush
        messages = [e["message"] for e in (await server.get("/v1/admin/events"))["events"]]
        adopted = any(m.startswith("its agent restarted and adopted every shard") for m in messages)
        return messages if adopted else []

    with trio.fail_after(15):
        messages = await wait_for(adopted_event, "the event 'its agent restarted and adopted every shard'")
    assert not any(m.startswith(("failed", "removed", "starting again")) for m in messages), messages
    assert "adopted by the agent with pid" in await trio.Path(shard["log_path"]).read_text()

    # SIGTERM (an upgrade, systemctl restart): it exits 0 and leaves the engine running
    again.signal(signal.SIGTERM)
    with trio.fail_after(15):
        assert await again.wait_exit_trio() == 0
    assert "leaving 1 shards running" in again.stderr()
    assert group_alive(pgid) and shard["pid"] in group_members(pgid)

    # no agent comes back: past the orphan grace the launcher ends the group
    with trio.fail_after(ORPHAN_GRACE + 10):
        await wait_for(lambda: not group_alive(pgid), "the orphaned engine's group to end", procs)
    assert port_free(ADDRESS, shard["port"])
    assert "no agent adopted the command within" in await trio.Path(shard["log_path"]).read_text()


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


async def test_an_agent_paused_past_its_canary_limit_fails_no_healthy_engine(server, procs, agent_files):
    """SIGSTOP of the agent for 9 s (the sim's canary gives up after 2 s + 5 s), then SIGCONT: the agent
    re-arms its canary, and the engine keeps its pid, the replica its attempt, no failure counted."""
    config, state = agent_files
    agent = start_agent(procs, config)
    await server.apply(replicas=1)
    with trio.fail_after(STARTUP):
        first = await ready_replica(server, procs)
    agent.signal(signal.SIGSTOP)
    await trio.sleep(9)  # the pause itself is what is tested: nothing to wait for
    agent.signal(signal.SIGCONT)
    with trio.fail_after(30):
        await agent.wait_for_stderr_trio("the liveness canary starts again")
    # the next canary is judged 2 s later if answered, 7 s (interval + timeout) if it were taken for a hang
    url = f"http://{ADDRESS}:{metrics_port(config)}/metrics"
    judged = await canary_results(url)
    with trio.fail_after(30):
        now = await wait_for(lambda: _more(url, judged), "the next canary's verdict", procs)
    verdicts = {result: n - judged.get(result, 0) for result, n in now.items() if n != judged.get(result, 0)}
    assert verdicts == {"ok": 1}, f"the first canary after the pause: {verdicts}"
    with trio.fail_after(30):
        after = await ready_replica(server, procs)
    assert (after["attempt"], after["shards"][0]["pid"], after["failures"]) == (
        first["attempt"], first["shards"][0]["pid"], 0
    ), agent.stderr()[-3000:]
    assert "unhealthy" not in agent.stderr()
