"""How fast the gateway follows a replica becoming ready or unready on the real server.

Runs ``llmgw server`` and ``llmgw gateway`` in this process over real mutual
TLS; a node agent is played by this script (sync calls with a node
certificate), so the moment a shard is reported ready or exited is known. For
each of N rounds it reports the replica's shard ready and times until the
gateway routes it, then reports it exited and times until the route is gone
(the server then rebuilds it, and the next round starts). Issue 4's target:
within one second. Prints p50, p90 and max of both, against the server's
long-poll timeout measured in the same run as the baseline a polling gateway
would need.

    .venv/bin/python bench/routes.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import httpx
import trio
from llmgw_engine_sim import SimEngine

from llmgw import pki
from llmgw.models import NodeFacts
from llmgw.server.main import ServerConfig, serve_server
from llmgw.server.state.cluster import Settings
from llmgw.testing import make_gpus
from llmgw.testing.gateway import start_gateway
from llmgw.testing.processes import free_port
from llmgw.wire import ObservedShard, SyncReply, SyncRequest, from_json, to_json

CATALOG = """
profiles:
  one: {engine: sim, gpus_per_node: 1}
models:
  small: {source: tiny/model, profile: one, replicas: 1}
"""
POLL_TIMEOUT = 5.0


async def main(rounds: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-routes-"))
    ca = pki.init_ca(root / "ca")
    server_tls = pki.issue_server(ca, ["127.0.0.1"], out=root / "server")
    node = pki.issue_node(ca, "node-1", out=root / "node")
    admin = pki.issue_admin(ca, "bench", out=root / "admin")
    gateway_tls = pki.issue_gateway(ca, "gw", out=root / "gateway")
    port = free_port()
    config = ServerConfig(
        state_dir=root / "state",
        cert=server_tls.cert_path,
        key=server_tls.key_path,
        ca=ca.cert_path,
        host="127.0.0.1",
        port=port,
        poll_timeout=POLL_TIMEOUT,
        settings=Settings(backoff_base=0.01, backoff_max=0.05),
    )
    url = f"https://127.0.0.1:{port}"
    node_client = httpx.AsyncClient(
        base_url=url, verify=pki.client_ssl_context(node.cert_path, node.key_path, ca.cert_path), timeout=10
    )
    admin_client = httpx.AsyncClient(
        base_url=url, verify=pki.client_ssl_context(admin.cert_path, admin.key_path, ca.cert_path), timeout=10
    )
    engine_port = free_port()
    last: SyncReply | None = None

    async def sync(state: str | None) -> SyncReply:
        nonlocal last
        observed = []
        if state is not None and last is not None:
            observed = [ObservedShard(s.replica_id, s.attempt, s.rank, state) for s in last.shards]
        facts = NodeFacts(
            node_id="node-1",
            agent_version="bench",
            gpus=make_gpus(1),
            engines={"sim": "x"},
            model_sources=["tiny/model"],
        )
        request = SyncRequest(
            node_id="node-1",
            address="127.0.0.1",
            facts=facts,
            port_range=(engine_port, engine_port),
            observed=observed,
            revision=last.revision if last else 0,
            wait=False,
            checked_sources=["tiny/model"],
        )
        response = await node_client.post("/v1/agent/sync", json=to_json(request))
        response.raise_for_status()
        last = from_json(response.json(), SyncReply)
        return last

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_server, config, {"sim": SimEngine()})
        (await admin_client.post("/v1/admin/catalog", json={"text": CATALOG})).raise_for_status()
        gateway, _ = await start_gateway(
            nursery,
            url,
            ca=ca.cert_path,
            cert=gateway_tls.cert_path,
            key=gateway_tls.key_path,
            require_keys=False,
        )

        async def until(routed: bool) -> float:
            start = trio.current_time()
            with trio.fail_after(30):
                # polling at 1 ms is the measurement: it must not wait on the gateway's own events
                while bool(gateway.balancer.replicas("small")) != routed:  # noqa: ASYNC110
                    await trio.sleep(0.001)
            return trio.current_time() - start

        ready, unready = [], []
        for _ in range(rounds):
            with trio.fail_after(30):
                while not (await sync(None)).shards:  # noqa: ASYNC110 - wait out the rebuild backoff
                    await trio.sleep(0.01)
            await sync("ready")
            ready.append(await until(True))
            await sync("exited")
            unready.append(await until(False))
        nursery.cancel_scope.cancel()
    await node_client.aclose()
    await admin_client.aclose()

    def row(name: str, values: list[float]) -> str:
        ordered = sorted(values)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        return (
            f"{name:<22} {statistics.median(values) * 1000:8.1f} {p90 * 1000:8.1f} {max(values) * 1000:8.1f}"
            f" {max(values) / POLL_TIMEOUT:10.3f}"
        )

    print(f"gateway route updates over {rounds} rounds (real server and gateway in one process, mutual TLS)")
    print(f"{'change':<22} {'p50 ms':>8} {'p90 ms':>8} {'max ms':>8} {'max/poll':>10}")
    print(row("replica ready", ready))
    print(row("replica unready", unready))
    print(
        f"baseline: the server's long-poll timeout, {POLL_TIMEOUT:.0f} s, is what a gateway would wait "
        "without the long-poll answering on change; issue 4's target is 1 s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    trio.run(main, parser.parse_args().rounds)
