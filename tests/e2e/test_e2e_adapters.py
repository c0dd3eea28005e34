"""LoRA adapters on a real cluster: loaded on first use, unloaded under pressure, loaded again after a
restart, and a failed load answered with the adapter and the reason while the replica serves the others.

Real ``llmgw server``, two agents running sim engines (``--lora-load-time 0.5``) and a gateway. ``chat``
has two replicas with ``max_adapters: 2`` (four slots in all) and six adapters from local paths: five good
ones (``a`` .. ``e``) and ``broken`` (its directory has no weights: the sim refuses it after its load time).
``solo`` has one replica and one adapter, ``s``: its engine is killed to show a restarted replica loading
its adapter again on demand.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from llmgw.testing.catalogs import FAST_SIM, catalog_yaml, model, sim_profile
from llmgw.testing.load import routed_cluster
from llmgw.testing.lora import make_sim_adapter
from llmgw.wire import AdapterList, EventList

LOAD_TIME = 0.5
GOOD = ("a", "b", "c", "d", "e")

pytestmark = pytest.mark.timeout(400)


def catalog(adapters: Path) -> str:
    """chat (2 replicas, 2 slots each) with a..e and broken; solo (1 replica) with s."""
    profile = sim_profile(1, *FAST_SIM, "--lora-load-time", str(LOAD_TIME), max_adapters=2)
    chat = {name: str(adapters / name) for name in (*GOOD, "broken")}
    return catalog_yaml(
        {
            "chat": model("{models}/chat", replicas=2, adapters=chat),
            "solo": model("{models}/solo", adapters={"s": str(adapters / "s")}),
        },
        one=profile,
    )


@pytest.fixture
def cluster(tmp_path: Path):
    """The cluster with every replica ready and routed; the adapters' directories written first."""
    adapters = tmp_path / "adapters"
    for name in (*GOOD, "s"):
        make_sim_adapter(adapters / name)
    make_sim_adapter(adapters / "broken", weights=False)
    with routed_cluster(tmp_path, catalog(adapters), gateway=["--hold-timeout", "60"]) as local:
        yield local


def ask(url: str, model: str, content: str = "hi") -> tuple[httpx.Response, float]:
    """One chat completion for ``model`` through the gateway, and the seconds it took."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    began = time.monotonic()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=90)
    return response, time.monotonic() - began


def adapters(cluster) -> dict[str, object]:
    """Adapter -> its ``ctl adapters -o json`` entry."""
    data = cluster.client.request("GET", "/v1/admin/adapters", AdapterList)
    return {a.adapter: a for a in data.adapters}


def adapter_events(cluster, kind: str) -> list[str]:
    """The subjects of the events of ``kind`` (``adapter_loaded``...), oldest first."""
    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    return [e.subject for e in events if e.kind == kind]


def test_adapters_load_on_use_unload_under_pressure_and_fail_with_a_reason(cluster):
    url = cluster.gateway_url
    listed = httpx.get(f"{url}/v1/models", timeout=5).json()["data"]
    parents = {m["id"]: m.get("parent") for m in listed}
    assert parents["a"] == "chat" and parents["s"] == "solo" and parents["chat"] is None, listed

    # loaded on first use: the request waits for the load, then the answer comes from the replica loading it
    first, took = ask(url, "a")
    assert first.status_code == 200, first.text
    assert LOAD_TIME <= took < LOAD_TIME + 5, took
    replica = first.headers["x-llmgw-replica"]
    assert adapters(cluster)["a"].loaded == (replica,)
    again, took = ask(url, "chat:a")
    assert again.status_code == 200, again.text
    assert again.headers["x-llmgw-replica"] == replica and took < LOAD_TIME, took
    base, _ = ask(url, "chat")
    assert base.status_code == 200
    text = lambda r: r.json()["choices"][0]["message"]["content"]  # noqa: E731
    assert text(base) != text(first), "the adapter answers, not the base model"

    # pressure: five adapters over four slots; each request is answered, one adapter is unloaded
    for name in GOOD[1:]:
        answer, _ = ask(url, name)
        assert answer.status_code == 200, (name, answer.text)
    shown = adapters(cluster)
    loaded = [name for name in GOOD if shown[name].loaded]
    assert len(loaded) == 4, {n: shown[n].loaded for n in GOOD}
    assert all(len(shown[n].loaded) <= 1 for n in GOOD)
    assert len(adapter_events(cluster, "adapter_unloaded")) == 1
    cluster.wait(lambda: adapters(cluster)["a"].hits >= 1, "the gateway's report of the hit on `a`", 15)

    # a load that fails: the client hears which adapter and why; the replica serves the others
    pids = {s.pid for r in cluster.replicas().replicas for s in r.shards}
    failed, _ = ask(url, "broken")
    assert failed.status_code == 503, failed.text
    error = failed.json()["error"]
    assert "`broken`" in error["message"] and "adapter_model.safetensors" in error["message"], error
    assert error["code"] == "adapter_refused", error
    for name in loaded:
        answer, _ = ask(url, name)
        assert answer.status_code == 200, (name, answer.text)
    assert {s.pid for r in cluster.replicas().replicas for s in r.shards} == pids, "no engine restarted"
    assert adapters(cluster)["broken"].failure.cause == "refused"
    assert "chat/broken" in adapter_events(cluster, "adapter_failed")
    table = cluster.ctl("adapters", "chat")
    assert table.returncode == 0 and "last load failed (refused)" in table.stdout, table.stdout
    listing = json.loads(cluster.ctl("adapters", "-o", "json").stdout)
    assert {a["adapter"] for a in listing["adapters"]} == {*GOOD, "broken", "s"}


def test_a_restarted_replica_loads_its_adapter_again_on_demand(cluster):
    url = cluster.gateway_url
    first, _ = ask(url, "s")
    assert first.status_code == 200, first.text
    [solo] = [r for r in cluster.replicas().replicas if r.model == "solo"]
    assert adapters(cluster)["s"].loaded == (solo.id,)

    os.kill(solo.shards[0].pid, signal.SIGKILL)  # the engine dies: the replica is rebuilt, empty

    def rebuilt() -> bool:
        [now] = [r for r in cluster.replicas().replicas if r.model == "solo"] or [None]
        return now is not None and now.state == "ready" and now.attempt != solo.attempt

    cluster.wait(rebuilt, "solo to be ready again on a new attempt", 90)
    cluster.wait(lambda: adapters(cluster)["s"].loaded == (), "`s` out of the routes", 15)
    again, took = ask(url, "s")
    assert again.status_code == 200, again.text
    assert took >= LOAD_TIME, "loaded again, on demand"
    assert adapter_events(cluster, "adapter_loaded").count("solo/s") == 2


def test_an_agent_restarted_under_a_loaded_adapter_serves_it_without_a_failed_load(cluster):
    """kill -9 of the agent of solo's node: the next agent adopts the running engine, which still holds
    ``s`` from the agent before. The server asks for ``s`` again; the engine would refuse a second load of
    a name it holds (vLLM's 400 "already loaded"), so the agent unloads it first and loads it anew:
    ``s`` serves, and no load of it failed."""
    url = cluster.gateway_url
    first, _ = ask(url, "s")
    assert first.status_code == 200, first.text
    [solo] = [r for r in cluster.replicas().replicas if r.model == "solo"]
    node = cluster.nodes[solo.shards[0].node]
    assert node.process is not None
    cluster.stop(node.process, signal.SIGKILL)
    cluster.start_agent(node)

    def reported() -> bool:  # the new agent's load of `s` ended, one way or the other
        ended = adapter_events(cluster, "adapter_loaded") + adapter_events(cluster, "adapter_failed")
        return ended.count("solo/s") >= 2

    cluster.wait(reported, "the new agent to load `s` on the adopted engine", 60)
    cluster.wait(lambda: adapters(cluster)["s"].loaded == (solo.id,), "`s` in the routes", 15)
    [now] = [r for r in cluster.replicas().replicas if r.model == "solo"]
    assert (now.attempt, now.shards[0].pid) == (solo.attempt, solo.shards[0].pid), "the engine was adopted"
    again, _ = ask(url, "s")
    assert again.status_code == 200, again.text
    assert "solo/s" not in adapter_events(cluster, "adapter_failed")
