"""LoRA adapters on a real llama.cpp, which loads them only at start: real server, agent, gateway and
llama-server on one machine without a GPU.

The model is the tiny random-weight GGUF of :mod:`llmgw.testing.gguf`; its two adapters are GGUF LoRA
files of :func:`llmgw.testing.lora.write_tiny_gguf_lora` with different seeds, so each gives its own
greedy text. ``sql`` comes from a seed (``seed:///adapters/sql``, a directory holding one GGUF file, staged
as weights are), ``chat`` from a path on the node. The catalog first serves ``tiny`` alone (the text of a
server without adapters), then with both adapters: the replica is outdated (llama-server's ``--lora``
arguments changed) and replaced by one started with both; each adapter gives its text, the base model
the very text it gave alone.

The binaries come from ``scripts/build-llamacpp``, as for ``tests/e2e/test_e2e_llamacpp.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.llamacpp import SERVER, LlamaCppCluster, built_or_skip, tiny_catalog
from llmgw.testing.processes import free_port, processes, wait_until
from llmgw.wire import AdapterList, EventList

pytest.importorskip("gguf", reason="the gguf package is a test dependency (pip install gguf)")

from llmgw.testing.gguf import write_tiny_gguf  # noqa: E402 - after the importorskip
from llmgw.testing.lora import write_tiny_gguf_lora  # noqa: E402

__all__ = ["processes"]  # the fixture

pytestmark = [pytest.mark.timeout(300), built_or_skip()]


def both(chat: Path) -> dict[str, str]:
    """The adapters of ``tiny`` once they are added: ``sql`` from a seed, ``chat`` from the path ``chat``."""
    return {"sql": "seed:///adapters/sql", "chat": str(chat)}


def models(cluster: LocalCluster) -> list[str]:
    """The ids of the gateway's ``/v1/models`` ([] while it does not answer)."""
    try:
        response = httpx.get(f"{cluster.gateway_url}/v1/models", timeout=2)
    except httpx.HTTPError:
        return []
    return [m["id"] for m in response.json()["data"]] if response.status_code == 200 else []


def adapters(cluster: LocalCluster) -> dict[str, object]:
    """Adapter -> its ``ctl adapters`` entry."""
    data = cluster.client.request("GET", "/v1/admin/adapters", AdapterList)
    return {a.adapter: a for a in data.adapters}


def complete(cluster: LocalCluster, model: str, stream: bool = False) -> str:
    """The greedy completion of a fixed prompt for ``model`` through the gateway."""
    body = {"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0, "stream": stream}
    response = httpx.post(f"{cluster.gateway_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["text"]
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def started(tmp_path: Path, nodes: int) -> Iterator[LlamaCppCluster]:
    """``nodes`` nodes with llama.cpp (nodes 1 and 2 share a fabric), the seed of ``sql`` on node 1, and
    the gateway; stopped however the test ends."""
    cluster = LlamaCppCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        node = cluster.add_node(1)
        write_tiny_gguf_lora(node.seed_root / "adapters" / "sql" / "sql.gguf", seed=1)
        cluster.start(nodes)
        cluster.start_gateway(free_port())
        yield cluster
    finally:
        cluster.stop_all()


@pytest.fixture
def cluster(tmp_path: Path):
    """One node with llama.cpp and the gateway."""
    yield from started(tmp_path, 1)


@pytest.fixture
def rpc_cluster(tmp_path: Path):
    """Two nodes of one fabric with llama.cpp, and the gateway."""
    yield from started(tmp_path, 2)


def test_adapters_loaded_at_start_answer_each_with_its_text_and_the_base_as_alone(cluster, tmp_path):
    """Adding two adapters to a llama.cpp model restarts its replica with both (``--lora`` each, the seed
    one staged to its file); each adapter, by its name or ``tiny:NAME``, answers with its own text, and
    the base model with the text it gave without adapters; ``/v1/models``, ``ctl adapters`` and the
    events show both loaded at start, with no load asked of the agent."""
    model = write_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    chat = write_tiny_gguf_lora(tmp_path / "adapters" / "chat.gguf", seed=2)
    alone = tiny_catalog(model, max_adapters=2)
    cluster.apply(alone)
    cluster.wait(lambda: cluster.all_ready() and "tiny" in models(cluster), "tiny to be served alone", 120)
    (before,) = cluster.replicas().replicas
    plain = complete(cluster, "tiny")

    cluster.apply(tiny_catalog(model, adapters=both(chat), max_adapters=2))

    def replaced_with_adapters() -> bool:
        replicas = cluster.replicas().replicas
        if [r.id for r in replicas] == [before.id] or len(replicas) != 1 or replicas[0].state != "ready":
            return False
        listed = adapters(cluster)
        return all(listed[name].loaded == (replicas[0].id,) for name in ("sql", "chat"))

    cluster.wait(replaced_with_adapters, "the replica to be replaced by one with both adapters", 180)
    cluster.wait(lambda: {"sql", "chat"} <= set(models(cluster)), "the gateway to list the adapters")
    assert sorted(models(cluster)) == ["chat", "sql", "tiny"]

    (replica,) = cluster.replicas().replicas
    (shard,) = replica.shards
    argv = list(shard.argv)
    staged = cluster.nodes["node-1"].seed_root / "adapters" / "sql" / "sql.gguf"
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "--lora"] == [str(staged), str(chat)]
    assert "--lora-init-without-apply" in argv

    sql, chat_text = complete(cluster, "sql"), complete(cluster, "chat")
    assert len({plain, sql, chat_text}) == 3, (plain, sql, chat_text)
    assert complete(cluster, "tiny") == plain, "the base model answers as it did without adapters"
    assert complete(cluster, "tiny:sql") == sql
    assert complete(cluster, "chat", stream=True) == chat_text
    assert complete(cluster, "tiny", stream=True) == plain

    node = cluster.nodes[shard.node]
    direct = {"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"http://{node.address}:{shard.port}/v1/completions", json=direct, timeout=60)
    assert answer.json()["choices"][0]["text"] != plain, (
        "llama.cpp 0c1e570 applies --lora-init-without-apply adapters to a request that does not list them "
        "(ggml-org/llama.cpp#28674): the gateway's base-model fields are what keep the base text"
    )

    cluster.wait(lambda: adapters(cluster)["sql"].hits >= 1, "the gateway to report the hits on sql", 30)
    listed = adapters(cluster)
    assert listed["sql"].loading == () and listed["sql"].failure is None and listed["sql"].loads == 1
    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    loaded = sorted((e.subject, e.message) for e in events if e.kind == "adapter_loaded")
    assert loaded == [
        ("tiny/chat", f"loaded at start on replica {replica.id}"),
        ("tiny/sql", f"loaded at start on replica {replica.id}"),
    ]
    agent_log = cluster.tail("agent-node-1", 400)
    assert "could not be loaded" not in agent_log and "unloading adapter" not in agent_log


def test_a_two_node_replica_over_rpc_starts_rank0_with_the_adapters(rpc_cluster, tmp_path, processes):
    """A replica of two nodes (llama-server --rpc on rank 0, the RPC worker on rank 1): rank 0 alone gets
    the adapters (the seed one staged on its node, copied there when the seed is on the other), the
    worker none; each adapter answers its own text, the base model that of a llama-server alone."""
    model = write_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    chat = write_tiny_gguf_lora(tmp_path / "adapters" / "chat.gguf", seed=2)
    port = free_port()
    alone = processes.start(
        [str(SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-ngl", "0"]
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 60, "llama-server", alone)
    body = {"prompt": "hello world", "max_tokens": 8, "temperature": 0}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    rpc_cluster.apply(tiny_catalog(model, 2, both(chat), max_adapters=2))

    def loaded() -> bool:
        replicas = rpc_cluster.replicas().replicas
        if len(replicas) != 1 or replicas[0].state != "ready":
            return False
        return all(adapters(rpc_cluster)[name].loaded == (replicas[0].id,) for name in ("sql", "chat"))

    rpc_cluster.wait(loaded, "the two-node replica to be ready with both adapters", 180)
    rpc_cluster.wait(lambda: {"sql", "chat"} <= set(models(rpc_cluster)), "the gateway to list the adapters")
    (replica,) = rpc_cluster.replicas().replicas
    ranks = {shard.rank: shard for shard in replica.shards}
    assert ranks[0].node != ranks[1].node
    head, worker = list(ranks[0].argv), list(ranks[1].argv)
    assert "--rpc" in head and head.count("--lora") == 2 and "--lora" not in worker
    sql_path = Path(head[head.index("--lora") + 1])
    assert sql_path.name == "sql.gguf" and sql_path.read_bytes() == (
        rpc_cluster.nodes["node-1"].seed_root / "adapters" / "sql" / "sql.gguf"
    ).read_bytes()

    sql, chat_text = complete(rpc_cluster, "sql"), complete(rpc_cluster, "chat")
    assert complete(rpc_cluster, "tiny") == plain, "the base model answers as a llama-server without adapters"
    assert len({plain, sql, chat_text}) == 3, (plain, sql, chat_text)
