"""Autoscaling on a real cluster: a queue through the gateway adds replicas, a quiet spell stops them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.load import GatewayLoad, gateway_models, routed_cluster
from llmgw.testing.processes import free_port
from llmgw.wire import EventList

#: two seats per replica and 40 tokens a second: 12 clients queue on one replica
PROFILES = """
profiles:
  one:
    engine: sim
    gpus_per_node: 1
    args: ["--time-to-first-token", "0.02", "--tokens-per-second", "40", "--max-num-seqs", "2"]
"""
CATALOG = PROFILES + """
models:
  chat:
    source: {models}/chat
    profile: one
    replicas:
      min: 1
      max: 3
      target: {{waiting_per_replica: 2}}
      scale_down_after: 6
      cooldown: 2
      max_step: 2
"""

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, 2 agents and a gateway; the autoscaled model at its min, ready and routed."""
    with routed_cluster(tmp_path, CATALOG, metrics_port=free_port()) as local:
        yield local


def ready_count(cluster: LocalCluster) -> int:
    """The model's ready replicas, counting none while any is not ready (the count is not settled)."""
    replicas = cluster.replicas().replicas
    return len(replicas) if all(r.state == "ready" for r in replicas) else -1


def server_samples(cluster: LocalCluster, name: str) -> dict[tuple, float]:
    """The server's samples named ``name``: {sorted labels: value}."""
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def assert_chain(events: list[str], first: int, last: int) -> None:
    """``events`` (``chat: A → B: ...``) take the model from ``first`` to ``last`` replicas, step by step."""
    steps = [tuple(int(n) for n in e.split(": ")[1].split(" → ")) for e in events]
    assert steps and steps[0][0] == first and steps[-1][1] == last, events
    assert all(a[1] == b[0] for a, b in zip(steps, steps[1:], strict=False)), events


def autoscale_events(cluster: LocalCluster) -> list[str]:
    """The autoscaler's events, as ``ctl events`` shows them: ``chat: 1 → 3: ...``."""
    events = cluster.client.request("GET", "/v1/admin/events", EventList, params={"limit": "1000"}).events
    return [f"{e.subject}: {e.message}" for e in events if e.kind == "autoscale"]


def test_queue_scales_up_and_quiet_scales_down_without_a_failed_request(cluster):
    """12 clients queue on one replica: it goes to 3 replicas; with 2 clients left the queue empties, and
    after scale_down_after it goes back to 1, the stopped replicas losing no request; both in the events."""
    assert len(cluster.replicas().replicas) == 1
    with GatewayLoad(cluster.gateway_url, 12, max_tokens=16) as heavy:
        cluster.wait(lambda: ready_count(cluster) == 3, "the queue to scale chat to 3 ready replicas", 90)
        heavy.wait_served(24, check=cluster.check)
        target = server_samples(cluster, "llmgw_server_autoscale_target")
        assert target == {(("model", "chat"), ("signal", "waiting_per_replica")): 2}, target
    # one step or two (the queue may still be growing at the first reading): 1 → ... → 3, contiguous
    up = [e for e in autoscale_events(cluster) if " → " in e and "waiting per replica > target 2" in e]
    assert_chain(up, 1, 3)
    with GatewayLoad(cluster.gateway_url, 2, max_tokens=16) as light:
        cluster.wait(lambda: ready_count(cluster) == 1, "the quiet to scale chat back to 1 replica", 90)
        light.wait_served(8, check=cluster.check)
    assert heavy.failures == [] and light.failures == [], heavy.report() + " / " + light.report()
    # one step or two (a window's highest recommendation bounds one step): 3 → ... → 1, contiguous
    down = [e for e in autoscale_events(cluster) if "waiting per replica < target 2 for " in e]
    assert_chain(down, 3, 1)
    listed = cluster.ctl("events")
    assert listed.returncode == 0 and "autoscale" in listed.stdout and "→ 1:" in listed.stdout, listed.stdout
    shown = cluster.ctl("autoscale")
    assert shown.returncode == 0, shown.stderr
    assert "chat: last change" in shown.stdout and down[-1].split(": ", 1)[1] in shown.stdout, shown.stdout
    (status,) = json.loads(cluster.ctl("autoscale", "chat", "-o", "json").stdout)["models"]
    assert (status["replicas"], status["desired"], status["min"], status["max"]) == (1, 1, 1, 3), status
    assert [(s["name"], s["target"]) for s in status["signals"]] == [("waiting_per_replica", 2)], status
    changes = server_samples(cluster, "llmgw_server_autoscale_decisions_total")
    assert changes[(("direction", "up"), ("model", "chat"))] == len(up), changes
    assert changes[(("direction", "down"), ("model", "chat"))] == len(down), changes
    desired = server_samples(cluster, "llmgw_server_replicas_desired")
    assert desired == {(("model", "chat"),): 1}, desired


#: one node of two GPUs: batch (priority 0) can fill it; chat (priority 10) then needs one of them
FULL_FLEET = PROFILES + """
models:
  batch:
    source: {models}/batch
    profile: one
    priority: 0
    replicas: {{min: 1, max: 2, target: {{waiting_per_replica: 2}}, scale_down_after: 120, cooldown: 2}}
"""
CHAT = """
  chat:
    source: {models}/chat
    profile: one
    priority: 10
    replicas: {{min: 1, max: 2, target: {{waiting_per_replica: 2}}, cooldown: 2}}
"""


def test_a_full_fleet_gives_a_lower_priority_replica_to_a_higher_priority_model(tmp_path):
    """batch fills the only node under load; chat (higher priority) is added: batch gives it one replica,
    which stops as a scaled-down one does (batch's load loses no request), and chat serves."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        for name in ("batch", "chat"):
            (tmp_path / "models" / name).mkdir(parents=True)
        local.add_node(1, gpus=2)
        local.start(1)
        local.start_gateway(free_port())
        catalog = FULL_FLEET.format(models=tmp_path / "models")
        local.apply(catalog)
        local.wait(local.all_ready, "batch's first replica to be ready")
        local.wait(lambda: gateway_models(local.gateway_url) == ["batch"], "the gateway to route batch")
        with GatewayLoad(local.gateway_url, 12, models=("batch",), max_tokens=16) as load:
            local.wait(lambda: ready_count(local) == 2, "batch's queue to scale it to both GPUs", 90)
            local.apply(catalog + CHAT.format(models=tmp_path / "models"))
            local.wait(
                lambda: any(r.model == "chat" and r.state == "ready" for r in local.replicas().replicas),
                "chat to get a GPU from batch and be ready",
                90,
            )
            routed = lambda: "chat" in (gateway_models(local.gateway_url) or [])  # noqa: E731
            local.wait(routed, "the gateway to route chat")
            load.wait_served(16, check=local.check)
        assert load.failures == [], load.report()
        events = autoscale_events(local)
        assert "batch: 2 → 1: gives way to chat (priority 10 > 0): the fleet is full" in events, events
        batch = [r for r in local.replicas().replicas if r.model == "batch"]
        assert [r.state for r in batch] == ["ready"], batch
    finally:
        local.stop_all()
