"""A two-node replica stopped under a stream in flight: rank 0 finishes it, the worker stops after rank 0."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.load import ready_cluster
from llmgw.testing.processes import pid_alive
from llmgw.wire import EventList


def catalog(replicas: int) -> str:
    """``replicas`` of ``big``, each on two nodes whose sims take 20 s to drain their streams."""
    tp2 = sim_profile(2, "--tokens-per-second", "20", "--shutdown-grace", "20", nodes=2, stop_grace=25)
    return catalog_yaml({"big": model("{models}/big", "tp2", replicas=replicas)}, tp2=tp2)


pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(tmp_path: Path):
    """Server and 2 agents on fabric ib-a; a two-node replica ready."""
    with ready_cluster(tmp_path, catalog(1)) as local:
        yield local


def test_scale_down_lets_rank_0_finish_its_stream_before_the_worker_stops(cluster, tmp_path):
    """A 60-token stream (3 s) in flight as its replica is scaled away ends whole: the worker outlives it."""
    [replica] = cluster.replicas().replicas
    rank0, worker = replica.shards
    address = cluster.nodes[rank0.node].address
    url = f"http://{address}:{rank0.port}"
    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "stream": True}
    body["ignore_eos"] = True  # as vLLM's: the answer goes on to max_tokens, 60 tokens
    first_token, outcome = threading.Event(), {}

    def stream() -> None:
        tokens, done = 0, False
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        tokens += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
                        first_token.set()
        except httpx.HTTPError as exc:
            outcome["error"] = repr(exc)
        outcome.update(tokens=tokens, done=done)
        first_token.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first_token.wait(30), "no token arrived"
    cluster.apply(catalog(0).format(models=tmp_path / "models"))
    reader.join(60)
    assert outcome.get("done") and "error" not in outcome, outcome
    assert outcome["tokens"] == 60, outcome
    cluster.wait(lambda: not cluster.replicas().replicas, "the replica to be gone")
    cluster.wait(lambda: not pid_alive(worker.pid) and not pid_alive(rank0.pid), "both shards to exit", 60)

    def released() -> list[str]:
        events = cluster.client.request("GET", "/v1/admin/events", EventList).events
        return [e.message for e in events if e.subject == "big-0" and "stopping its workers" in e.message]

    messages = cluster.wait(released, "the event that releases the worker", 10)
    assert "rank 0 stopped" in messages[0] or "rank 0 exited" in messages[0], messages
