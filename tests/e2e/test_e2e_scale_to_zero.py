"""Scale-to-zero on a real cluster: an idle model stops its replica, a request wakes it and waits for it.

Real ``llmgw server``, two agents running sim engines and a gateway. The model's
files are a seed on node-1 only; its ``replicas.min`` is 0 and ``idle_after`` 3 s.
Applied, it stays at zero (no request yet) and is listed by the gateway. Requests
sent while it sleeps are held by the gateway and all answered once a replica is
ready on node-1 (the node that holds the files: nothing is copied); 3 s after the
last request the replica stops; the next request wakes it again.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.load import gateway_models
from llmgw.testing.processes import free_port
from llmgw.wire import EventList

#: chat at zero replicas until asked for, and again after 3 s without a request
CHAT = model(
    "seed:///data/chat", idle_after=3, replicas={"min": 0, "max": 1, "target": {"waiting_per_replica": 4}}
)
CATALOG = catalog_yaml(
    {"chat": CHAT}, one=sim_profile(1, "--time-to-first-token", "0.02", "--tokens-per-second", "200")
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, node-1 (holding the model's files) and node-2, a gateway holding requests up to 90 s."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        local.add_node(1).seed("data/chat", {"weights.bin": 1_000_000})
        local.start(2)
        local.start_gateway(free_port(), extra=["--hold-timeout", "90"])
        yield local
    finally:
        local.stop_all()


def ask(url: str) -> httpx.Response:
    """One chat completion through the gateway (held as long as it takes)."""
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def autoscale_events(cluster: LocalCluster) -> list[str]:
    """The autoscaler's events about ``chat``, oldest first."""
    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    return [e.message for e in events if e.kind == "autoscale" and e.subject == "chat"]


def test_an_idle_model_sleeps_and_a_request_wakes_it(cluster):
    cluster.apply(CATALOG)
    cluster.wait(
        lambda: gateway_models(cluster.gateway_url) == ["chat"], "the gateway to list chat at zero", 30
    )
    assert cluster.replicas().replicas == (), "no request yet: no replica"

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, [cluster.gateway_url] * 4))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    [replica] = cluster.replicas().replicas
    assert [s.node for s in replica.shards] == ["node-1"], "placed where the files are"
    woken = autoscale_events(cluster)
    assert woken and woken[0].startswith("0 → 1: woken"), woken
    shown = cluster.ctl("autoscale").stdout
    assert "chat: last request" in shown and "to zero after 3 s idle" in shown, shown

    cluster.wait(lambda: cluster.replicas().replicas == (), "the idle replica to stop", 60)
    events = autoscale_events(cluster)
    assert events[-1].startswith("1 → 0: idle: no request for"), events
    assert gateway_models(cluster.gateway_url) == ["chat"], "listed while asleep"

    again = ask(cluster.gateway_url)
    assert again.status_code == 200, again.text
    [replica] = cluster.replicas().replicas
    assert [s.node for s in replica.shards] == ["node-1"]
    events = autoscale_events(cluster)
    kinds = [e.split(":")[0] for e in events]
    # woken, asleep, woken again; a machine so loaded that a step took over idle_after (3 s) may add a
    # sleep and a wake, which must still alternate
    assert kinds[:3] == ["0 → 1", "1 → 0", "0 → 1"], events
    assert set(kinds) == {"0 → 1", "1 → 0"} and all(a != b for a, b in itertools.pairwise(kinds)), events
    copies = (
        list((cluster.nodes["node-2"].models_dir).iterdir())
        if cluster.nodes["node-2"].models_dir.exists()
        else []
    )
    assert not [p for p in copies if not p.name.startswith(".")], "node-2 fetched nothing"
