"""An engine out of GPU memory: the agent reads it in the engine's log, the server counts and says ``oom``."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.load import routed_cluster
from llmgw.testing.processes import free_port
from llmgw.wire import EventList

pytestmark = pytest.mark.timeout(180)

OOM_CATALOG = catalog_yaml(
    {"chat": model("{models}/chat", replicas=1)}, one=sim_profile(1, "--oom-after-requests", "1")
)

BODY = {"model": "chat", "messages": [{"role": "user", "content": "one too many"}], "max_tokens": 4}


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the series ``name{labels}`` in a scrape (0 when it is not there)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_engine_out_of_gpu_memory_is_counted_as_oom(tmp_path: Path):
    """The sim dies as vLLM does when CUDA runs out of memory: the agent reports the shard with cause
    ``oom`` (its log says so, whichever of exit, health check or canary noticed first); the server
    fails the replica and both count the failure under ``cause="oom"``, under no other cause."""
    with routed_cluster(tmp_path, OOM_CATALOG, nodes=1, metrics_port=free_port()) as cluster:
        server = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
        node = next(iter(cluster.nodes.values()))
        agent = f"http://{node.address}:{cluster.metrics_port + 1}/metrics"
        with httpx.Client(timeout=30) as http:
            # the engine dies after its first answer (the agent's liveness canary may be the one)
            http.post(f"{cluster.gateway_url}/v1/chat/completions", json=BODY)

            def failed() -> list:
                events = cluster.client.request("GET", "/v1/admin/events", EventList).events
                return [e for e in events if e.subject == "chat-0" and e.message.startswith("failed: ")]

            cluster.wait(failed, "the replica's failure event", 60)
            # rebuilt, it may run out of memory again: every failure is counted oom, none under another cause
            others = ("exited", "unhealthy", "hung")
            scraped = cluster.wait(
                lambda: (text := http.get(server).text)
                and sample(text, "llmgw_server_replica_failures_total", model="chat", cause="oom") >= 1
                and text,
                "the server to count the failure as oom",
                30,
            )
            for cause in others:
                assert sample(scraped, "llmgw_server_replica_failures_total", model="chat", cause=cause) == 0
            agent_text = http.get(agent).text
            assert sample(agent_text, "llmgw_agent_shard_failures_total", model="chat", cause="oom") >= 1
            for cause in others:
                assert sample(agent_text, "llmgw_agent_shard_failures_total", model="chat", cause=cause) == 0
