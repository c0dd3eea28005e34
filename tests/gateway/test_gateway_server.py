"""The gateway against the real control plane: routes over mutual TLS with a gateway certificate.

Agents are played by the test (sync calls with node certificates) so that
the moment a replica becomes ready or unready is known exactly; the engines
are real ``llmgw-sim`` processes on the ports the server assigned.
"""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
import trio
from llmgw_engine_sim import SimEngine

from llmgw.server.main import ServerConfig, serve_server
from llmgw.server.state.cluster import Settings
from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.testing.gateway import start_gateway, start_sim, wait_healthy
from llmgw.testing.nodes import sim_node_sync
from llmgw.testing.processes import free_port, processes, wait_for  # noqa: F401
from llmgw.wire import ObservedShard, SyncReply, from_json, to_json


class Cluster:
    """A real server (restartable on its port and state) and the test's hand-played agents."""

    def __init__(self, nursery: trio.Nursery, test_pki, tmp_path) -> None:
        self.nursery = nursery
        self.pki = test_pki
        self.config = ServerConfig(
            state_dir=tmp_path / "state",
            cert=test_pki.server.cert_path,
            key=test_pki.server.key_path,
            ca=test_pki.ca.cert_path,
            host="127.0.0.1",
            port=free_port(),
            settings=Settings(lost_after=60),
        )
        self.url = f"https://127.0.0.1:{self.config.port}"
        self.scope: trio.CancelScope | None = None
        #: node id -> (its one port, its last reply)
        self.nodes: dict[str, tuple[int, SyncReply | None]] = {}

    async def start(self) -> None:
        """Start (or restart) the server; returns once it listens and has loaded its state."""
        self.scope = trio.CancelScope()
        scope, loaded = self.scope, trio.Event()

        async def run(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await serve_server(self.config, {"sim": SimEngine()}, loaded=loaded, task_status=task_status)

        await self.nursery.start(run)
        with trio.fail_after(10):
            await loaded.wait()

    def stop(self) -> None:
        """Take the server down (connections refused until :meth:`start`)."""
        self.scope.cancel()

    def client(self, role: str, name: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, verify=self.pki.context(role, name), timeout=10)

    async def apply(self, replicas: int) -> None:
        async with self.client("admin", "ops") as admin:
            text = catalog_yaml({"small": model("tiny/model", replicas=replicas)})
            response = await admin.post("/v1/admin/catalog", json={"text": text})
            assert response.status_code == 200, response.text

    async def sync(self, node_id: str, state: str | None = None, *, wait: bool = False) -> SyncReply:
        """Sync as ``node_id``'s agent, reporting its shards in ``state`` (None: none running).

        ``wait``: long-poll, as agents do, until what the node should run changes.
        """
        port, last = self.nodes.setdefault(node_id, (free_port(), None))
        observed = []
        if state is not None and last is not None:
            observed = [
                ObservedShard(s.replica_id, s.attempt, s.rank, state, port=s.spec.port) for s in last.shards
            ]
        revision = last.revision if last else 0
        request = sim_node_sync(
            node_id,
            gpus=1,
            address="127.0.0.1",
            port_range=(port, port),
            observed=observed,
            revision=revision,
            wait=wait,
        )
        async with self.client("node", node_id) as node:
            with trio.fail_after(10):
                response = await node.post("/v1/agent/sync", json=to_json(request))
            assert response.status_code == 200, response.text
        reply = from_json(response.json(), SyncReply)
        self.nodes[node_id] = (port, reply)
        return reply

    async def run_replica(self, processes, node_id: str) -> str:  # noqa: F811
        """Sync ``node_id``, start the sim its shard asks for; return the replica id (not reported yet)."""
        reply = await self.sync(node_id)
        if not reply.shards:  # registered just now: the reconciler places the replica, then wakes the poll
            reply = await self.sync(node_id, wait=True)
        (shard,) = reply.shards
        sim = start_sim(processes, model="small", port=shard.spec.port)
        with trio.fail_after(10):
            await wait_healthy([sim.url])
        return shard.replica_id


@pytest.fixture
async def cluster(nursery, test_pki, tmp_path) -> Cluster:
    cluster = Cluster(nursery, test_pki, tmp_path)
    await cluster.start()
    return cluster


async def gateway_for(nursery, cluster: Cluster, role: str = "gateway", name: str = "gw-1"):
    issued = cluster.pki.client(role, name)
    return await start_gateway(
        nursery,
        cluster.url,
        ca=cluster.pki.ca.cert_path,
        cert=issued.cert_path,
        key=issued.key_path,
        require_keys=False,
        routes_retry_interval=0.1,
    )


async def status_of(url: str) -> int:
    async with httpx.AsyncClient(base_url=url) as http:
        body = {"model": "small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return (await http.post("/v1/chat/completions", json=body)).status_code


async def test_gateway_follows_ready_replicas_of_the_real_server(nursery, cluster, processes):  # noqa: F811
    """Gateway certificate: a replica reported ready is routed; reported unready, its model answers 503."""
    await cluster.apply(replicas=1)
    gateway, url = await gateway_for(nursery, cluster)
    assert await status_of(url) == 503  # in the catalog, nothing ready
    replica = await cluster.run_replica(processes, "node-1")

    await cluster.sync("node-1", "ready")
    with trio.fail_after(5.0):
        await wait_for(lambda: len(gateway.balancer.replicas("small")) == 1, "the route to appear")
    assert await status_of(url) == 200

    def use() -> list[str]:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        chunks = api.chat.completions.create(
            model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]

    assert len(await trio.to_thread.run_sync(use)) == 3

    _, second = await gateway_for(nursery, cluster, "admin", "ops")  # several gateways, one server
    async with httpx.AsyncClient(base_url=second) as http:
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["small"]

    await cluster.sync("node-1", "exited")
    with trio.fail_after(5.0):
        await wait_for(lambda: not gateway.balancer.replicas("small"), "the route to go")
    assert await status_of(url) == 503
    assert replica == "small-0"


async def test_server_outage_keeps_routes_and_new_replicas_follow(nursery, cluster, processes, caplog):  # noqa: F811
    """Server down: the gateway serves from its last routes; back: a new replica is routed."""
    caplog.set_level(logging.INFO, logger="llmgw.gateway")
    await cluster.apply(replicas=1)
    gateway, url = await gateway_for(nursery, cluster)
    await cluster.run_replica(processes, "node-1")
    await cluster.sync("node-1", "ready")
    with trio.fail_after(5.0):
        await wait_for(lambda: gateway.balancer.replicas("small"), "the first route")

    cluster.stop()
    with trio.fail_after(5):
        await wait_for(lambda: not gateway.watcher.up, "the gateway to notice the outage")
    assert [await status_of(url) for _ in range(5)] == [200] * 5
    assert sum("cannot read routes" in r.getMessage() for r in caplog.records) == 1

    await cluster.start()
    await cluster.apply(replicas=2)
    await cluster.sync("node-1", "ready")
    await cluster.run_replica(processes, "node-2")
    await cluster.sync("node-2", "ready")
    with trio.fail_after(5.0):
        await wait_for(
            lambda: len(gateway.balancer.replicas("small")) == 2, "the new replica after the outage"
        )
    assert gateway.watcher.up


async def test_node_certificate_cannot_read_routes(nursery, cluster, caplog):
    """A gateway given a node certificate gets no routes; its log says the server refused it."""
    caplog.set_level(logging.INFO, logger="llmgw.gateway")
    from llmgw.gateway import Gateway, GatewayConfig

    issued = cluster.pki.client("node", "node-9")
    gateway = Gateway(
        GatewayConfig(
            server=cluster.url,
            ca=cluster.pki.ca.cert_path,
            cert=issued.cert_path,
            key=issued.key_path,
            host="127.0.0.1",
            port=0,
        )
    )
    host, port = await nursery.start(gateway.serve)
    with trio.fail_after(5):
        await wait_for(
            lambda: any("answered 403" in r.getMessage() for r in caplog.records), "the refusal in the log"
        )
    async with httpx.AsyncClient() as http:
        health = await http.get(f"http://{host}:{port}/health")
    assert health.status_code == 503
