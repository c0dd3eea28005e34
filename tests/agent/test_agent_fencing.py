"""A node the server no longer trusts is fenced: revoked or expired, it stops every shard and says why.

Real server, real agent, real sim engines; the server's side (the node lost at once, its
replicas out of the routes) is checked through its admin API.
"""

from __future__ import annotations

import logging
import time

import attrs
import llmgw_engine_sim
import trio

from llmgw import pki
from llmgw.agent import serve_agent
from llmgw.plugins import get_plugin_manager
from llmgw.testing.agent import Server, group_alive, make_config, replica_ready
from llmgw.testing.processes import wait_for


def sim_plugins():
    return get_plugin_manager(plugins=[llmgw_engine_sim], entry_points=False)


async def running_replica(server: Server, agent, groups: list[int]) -> tuple[dict, int]:
    """Apply one replica, wait until it is ready; its status and its engine's process group."""
    await server.apply(replicas=1)
    with trio.fail_after(20):
        replica = await wait_for(lambda: replica_ready(server), "the replica to be ready")
    engine = next(iter(agent.supervisors.values())).engine_child
    groups.append(engine.pgid)
    return replica, engine.pgid


def logged(caplog, text: str):
    return next((r for r in caplog.records if text in r.getMessage()), None)


async def test_revoked_node_stops_its_shards_and_the_server_drops_it_at_once(
    server, nursery, tmp_path, test_pki, caplog, groups
):
    """`ca revoke` of a node: the server says it is lost at once, the agent stops every shard and logs why."""
    caplog.set_level(logging.INFO, logger="llmgw")
    agent = await nursery.start(serve_agent, make_config(tmp_path, test_pki, server), sim_plugins())
    _, pgid = await running_replica(server, agent, groups)

    pki.revoke(test_pki.ca, "node-1")
    with trio.fail_after(10):
        await wait_for(lambda: not agent.observed and not group_alive(pgid), "every shard to be stopped")
    record = logged(caplog, "fencing node node-1")
    assert record is not None and record.levelno == logging.ERROR
    # the server, reloading its revocation list, may drop the shard before the agent is refused
    assert "the server refuses its certificate as revoked" in record.getMessage()

    (node,) = (await server.get("/v1/admin/nodes"))["nodes"]
    assert node["state"] == "revoked"
    events = (await server.get("/v1/admin/events"))["events"]
    fenced = [e for e in events if e["subject"] == "node-1" and e["message"].startswith("lost at once")]
    assert fenced and "is revoked; its replicas are rebuilt elsewhere" in fenced[0]["message"]
    routes = await server.get("/v1/routes")
    assert routes["routes"] == {}, "a revoked node's replica is still routed"
    assert agent.fenced is not None


async def test_reonboarded_node_comes_back(server, nursery, tmp_path, test_pki, caplog, groups):
    """After revocation, the node's agent restarted with a new certificate runs a replica again."""
    caplog.set_level(logging.INFO, logger="llmgw")
    config = make_config(tmp_path, test_pki, server)
    scope, stopped = trio.CancelScope(), trio.Event()

    async def first_agent(task_status: trio.TaskStatus) -> None:
        try:
            with scope:
                await serve_agent(config, sim_plugins(), task_status=task_status)
        finally:
            stopped.set()

    agent = await nursery.start(first_agent)
    await running_replica(server, agent, groups)
    pki.revoke(test_pki.ca, "node-1")
    with trio.fail_after(10):
        await wait_for(lambda: not agent.observed, "every shard to be stopped")
    scope.cancel()
    await stopped.wait()

    renewed = pki.issue_node(test_pki.ca, "node-1", out=tmp_path / "renewed", overwrite=True)
    config = attrs.evolve(config, cert=renewed.cert_path, key=renewed.key_path)
    again = await nursery.start(serve_agent, config, sim_plugins())
    with trio.fail_after(30):
        await wait_for(lambda: replica_ready(server), "the replica to be ready on the re-onboarded node")
    groups.append(next(iter(again.supervisors.values())).engine_child.pgid)
    (node,) = (await server.get("/v1/admin/nodes"))["nodes"]
    assert node["state"] == "ready"


async def test_expired_certificate_fences_until_a_sync_is_accepted(
    server, nursery, tmp_path, test_pki, caplog, groups
):
    """A node past its certificate's expiry stops every shard; once trusted again, it runs them again."""
    caplog.set_level(logging.INFO, logger="llmgw")
    agent = await nursery.start(serve_agent, make_config(tmp_path, test_pki, server), sim_plugins())
    replica, pgid = await running_replica(server, agent, groups)

    agent.credentials.not_after = time.time()
    with trio.fail_after(10):
        await wait_for(lambda: not agent.observed and not group_alive(pgid), "every shard to be stopped")
    record = logged(caplog, "fencing node node-1")
    assert record is not None and "expired at" in record.getMessage()
    assert record.getMessage().endswith("re-onboard the node; stopping its 1 shards")

    agent.credentials.not_after = None  # as a renewed certificate would
    with trio.fail_after(30):
        await wait_for(
            lambda: agent.observed and next(iter(agent.observed.values())).state == "ready",
            "the shard to run again",
        )
    groups.append(next(iter(agent.supervisors.values())).engine_child.pgid)
    assert logged(caplog, "node node-1 no longer fenced") is not None


async def test_certificate_rewritten_in_place_is_used_without_a_restart(
    server, nursery, tmp_path, test_pki, caplog, groups
):
    """A fenced agent whose --cert/--key are re-issued where they were comes back by itself."""
    caplog.set_level(logging.INFO, logger="llmgw")
    config = make_config(tmp_path, test_pki, server)
    agent = await nursery.start(serve_agent, config, sim_plugins())
    await running_replica(server, agent, groups)
    pki.revoke(test_pki.ca, "node-1")
    with trio.fail_after(10):
        await wait_for(lambda: agent.fenced and not agent.observed, "the node to be fenced")

    pki.issue_node(test_pki.ca, "node-1", out=config.cert.parent, overwrite=True)
    with trio.fail_after(30):
        await wait_for(lambda: replica_ready(server), "the replica to be ready again on node-1")
    groups.append(next(iter(agent.supervisors.values())).engine_child.pgid)
    assert agent.fenced is None
    assert logged(caplog, "node-1: using the new certificate") is not None
    (node,) = (await server.get("/v1/admin/nodes"))["nodes"]
    assert node["state"] == "ready"
