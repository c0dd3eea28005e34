"""End to end: a LoRA adapter from the Hub stand-in, fetched once for 4 nodes, loaded on first use.

Real ``llmgw server``, four agents (the real ``huggingface_hub`` library in them), sim engines and a
gateway. The adapter's files are a valid sim adapter (``make_sim_adapter``) served by the Hub stand-in,
which counts what it serves. The first request for the adapter waits for its load and is answered; the Hub
served the adapter's bytes once for the whole fleet.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import FAST_SIM, catalog_yaml, model, sim_profile
from llmgw.testing.hub import HubStandIn
from llmgw.testing.load import gateway_models
from llmgw.testing.lora import make_sim_adapter
from llmgw.testing.processes import free_port
from llmgw.wire import AdapterList

pytestmark = pytest.mark.timeout(300)

CATALOG = catalog_yaml(
    {"chat": model("hf://acme/tiny-sim@main", replicas=4, adapters={"sql": "hf://acme/sql-lora@main"})},
    one=sim_profile(1, *FAST_SIM, "--lora-load-time", "0.5"),
)


@pytest.fixture
def hub():
    with HubStandIn() as stand_in:
        yield stand_in


def test_a_hub_adapter_is_fetched_once_for_four_nodes_and_loaded_on_first_use(
    tmp_path: Path, hub: HubStandIn
):
    made = make_sim_adapter(tmp_path / "sql")
    sql = {p.name: p.read_bytes() for p in made.iterdir()}
    hub.add_model("acme/tiny-sim", {"config.json": b"{}", "model.safetensors": os.urandom(100_000)})
    hub.add_model("acme/sql-lora", sql)
    cluster = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=8, poll_timeout=1)
    cluster.agent_args = ["--hub-endpoint", hub.endpoint]
    try:
        cluster.start(4)
        cluster.start_gateway(free_port())
        cluster.apply(CATALOG)
        ready = lambda: cluster.all_ready() and len(cluster.replicas().replicas) == 4  # noqa: E731
        cluster.wait(ready, "4 replicas of chat ready", 150)
        cluster.wait(lambda: gateway_models(cluster.gateway_url) == ["chat"], "the gateway to route chat", 30)

        body = {"model": "sql", "messages": [{"role": "user", "content": "select"}], "max_tokens": 4}
        answer = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-llmgw-adapter"] == "miss", "the first request waited for the load"
        replica = answer.headers["x-llmgw-replica"]
        [status] = cluster.client.request("GET", "/v1/admin/adapters", AdapterList).adapters
        assert status.loaded == (replica,) and status.loads == 1

        served = {k: v for k, v in hub.bytes_served.items() if k.startswith("acme/sql-lora/")}
        assert sum(served.values()) == sum(len(data) for data in sql.values()), "hub bytes: 1x the adapter"
        again = httpx.post(f"{cluster.gateway_url}/v1/chat/completions", json=body, timeout=30)
        assert again.status_code == 200 and again.headers["x-llmgw-adapter"] == "hit"
    finally:
        cluster.stop_all()
