"""Every process of a running cluster is scraped: names pass promtool, and deploy/ reads only what exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from llmgw.testing.catalogs import CHAT_CATALOG
from llmgw.testing.load import routed_cluster
from llmgw.testing.metrics import deployed_names, exported_names, promtool_check_metrics
from llmgw.testing.processes import free_port

pytestmark = pytest.mark.timeout(180)

#: names deploy/ reads that this cluster cannot export, and why
NOT_HERE = {
    "up": "Prometheus' own series, one per target",
    "llmgw_server_leader_epoch": "exported by servers on PostgreSQL (--store) only",
}
BODY = {"model": "chat", "messages": [{"role": "user", "content": "how are the metrics"}], "max_tokens": 4}


@pytest.fixture
def cluster(tmp_path: Path):
    """Server and 2 agents with --metrics-listen, a gateway; a two-replica model ready and routed."""
    with routed_cluster(tmp_path, CHAT_CATALOG, metrics_port=free_port()) as local:
        yield local


def test_scraped_names_pass_promtool_and_cover_the_dashboard_and_alerts(cluster):
    """Server, agents, gateway and engines (found via /sd/engines) export every name deploy/ reads.

    Then the server stops: the gateway's /health says ``degraded`` (503), and it still serves.
    """
    gateway = cluster.gateway_url
    server = f"http://127.0.0.1:{cluster.metrics_port}"
    with httpx.Client(timeout=30) as http:
        answer = http.post(f"{gateway}/v1/chat/completions", json=BODY)
        assert answer.status_code == 200
        # 40 tokens at 400 a second: the stream comes in many chunks, whose gaps are inter-token latencies
        stream = {**BODY, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", f"{gateway}/v1/chat/completions", json=stream) as streamed:
            assert streamed.status_code == 200
            events = [
                line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: {")
            ]
        tokens = (
            answer.json()["usage"]["completion_tokens"] + json.loads(events[-1])["usage"]["completion_tokens"]
        )
        scraped = {
            "server": http.get(f"{server}/metrics").text,
            "gateway": http.get(f"{gateway}/metrics").text,
        }
        for node in cluster.nodes.values():
            scraped[f"agent {node.node_id}"] = http.get(
                f"http://{node.address}:{cluster.metrics_port + 1}/metrics"
            ).text
        targets = http.get(f"{server}/sd/engines").json()
        assert sorted(g["labels"]["replica"] for g in targets) == ["chat-0", "chat-1"]
        for group in targets:
            scraped[f"engine {group['labels']['replica']}"] = http.get(
                f"http://{group['targets'][0]}/metrics"
            ).text
        healths = {
            "server": http.get(f"{server}/health"),
            "gateway": http.get(f"{gateway}/health"),
            **{
                n.node_id: http.get(f"http://{n.address}:{cluster.metrics_port + 1}/health")
                for n in cluster.nodes.values()
            },
        }
    for what, text in scraped.items():
        assert promtool_check_metrics(text, allow_colons=what.startswith("engine")) == [], what
    for what, health in healths.items():
        assert health.status_code == 200 and health.json()["status"] == "ok", (what, health.text)
    exported = set().union(*(exported_names(text) for text in scraped.values()))
    missing = {name: sorted(where) for name, where in deployed_names().items() if name not in exported}
    assert set(missing) <= set(NOT_HERE), f"read by deploy/ but exported by no process: {missing}"
    assert (
        f'llmgw_gateway_completion_tokens_total{{key="(none)",model="chat"}} {tokens:.1f}'
        in scraped["gateway"]
    )
    gaps = re.search(
        r'llmgw_gateway_inter_token_latency_seconds_count\{model="chat"\} ([0-9.]+)', scraped["gateway"]
    )
    assert gaps and float(gaps.group(1)) >= 1

    # the server goes: the gateway's /health is 503 "degraded" while it still serves its last routes
    cluster.stop(cluster.server)

    def degraded() -> httpx.Response | None:
        health = httpx.get(f"{gateway}/health", timeout=5)
        return health if health.status_code == 503 else None

    health = cluster.wait(degraded, "the gateway's /health to say the routes feed is down", 30)
    assert health.json()["status"] == "degraded"
    assert "has not answered for" in health.json()["problems"][0]
    assert httpx.post(f"{gateway}/v1/chat/completions", json=BODY, timeout=30).status_code == 200
