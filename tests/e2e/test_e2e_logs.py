"""A cluster whose processes log JSON: server, agent, gateway workers and the engines the agent starts."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from llmgw.agent.launcher import LAUNCHER_PREFIX
from llmgw.dev.cluster import LocalCluster
from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.testing.processes import free_port

CATALOG = catalog_yaml({"chat": model("{models}/chat")})


pytestmark = pytest.mark.timeout(180)


def json_lines(path: Path, skip: str | None = None) -> list[dict]:
    """Every line of a log (but those starting with ``skip``) as JSON; fails naming one that is not."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if skip and line.startswith(skip):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"{path.name} line {number} is not JSON: {line!r}")
        assert {"time", "level", "logger", "message", "pid"} <= set(record), f"{path.name}:{number}: {line}"
        records.append(record)
    assert records, f"{path} is empty"
    return records


def test_every_process_logs_json_with_one_variable(tmp_path, monkeypatch):
    """LLMGW_LOG_FORMAT=json: each process's log (engine's, two gateway workers') is JSON lines only."""
    monkeypatch.setenv("LLMGW_LOG_FORMAT", "json")
    (tmp_path / "models" / "chat").mkdir(parents=True)
    cluster = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        cluster.start(1)
        cluster.start_gateway(free_port(), extra=["--workers", "2"])
        cluster.apply(CATALOG.format(models=tmp_path / "models"))
        cluster.wait(cluster.all_ready, "the replica to be ready")
        chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answer = cluster.wait(
            lambda: httpx.post(f"{cluster.gateway_url}/v1/chat/completions", json=chat, timeout=10),
            "the gateway to answer",
        )
        assert answer.status_code == 200, answer.text
    finally:
        cluster.stop_all()
    server = json_lines(cluster.logs / "server.log")
    agent = json_lines(cluster.logs / "agent-node-1.log")
    gateway = json_lines(cluster.logs / "gateway.log")
    assert any(r["logger"].startswith("llmgw.server") for r in server)
    assert any(r["logger"].startswith("llmgw.agent") for r in agent)
    assert len({r["pid"] for r in gateway}) == 3, "the parent and two workers each log"
    shard_logs = list(cluster.nodes["node-1"].state_dir.glob("logs/*.log"))
    assert shard_logs, "the agent wrote no shard log"
    # the launcher's own lines about the engine's process group keep their prefix (the agent reads them)
    engine = [r for path in shard_logs for r in json_lines(path, skip=LAUNCHER_PREFIX)]
    assert any(r["logger"] == "llmgw_engine_sim" and r["message"].startswith("ready") for r in engine)
