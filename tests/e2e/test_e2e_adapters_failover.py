"""LoRA adapters across a failover: two servers on PostgreSQL, a gateway that reads its routes from the
standby, an adapter loaded, the leader killed (SIGKILL). The standby routes the adapter before it leads,
and after it takes over the adapter stays loaded on its replica: no second load, no unload, no failure.

One node runs ``chat`` (one replica, ``max_adapters: 2``) on a sim that takes ``LOAD_TIME`` to load an
adapter: a request served in less than that was served from a loaded adapter.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from llmgw.ctl.client import AdminClient, ClientConfig
from llmgw.dev.cluster import LocalCluster
from llmgw.errors import LlmgwError
from llmgw.testing.catalogs import FAST_SIM, catalog_yaml, model, sim_profile
from llmgw.testing.load import routed_cluster
from llmgw.testing.lora import make_sim_adapter
from llmgw.testing.processes import free_port
from llmgw.wire import AdapterList, EventList, NodeList

T = TypeVar("T")

LOAD_TIME = 2.0
#: seconds a gateway holds a request for an adapter no replica has loaded (before it fails it)
HOLD = 20

pytestmark = pytest.mark.timeout(300)


def ask(url: str, name: str) -> tuple[httpx.Response, float]:
    """One chat completion for ``name`` through the gateway at ``url``, and the seconds it took."""
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    began = time.monotonic()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=HOLD + 30)
    return response, time.monotonic() - began


def sim_counts(local: LocalCluster) -> dict[str, float]:
    """The sim's adapter counters on chat's engine: loads that succeeded, unloads, adapters loaded now."""
    [replica] = local.replicas().replicas
    shard = replica.shards[0]
    text = httpx.get(f"http://{local.nodes[shard.node].address}:{shard.port}/metrics", timeout=5).text

    def value(pattern: str) -> float:
        found = re.search(rf"^{pattern} ([0-9.e+]+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    return {
        "loads": value(r'sim:lora_loads_total\{result="loaded"\}'),
        "unloads": value(r"sim:lora_unloads_total"),
        "loaded": value(r'sim:lora_loaded\{lora_name="a"\}'),
    }


def read(local: LocalCluster, what: Callable[[], T]) -> T:
    """``what()``, asked again while the servers answer with an error (a leader loading its state after a
    lease change: on a loaded machine a new leader may miss a renewal and take its lease again)."""
    return local.wait(lambda: (what(),), "the leader to answer", 30)[0]


def standby_answers(standby: AdminClient) -> bool:
    """Whether the server of ``standby`` (its only one) answers reads."""
    try:
        return standby.request("GET", "/v1/admin/nodes", NodeList) is not None
    except LlmgwError:
        return False


def loaded_on(local: LocalCluster) -> tuple[str, ...]:
    """The replicas the (current leader's) book says have adapter `a` loaded."""
    listing = local.client.request("GET", "/v1/admin/adapters", AdapterList)
    return next(a.loaded for a in listing.adapters if a.adapter == "a")


def events(local: LocalCluster, kind: str, subject: str | None = None) -> list[str]:
    """The messages of the stored events of ``kind`` (about ``subject``), oldest first."""
    found = local.client.request("GET", "/v1/admin/events", EventList).events
    return [e.message for e in found if e.kind == kind and subject in (None, e.subject)]


def catalog(root: Path) -> str:
    """chat (one replica, two slots) with adapter `a`, whose directory is written under ``root``."""
    make_sim_adapter(root / "adapters" / "a")
    (root / "models" / "chat").mkdir(parents=True, exist_ok=True)
    profile = sim_profile(1, *FAST_SIM, "--lora-load-time", str(LOAD_TIME), max_adapters=2)
    return catalog_yaml(
        {"chat": model(str(root / "models" / "chat"), adapters={"a": str(root / "adapters" / "a")})},
        one=profile,
    )


def heard_again(local: LocalCluster) -> None:
    """Wait until the agent, its shard adopted by the server now leading, synced with it again more than
    a second later: it has heard that server's answers (and acted on them)."""
    adopted = time.monotonic()

    def answered() -> bool:
        [node] = local.client.request("GET", "/v1/admin/nodes", NodeList).nodes
        return node.last_sync_ago < time.monotonic() - adopted - 1.0

    local.wait(answered, "the agent to sync with the new leader again", 30)


def test_an_adapter_stays_loaded_and_routed_across_a_failover(tmp_path: Path, pg_url: str):
    """Loaded through a gateway on the standby; kill -9 the leader; the standby leads: `a` is served from
    the same engine with no second load and no unload, and no request failed."""
    text = catalog(tmp_path)
    port_a, port_b = free_port(), free_port()
    local = LocalCluster(tmp_path / "cluster", server_port=port_a, lost_after=4, poll_timeout=1, store=pg_url)
    url_a, url_b = f"https://127.0.0.1:{port_a}", f"https://127.0.0.1:{port_b}"
    local.server_url = f"{url_a},{url_b}"  # the admin client and the agent know both servers, A first
    try:
        local.start_server()
        local.wait(lambda: local.client.request("GET", "/v1/admin/nodes") is not None, "server A to lead")
        local.start_server(port=port_b, name="server-b")
        config = ClientConfig(url_b, local.ca.cert_path, local.admin_tls.cert_path, local.admin_tls.key_path)
        standby = AdminClient(config)
        local.wait(lambda: standby_answers(standby), "server B to answer as a standby", 30)
        local.start_agent(local.add_node(1))
        local.server_url = f"{url_b},{url_a}"  # the gateway reads its routes from the standby first
        local.start_gateway(free_port(), extra=["--hold-timeout", str(HOLD)])
        local.server_url = f"{url_a},{url_b}"
        local.apply(text)
        local.wait(local.all_ready, "chat to be ready")
        [replica] = local.replicas().replicas

        def routed() -> bool:
            try:
                listed = httpx.get(f"{local.gateway_url}/v1/models", timeout=2).json()["data"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return {"chat", "a"} <= {m["id"] for m in listed}

        local.wait(routed, "the gateway to list chat and a", 30)

        # loaded on first use: the request waits for the load; the standby's feed then routes `a`
        first, took = ask(local.gateway_url, "a")
        assert first.status_code == 200, first.text
        assert took >= LOAD_TIME, took
        assert read(local, lambda: loaded_on(local)) == (replica.id,)
        again, took = ask(local.gateway_url, "a")
        assert again.status_code == 200, again.text
        assert took < LOAD_TIME, f"served from the loaded adapter through the standby's routes ({took:.2f} s)"
        before = read(local, lambda: sim_counts(local))
        assert before == {"loads": 1, "unloads": 0, "loaded": 1}, before

        local.stop(local.server, signal.SIGKILL)
        local.wait(lambda: events(local, "leader", url_b), "server B to lead", 30)
        local.wait(local.all_adopted, "the agent to report its shard to server B", 60)
        heard_again(local)
        where = read(local, lambda: loaded_on(local))
        assert where == (replica.id,), f"server B routes `a` where it was loaded, not on {where}"
        after, took = ask(local.gateway_url, "a")
        assert after.status_code == 200, after.text
        assert took < LOAD_TIME, f"`a` was loaded again after the failover ({took:.2f} s)"
        assert after.headers["x-llmgw-replica"] == replica.id
        counts = read(local, lambda: sim_counts(local))
        assert counts == before, f"the engine unloaded or loaded `a` again: {counts}"
        loaded = read(local, lambda: events(local, "adapter_loaded", "chat/a"))
        assert len(loaded) == 1, loaded
        assert read(local, lambda: events(local, "adapter_unloaded")) == []
        [now] = read(local, local.replicas).replicas
        assert (now.attempt, now.shards[0].pid) == (replica.attempt, replica.shards[0].pid), "no restart"
    finally:
        local.stop_all()


def test_an_adapter_stays_loaded_across_a_restart_of_a_sqlite_server(tmp_path: Path):
    """kill -9 of the one server (sqlite) and a new one on its state: `a` is served at once from the same
    engine, with no second load and no unload."""
    with routed_cluster(tmp_path, catalog(tmp_path), gateway=["--hold-timeout", str(HOLD)], nodes=1) as local:
        [replica] = local.replicas().replicas
        first, took = ask(local.gateway_url, "a")
        assert first.status_code == 200 and took >= LOAD_TIME, (first.text, took)
        before = read(local, lambda: sim_counts(local))
        assert before == {"loads": 1, "unloads": 0, "loaded": 1}, before

        local.stop(local.server, signal.SIGKILL)
        local.start_server()
        local.wait(local.all_adopted, "the agent to report its shard to the new server", 60)
        heard_again(local)
        assert read(local, lambda: loaded_on(local)) == (replica.id,)
        after, took = ask(local.gateway_url, "a")
        assert after.status_code == 200, after.text
        assert took < LOAD_TIME, f"`a` was loaded again after the restart ({took:.2f} s)"
        counts = read(local, lambda: sim_counts(local))
        assert counts == before, f"the engine unloaded or loaded `a` again: {counts}"
        assert read(local, lambda: events(local, "adapter_unloaded")) == []
