"""How `ctl models` shows each model's weights, and `ctl replicas` a staging replica."""

from __future__ import annotations

import json

from click.testing import CliRunner

from llmgw.ctl import models as module
from llmgw.ctl import replicas as replicas_module
from llmgw.ctl.client import AdminClient
from llmgw.wire import CopyProgress, ModelList, ModelStatus, ReplicaList, ReplicaStatus, StagingProgress

DATA = ModelList(
    (
        ModelStatus(
            "chat",
            "seed:///data/chat",
            size=4_200_000_000,
            digest="ab" * 32,
            holders=("node-1", "node-3"),
            copying=(CopyProgress("node-2", 1_680_000_000, 4_200_000_000),),
            differing=("node-4",),
            distributable=True,
        ),
        ModelStatus("plain", "/models/plain", holders=()),
    )
)


def run(monkeypatch, module, command, data, *args: str) -> str:
    class Client:
        def request(self, *args, **kwargs):
            return data

    monkeypatch.setattr(AdminClient, "for_command", staticmethod(lambda ctx: Client()))
    result = CliRunner().invoke(command, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_models_table(monkeypatch):
    """One row per model: source, revision, size, short digest, holders, copies under way with percent,
    the nodes whose seed folder differs."""
    lines = run(monkeypatch, module, module.models, DATA).splitlines()
    headers = ["model", "source", "revision", "size", "digest", "holders", "copying", "differing"]
    assert lines[0].split() == headers
    assert lines[2].split() == [
        "chat", "seed:///data/chat", "-", "4.2", "GB", "abababababab", "node-1,", "node-3", "node-2", "40%",
        "node-4",
    ]  # fmt: skip
    assert lines[3].split() == ["plain", "/models/plain", "-", "-", "-", "none", "-", "-"]


def test_models_json(monkeypatch):
    """-o json prints the admin API's record as is."""
    data = json.loads(run(monkeypatch, module, module.models, DATA, "-o", "json"))
    assert data["models"][0]["copying"] == [
        {"node": "node-2", "bytes_present": 1_680_000_000, "bytes_total": 4_200_000_000}
    ]
    assert data["models"][0]["holders"] == ["node-1", "node-3"]


def test_replicas_shows_a_staging_replica_with_percent_bytes_rate_and_eta(monkeypatch):
    """The state column says staging; the note says how far the copy is and when it should end."""
    staging = ReplicaStatus(
        "chat-1", "chat", "staging", 3, 0, None, None, None,
        staging=StagingProgress(1_680_000_000, 4_200_000_000, 35e6), eta=72.0,
    )  # fmt: skip
    output = run(monkeypatch, replicas_module, replicas_module.replicas, ReplicaList((staging,)))
    row = output.splitlines()[2]
    assert "staging" in row
    assert "fetching 40% (1.7 GB of 4.2 GB, 35 MB/s, ETA 1 min 12 s)" in row, row


def test_nodes_show_their_models_disk(monkeypatch):
    """`ctl nodes` has a models disk column: the free bytes of the models filesystem and the copies in it."""
    from llmgw.ctl import cli
    from llmgw.wire import NodeList, NodeStatus

    def status(node_id: str, free: int | None, copies: int) -> NodeStatus:
        return NodeStatus(
            node_id, "10.0.0.1", "ready", 8, 8, (), {}, "0.1", (), (), 1.0,
            models_free_bytes=free, copies=copies,
        )

    data = NodeList((status("node-1", 16_000_000, 2), status("node-2", None, 0)))

    class Client:
        def request(self, *args, **kwargs):
            return data

    monkeypatch.setattr(AdminClient, "for_command", staticmethod(lambda ctx: Client()))
    lines = CliRunner().invoke(cli.nodes, []).output.splitlines()
    assert "models disk" in lines[0]
    assert "16 MB free, 2 copies" in lines[2] and lines[3].split()[-2] == "-"


ADAPTERS = ModelList(
    (
        ModelStatus("chat", "/models/chat", holders=("node-1",)),
        ModelStatus(
            "sql", "hf://acme/sql@main", revision="c" * 40, size=30_000_000, digest="cd" * 32,
            holders=("node-1", "node-2"), distributable=True, adapter_of="chat",
        ),  # fmt: skip
        ModelStatus("code", "/models/code", holders=("node-2",)),
    )
)


def test_models_shows_adapters_under_their_model(monkeypatch):
    """An adapter is a row under its model, its name marked, with the same columns as a model's."""
    lines = run(monkeypatch, module, module.models, ADAPTERS).splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["chat", "└", "code"]
    assert lines[3].split()[2:] == [
        "hf://acme/sql@main", "c" * 40, "30", "MB", "cdcdcdcdcdcd", "node-1,", "node-2", "-", "-",
    ]  # fmt: skip


def test_models_json_has_adapters_as_entries_naming_their_model(monkeypatch):
    """-o json: one entry per model and per adapter, in the table's order; adapter_of names the model."""
    data = json.loads(run(monkeypatch, module, module.models, ADAPTERS, "-o", "json"))
    assert [(m["name"], m["adapter_of"]) for m in data["models"]] == [
        ("chat", None), ("sql", "chat"), ("code", None),
    ]  # fmt: skip
