"""End to end: LoRA adapters travel as weights do, fetched once per fleet and copied node to node.

Real ``llmgw server`` and ``llmgw agent`` processes on 127.0.0.x, the real
``huggingface_hub`` library in the agents, and the Hub stand-in
(:mod:`llmgw.testing.hub`) counting what it serves. Nothing loads an adapter
here: every node running a replica of the base model is asked by the server
to stage the model's adapters ahead of any load (``SyncReply.stage_sources``),
which is what the loader then finds complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.testing.hub import HubStandIn
from llmgw.testing.processes import free_port
from llmgw.weights import file_sha256
from llmgw.wire import ModelList

pytestmark = pytest.mark.timeout(300)

NODES = ["node-1", "node-2", "node-3", "node-4"]

#: the base model and the adapters, small: what matters is who fetched what, how many times
BASE = {"config.json": 200, "model.safetensors": 1_000_000}
SQL = {"adapter_config.json": 300, "adapter_model.safetensors": 3_000_000}
LEGAL = {"adapter_config.json": 300, "adapter_model.safetensors": 500_000}

CATALOG = catalog_yaml(
    {
        "chat": model(
            "hf://acme/tiny-sim@main",
            replicas=4,
            adapters={"sql": "hf://acme/sql-lora@main", "legal": "seed:///data/legal-lora"},
        )
    }
)


@pytest.fixture
def hub():
    with HubStandIn() as stand_in:
        yield stand_in


def held(cluster: LocalCluster, node: str, digest: str) -> dict[str, str]:
    """path -> sha256 of every file of the copy ``digest`` in ``node``'s models directory."""
    copy = cluster.nodes[node].models_dir / digest
    return {p.relative_to(copy).as_posix(): file_sha256(p) for p in copy.rglob("*") if p.is_file()}


def test_an_adapter_is_fetched_from_the_hub_once_for_four_nodes(tmp_path: Path, hub: HubStandIn):
    """4 replicas of the base on 4 nodes: the Hub served each adapter file once; each node holds a verified
    copy of each adapter (a seeded one copied from its seed's node); ``ctl models`` lists them under it."""
    base = {name: os.urandom(size) for name, size in BASE.items()}
    sql = {name: os.urandom(size) for name, size in SQL.items()}
    hub.add_model("acme/tiny-sim", base)
    hub.add_model("acme/sql-lora", sql)
    cluster = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=8, poll_timeout=1)
    cluster.agent_args = ["--hub-endpoint", hub.endpoint]
    try:
        seed = cluster.add_node(2).seed("data/legal-lora", LEGAL)
        cluster.start(4)
        cluster.apply(CATALOG)

        def adapters_everywhere() -> dict[str, object] | None:
            listed = cluster.client.request("GET", "/v1/admin/models", ModelList).models
            entries = {m.name: m for m in listed}
            if {n for m in listed if m.adapter_of == "chat" for n in [m.name]} != {"sql", "legal"}:
                return None
            if all(sorted(entries[a].holders) == NODES for a in ("sql", "legal")):
                return entries
            return None

        entries = cluster.wait(adapters_everywhere, "both adapters held by the 4 nodes", 150)
        cluster.wait(cluster.all_ready, "4 replicas of chat ready", 60)
        running = sorted(s.node for r in cluster.replicas().replicas for s in r.shards)
        assert running == NODES

        # fetched once per fleet: the Hub served each adapter file once, whole, and never from its CDN
        assert {k: v for k, v in hub.downloads.items() if k.startswith("acme/sql-lora/")} == {
            f"acme/sql-lora/{name}": 1 for name in SQL
        }
        served = {k: v for k, v in hub.bytes_served.items() if k.startswith("acme/sql-lora/")}
        assert served == {f"acme/sql-lora/{name}": size for name, size in SQL.items()}
        assert sum(served.values()) == sum(SQL.values()), "hub bytes for the adapter: 1x its size"

        # each node's copy is verified: the bytes the Hub and the seed have, file for file
        sql_digest, legal_digest = entries["sql"].digest, entries["legal"].digest
        assert entries["sql"].revision is not None and entries["sql"].size == sum(SQL.values())
        want_sql = {name: hashlib.sha256(data).hexdigest() for name, data in sql.items()}
        want_legal = {name: file_sha256(seed / name) for name in LEGAL}
        for node in NODES:
            assert held(cluster, node, sql_digest) == want_sql, node
            if node != "node-2":  # the seed's node serves the seed itself: no copy of it
                assert held(cluster, node, legal_digest) == want_legal, node
        assert not (cluster.nodes["node-2"].models_dir / legal_digest).exists()

        # ctl models: the adapters are rows under their model; -o json has adapter_of
        shown = cluster.ctl("models").stdout.splitlines()
        names = [line.split()[0:2] for line in shown[2:]]
        assert names == [["chat", "hf://acme/tiny-sim@main"], ["└", "legal"], ["└", "sql"]], shown
        listed = json.loads(cluster.ctl("models", "-o", "json").stdout)["models"]
        assert [(m["name"], m["adapter_of"]) for m in listed] == [
            ("chat", None), ("legal", "chat"), ("sql", "chat"),
        ]  # fmt: skip

        # adapters are loaded on running engines: removing one and adding one restarts no replica
        attempts = {r.id: r.attempt for r in cluster.replicas().replicas}
        changed = CATALOG.replace("      legal: seed:///data/legal-lora\n", "      py: hf://acme/sql-lora@main\n")
        assert changed != CATALOG
        (tmp_path / "changed.yaml").write_text(changed)
        diff = cluster.ctl("diff", str(tmp_path / "changed.yaml")).stdout
        assert "adapters.legal: seed:///data/legal-lora -> (none)" in diff, diff
        assert "adapters.py: (none) -> hf://acme/sql-lora@main" in diff, diff
        assert "outdated" not in diff, diff
        applied = cluster.ctl("apply", "--wait", "--timeout", "60", str(tmp_path / "changed.yaml"))
        assert applied.returncode == 0 and "1 models, 4 replicas, 2 adapters" in applied.stdout, applied
        replicas = cluster.replicas().replicas
        assert {r.id: r.attempt for r in replicas} == attempts
        assert not any(r.outdated for r in replicas) and cluster.all_ready()
    finally:
        cluster.stop_all()
