"""The gateway in front of a real cluster: clients keep being served through a drain."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.processes import free_port

CATALOG = """
profiles:
  one:
    engine: sim
    gpus_per_node: 1
    args: ["--time-to-first-token", "0.02", "--tokens-per-second", "400"]
models:
  chat:
    source: {models}/chat
    profile: one
    replicas: 2
"""

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(tmp_path: Path):
    """Server, 3 agents and a gateway; a two-replica model ready and routed."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        (tmp_path / "models" / "chat").mkdir(parents=True)
        local.start(3)
        local.start_gateway(free_port())
        local.apply(CATALOG.format(models=tmp_path / "models"))
        local.wait(local.all_ready, "both replicas to be ready")
        local.wait(lambda: _routed(local), "the gateway to route the model")
        yield local
    finally:
        local.stop_all()


def _routed(cluster: LocalCluster) -> bool:
    try:
        response = httpx.get(f"{cluster.gateway_url}/v1/models", timeout=2)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and [m["id"] for m in response.json()["data"]] == ["chat"]


class Load:
    """Clients sending requests through the gateway in threads until stopped, counting every outcome."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.clients = clients
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(i % 2 == 0,), daemon=True) for i in range(clients)
        ]

    def _run(self, stream: bool) -> None:
        body = {
            "model": "chat",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "stream": stream,
        }
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                try:
                    outcome = self._one(client, body, stream)
                except httpx.HTTPError as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                with self.lock:
                    if outcome is None:
                        self.ok += 1
                    else:
                        self.failures.append(outcome)

    def _one(self, client: httpx.Client, body: dict, stream: bool) -> str | None:
        url = f"{self.url}/v1/chat/completions"
        if not stream:
            response = client.post(url, json=body)
            if response.status_code != 200:
                return f"{response.status_code}: {response.text[:200]}"
            return None if response.json()["choices"][0]["message"]["content"] else "empty answer"
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return f"stream {response.status_code}: {response.read()[:200]!r}"
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream ended without [DONE]: {events[-2:]}"
        errors = [e for e in events[:-1] if "error" in json.loads(e)]
        return f"stream error event: {errors[0]}" if errors else None

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def test_drain_under_load_fails_no_request(cluster):
    """32 clients (half streaming) through the gateway for a whole drain: every request succeeds."""
    target = next(s.node for r in cluster.replicas().replicas for s in r.shards)
    with Load(cluster.gateway_url, 32) as load:
        cluster.wait(lambda: load.ok >= 64, "the load to get going", 60)
        cluster.client.request("POST", f"/v1/admin/nodes/{target}/drain")
        cluster.wait(
            lambda: not any(s.node == target for r in cluster.replicas().replicas for s in r.shards),
            f"{target} to be drained",
            120,
        )
        cluster.wait(cluster.all_ready, "every replica to be ready after the drain", 60)
        served = load.ok
        cluster.wait(lambda: load.ok >= served + 64, "more requests after the drain", 60)
    assert load.failures == [], (
        f"{len(load.failures)} failed of {load.ok + len(load.failures)}: {load.failures[:5]}"
    )
    assert load.ok > 128
