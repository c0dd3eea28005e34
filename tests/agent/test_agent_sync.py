"""The agent against the real control plane: mutual TLS, long-poll, facts, shards, outages, refusals."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import httpx
import llmgw_engine_sim
import trio
from llmgw_engine_sim import SimEngine

import llmgw
from llmgw.agent import serve_agent
from llmgw.net.server import HttpServer, Request, Response
from llmgw.pki import server_ssl_context
from llmgw.plugins import get_plugin_manager
from llmgw.testing.agent import (
    ADDRESS,
    group_alive,
    make_config,
    pid_alive,
    port_free,
    replica_ready,
)
from llmgw.testing.processes import wait_for


def sim_plugins():
    """The built-in plugins and the sim engine only, whatever else is installed."""
    return get_plugin_manager(plugins=[llmgw_engine_sim], entry_points=False)


class TestSync:
    """Facts up, shards down, and what happens when the server goes away."""

    async def test_facts_arrive_and_desired_shards_run(
        self, server, nursery, tmp_path, test_pki, groups
    ):
        """The node shows up with its GPUs and engines; the catalog's replica starts, is ready, and stops."""
        agent = await nursery.start(serve_agent, make_config(tmp_path, test_pki, server), sim_plugins())

        async def registered():
            nodes = (await server.get("/v1/admin/nodes"))["nodes"]
            return nodes[0] if nodes else None

        with trio.fail_after(10):
            node = await wait_for(registered, "node-1 to register")
        assert node["node_id"] == "node-1" and node["address"] == ADDRESS
        assert (node["gpus_total"], node["engines"]) == (8, {"sim": SimEngine.checked_versions[0]})
        assert node["agent_version"] == llmgw.__version__
        assert node["warnings"] == []

        await server.apply(replicas=1)
        with trio.fail_after(20):
            replica = await wait_for(lambda: replica_ready(server), "the replica to be ready")
        shard = replica["shards"][0]
        groups.append(agent.supervisors[next(iter(agent.supervisors))].engine_child.pgid)
        assert shard["state"] == "ready" and shard["node"] == "node-1" and pid_alive(shard["pid"])
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://{ADDRESS}:{shard['port']}/health")).status_code == 200
        assert agent.facts.model_sources == ("tiny/model",)  # a hub-style name counts as present
        assert list(agent.observed)[0].startswith("small-0/")

        engine = next(iter(agent.supervisors.values())).engine_child
        await server.apply(replicas=0)
        with trio.fail_after(10):
            await wait_for(lambda: not agent.observed, "the shard to be stopped and forgotten")
        assert not group_alive(engine.pgid) and port_free(ADDRESS, shard["port"])
        assert engine.stopped_by == "SIGTERM"

    async def test_server_restart_does_not_restart_the_engine(
        self, server, nursery, tmp_path, test_pki, caplog, groups
    ):
        """Server stopped and started again: the agent keeps its engine running and the server adopts it."""
        caplog.set_level(logging.DEBUG, logger="llmgw.agent")
        agent = await nursery.start(serve_agent, make_config(tmp_path, test_pki, server), sim_plugins())
        await server.apply(replicas=1)
        with trio.fail_after(20):
            ready = await wait_for(lambda: replica_ready(server), "the replica to be ready")
        before = ready["shards"][0]
        groups.append(next(iter(agent.supervisors.values())).engine_child.pgid)

        stopped_at = len(caplog.records)
        await server.stop()
        with trio.fail_after(10):
            await wait_for(
                lambda: any("still unreachable (try 4)" in r.message for r in caplog.records),
                "the agent to fail 4 tries",
            )
        key, observed = next(iter(agent.observed.items()))
        assert observed.state == "ready" and observed.pid == before["pid"] and pid_alive(before["pid"])

        await server.start()
        with trio.fail_after(20):
            after = await wait_for(lambda: replica_ready(server), "the replica to be ready again")
        assert after["shards"][0]["pid"] == before["pid"]
        assert (after["attempt"], after["failures"]) == (ready["attempt"], 0)
        assert list(agent.observed) == [key]
        assert pid_alive(before["pid"])
        with trio.fail_after(10):
            await wait_for(
                lambda: any("reachable again" in r.message for r in caplog.records), "the agent to log it"
            )
        during = caplog.records[stopped_at:]
        outages = [r for r in during if "unreachable" in r.message and r.levelno == logging.WARNING]
        assert len(outages) == 1, [r.message for r in outages]  # once per outage, not once per try
        starts = [r for r in caplog.records if r.message.startswith("starting shard")]
        assert len(starts) == 1 and starts[0].created < outages[0].created

    async def test_certificate_for_another_node_is_refused_and_logged(
        self, server, nursery, tmp_path, test_pki, caplog
    ):
        """An agent with node-x's certificate running as node-1 is refused; it logs the server's words."""
        caplog.set_level(logging.INFO, logger="llmgw.agent")
        config = make_config(tmp_path, test_pki, server, cert_for="node-x")
        await nursery.start(serve_agent, config, sim_plugins())

        def refusal():
            errors = [r for r in caplog.records if r.levelno == logging.ERROR and "refused" in r.message]
            return errors[0] if errors else None

        with trio.fail_after(10):
            record = await wait_for(refusal, "the agent to log the refusal")
        assert "node certificate for 'node-x' cannot sync as node 'node-1'" in record.message
        assert "HTTP 403" in record.message
        assert (await server.get("/v1/admin/nodes"))["nodes"] == []


async def test_a_sync_cut_short_by_a_local_change_is_not_a_sync(nursery, tmp_path, test_pki, caplog):
    """A server takes each sync and never answers; local changes cut the calls short. The agent never says
    it synced, and its last sync stays unknown (a nemesis run: a restarted agent logged "synced" for a call
    a standby never answered, and the node was rightly declared lost 0.1 s later)."""
    received: list[float] = []

    async def never_answers(request: Request) -> Response:
        received.append(trio.current_time())
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    tls = test_pki.server
    context = server_ssl_context(tls.cert_path, tls.key_path, test_pki.ca.cert_path)
    _, port = await nursery.start(HttpServer(never_answers, ssl_context=context).serve, "127.0.0.1", 0)
    config = make_config(tmp_path, test_pki, SimpleNamespace(url=f"https://127.0.0.1:{port}"))
    with caplog.at_level(logging.INFO, logger="llmgw.agent"):
        agent = await nursery.start(serve_agent, config, sim_plugins())
        for calls in range(1, 4):
            with trio.fail_after(10):
                await wait_for(lambda n=calls: len(received) >= n, f"sync call {calls} to reach the server")
            agent.notify()  # a local change: the call in flight is cut short and sent again
    assert not agent.connected.is_set() and agent.last_sync is None
    assert "synced with server" not in caplog.text
