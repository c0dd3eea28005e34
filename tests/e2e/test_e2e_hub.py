"""End to end: an ``hf://`` model is downloaded from the Hub once per fleet, then copied node to node.

Real ``llmgw server`` and ``llmgw agent`` processes on 127.0.0.x, the real
``huggingface_hub`` library in the agents, and the Hub stand-in
(:mod:`llmgw.testing.hub`, a real HTTP server in this process) counting what
it serves.
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.testing.hub import HubStandIn, hub_cluster, hub_downloader
from llmgw.testing.processes import free_port
from llmgw.weights import file_sha256
from llmgw.wire import EventList

pytestmark = pytest.mark.timeout(300)

#: a few MB: two LFS weight files (sha256 from the Hub) and two small files hashed by the downloading node
FILES = {
    "model-00001-of-00002.safetensors": 4_000_000,
    "model-00002-of-00002.safetensors": 4_000_000,
    "tokenizer.json": 300_000,
    "config.json": 200,
    "original/params.json": 100,
}

CATALOG = catalog_yaml({"tiny": model("hf://acme/tiny-sim@main", replicas=4)})


def copy_of(cluster: LocalCluster, node: str) -> Path:
    """The one copy in ``node``'s models directory."""
    [copy] = [p for p in cluster.nodes[node].models_dir.iterdir() if not p.name.startswith(".")]
    return copy


def shards(cluster: LocalCluster):
    return [s for r in cluster.replicas().replicas for s in r.shards]


@pytest.fixture
def hub():
    with HubStandIn() as stand_in:
        yield stand_in


def test_hub_serves_each_file_once_and_the_fleet_copies_the_rest(tmp_path: Path, hub: HubStandIn):
    """4 replicas on 4 nodes: the stand-in served each file exactly once; every copy matches; served."""
    contents = {name: os.urandom(size) for name, size in FILES.items()}
    commit = hub.add_model("acme/tiny-sim", contents)
    cluster = hub_cluster(tmp_path, hub, 4, lost_after=8)
    try:
        cluster.apply(CATALOG)
        seen: set[str] = set()

        def ready() -> bool:
            seen.update(s.detail or "" for s in shards(cluster) if s.state == "staging")
            return len(cluster.replicas().replicas) == 4 and cluster.all_ready()

        cluster.wait(ready, "4 replicas ready", 120)
        assert sorted(s.node for s in shards(cluster)) == ["node-1", "node-2", "node-3", "node-4"]
        assert dict(hub.downloads) == {f"acme/tiny-sim/{name}": 1 for name in FILES}
        assert dict(hub.bytes_served) == {f"acme/tiny-sim/{name}": size for name, size in FILES.items()}
        assert hub.cdn_authorizations == []
        for shard in shards(cluster):
            copy = copy_of(cluster, shard.node)
            held = {p.relative_to(copy).as_posix(): file_sha256(p) for p in copy.rglob("*") if p.is_file()}
            assert held == {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()}
            assert str(copy) in shard.argv, "the engine should be given the node's own copy"
            assert shard.env.get("HF_HUB_OFFLINE") == "1"
        assert any("from the hub" in line for line in seen), seen
        events = cluster.client.request("GET", "/v1/admin/events", EventList).events
        assert any(f"revision pinned to commit {commit}" in e.message for e in events)

        port = free_port()
        cluster.start_gateway(port)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

        def answered() -> bool:
            try:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                return httpx.post(url, json=body, timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        cluster.wait(answered, "a chat completion through the gateway", 30)
    finally:
        cluster.stop_all()


def one_node(tmp_path: Path, hub: HubStandIn, *extra: str) -> LocalCluster:
    cluster = hub_cluster(tmp_path, hub, 1, lost_after=8, agent_args=extra)
    cluster.apply(catalog_yaml({"tiny": model("hf://acme/tiny-sim@main", replicas=1)}))
    return cluster


def detail(cluster: LocalCluster) -> str:
    return " ".join(s.detail or "" for s in shards(cluster) if s.state == "staging")


def test_hub_errors_are_the_reason_on_the_replica_until_the_hub_answers(tmp_path: Path, hub: HubStandIn):
    """401 names the token setting, 404 the repo, 429 when to retry; then the download goes through."""
    hub.add_model("acme/tiny-sim", {"config.json": b"{}", "model.safetensors": os.urandom(2_000_000)})
    hub.token = "the-right-token"
    cluster = one_node(tmp_path, hub)
    try:
        reason = cluster.wait(lambda: "401" in detail(cluster) and detail(cluster), "a 401 reason", 60)
        assert "token is missing or wrong" in reason and "--hub-token-file" in reason, reason
        assert "the-right-token" not in (cluster.logs / "agent-node-1.log").read_text()
        shown = cluster.ctl("replicas").stdout
        assert "staging (the hub at" in shown and "401 Unauthorized" in shown, shown
        hub.token, hub.fail = None, 404
        reason = cluster.wait(lambda: "404" in detail(cluster) and detail(cluster), "a 404 reason", 30)
        assert "no model repo acme/tiny-sim" in reason, reason
        hub.fail, hub.retry_after = 429, 3
        reason = cluster.wait(lambda: "429" in detail(cluster) and detail(cluster), "a 429 reason", 30)
        assert "rate limited" in reason and "retry after 3 s" in reason, reason
        def codes() -> set[str]:  # events reach the store at the reconciler's next flush
            events = cluster.client.request("GET", "/v1/admin/events", EventList).events
            found = {code for code in ("401", "404", "429") if any(code in e.message for e in events)}
            return found if found == {"401", "404", "429"} else set()

        cluster.wait(codes, "the 401, 404 and 429 events in ctl events", 15)
        hub.fail = None
        cluster.wait(cluster.all_ready, "the replica ready once the hub answers", 60)
    finally:
        cluster.stop_all()


def test_an_agent_restart_resumes_the_hub_download(tmp_path: Path, hub: HubStandIn):
    """The agent killed mid-download: restarted, it asks only for the bytes it lacks (Range)."""
    size = 30_000_000
    hub.add_model("acme/tiny-sim", {"config.json": b"{}", "model.safetensors": os.urandom(size)})
    hub.rate = 6_000_000
    cluster = one_node(tmp_path, hub)
    try:
        node = cluster.nodes["node-1"]

        def partial_bytes() -> int:
            found = list(node.models_dir.glob("*/model.safetensors.llmgw-partial"))
            return found[0].stat().st_size if found else 0

        cluster.wait(lambda: partial_bytes() > 0, "part of the file on disk", 60)
        cluster.stop(node.process, signal.SIGKILL)
        kept = partial_bytes()
        cluster.start_agent(node)
        cluster.wait(cluster.all_ready, "the replica ready after the restart", 90)
        starts = [start for key, start in hub.starts if key.endswith("model.safetensors")]
        assert starts[0] == 0 and starts[-1] == kept > 0, (starts, kept)
        assert hub.bytes_served["acme/tiny-sim/model.safetensors"] < 2 * size
    finally:
        cluster.stop_all()


def test_the_downloading_node_dying_leaves_the_download_to_another(tmp_path: Path, hub: HubStandIn):
    """The downloading node dies: another takes the lease and asks the Hub only for what it lacks."""
    files = {
        "a.safetensors": os.urandom(8_000_000),
        "b.safetensors": os.urandom(32_000_000),
        "config.json": b"{}",
    }
    hub.add_model("acme/tiny-sim", files)
    hub.rate = 5_000_000
    cluster = hub_cluster(tmp_path, hub, 2, lost_after=6)
    try:
        cluster.apply(catalog_yaml({"tiny": model("hf://acme/tiny-sim@main", replicas=2)}))

        log = cluster.logs / "server.log"
        downloader = lambda: hub_downloader(log, "hf://acme/tiny-sim@main")  # noqa: E731
        holder = cluster.wait(downloader, "a node downloading from the hub", 60)
        other = next(n for n in cluster.nodes if n != holder)
        copied = cluster.nodes[other].models_dir
        cluster.wait(
            lambda: list(copied.glob("*/a.safetensors")), f"{other} copying a.safetensors from {holder}", 60
        )
        cluster.stop(cluster.nodes[holder].process, signal.SIGKILL)
        cluster.wait(
            lambda: len(cluster.replicas().replicas) == 2 and cluster.all_ready(), "both replicas ready", 120
        )
        assert {s.node for s in shards(cluster)} == {other}
        # the other node followed each file as it was downloaded: what the Hub served, it served about once
        total = sum(len(data) for data in files.values())
        assert hub.total_bytes_served() <= total + 3_000_000, dict(hub.bytes_served)
        copy = copy_of(cluster, other)
        assert {p.name: p.read_bytes() == files[p.name] for p in copy.iterdir()} == {n: True for n in files}
    finally:
        cluster.stop_all()
