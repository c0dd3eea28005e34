"""A real llama.cpp under llmgw: real server, agents, gateway and engines, on one machine without a GPU.

The binaries come from ``scripts/build-llamacpp`` (CI runs it first), found as
:mod:`llmgw.testing.llamacpp` says. The
model is the tiny random-weight GGUF of :mod:`llmgw.testing.gguf`, made
here; its text is garbage, tokens coming back is the point.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster, program
from llmgw.engine import Engine
from llmgw.testing.llamacpp import SERVER, WORKER, LlamaCppCluster, built_or_skip, tiny_catalog
from llmgw.testing.processes import free_port
from llmgw.wire import to_json

gguf_module = pytest.importorskip("gguf", reason="the gguf package is a test dependency (pip install gguf)")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency")

from llmgw.testing.gguf import write_tiny_gguf  # noqa: E402 - after the importorskip

pytestmark = [pytest.mark.timeout(300), built_or_skip()]

def _routed(cluster: LocalCluster, model: str = "tiny") -> bool:
    try:
        response = httpx.get(f"{cluster.gateway_url}/v1/models", timeout=2)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and model in [m["id"] for m in response.json()["data"]]


def _replica(cluster: LocalCluster) -> dict:
    (replica,) = cluster.replicas().replicas
    return to_json(replica)


def _start(tmp_path: Path, nodes: int) -> LlamaCppCluster:
    model = write_tiny_gguf(tmp_path / "models" / "tiny.gguf")
    cluster = LlamaCppCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    try:
        cluster.start(nodes)  # nodes 1 and 2 share fabric ib-a: a two-node replica fits
        cluster.start_gateway(free_port())
        cluster.apply(tiny_catalog(model, nodes))
        cluster.wait(cluster.all_ready, f"the {nodes}-node llama.cpp replica to be ready", 120)
        cluster.wait(lambda: _routed(cluster), "the gateway to route the model")
    except BaseException:
        cluster.stop_all()
        raise
    return cluster


@pytest.fixture
def single(tmp_path: Path):
    cluster = _start(tmp_path, 1)
    yield cluster
    cluster.stop_all()


@pytest.fixture
def rpc(tmp_path: Path):
    cluster = _start(tmp_path, 2)
    yield cluster
    cluster.stop_all()


def _client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="unused", timeout=30, max_retries=0)


def _chat(client: openai.OpenAI, max_tokens: int = 8) -> str:
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=max_tokens,
        temperature=0,
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == max_tokens
    assert answer.choices[0].message.content
    return answer.choices[0].message.content


class TestSingleNode:
    """One agent runs llama-server on the CPU; the official openai client is served through the gateway."""

    def test_chat_and_completions(self, single):
        """Chat and completions, streamed and not: tokens come back, up to max_tokens."""
        client = _client(single)
        text = _chat(client)
        assert _chat(client) == text, "temperature 0 gives the same text every time"

        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

        completion = client.completions.create(model="tiny", prompt="hello world", max_tokens=16)
        assert completion.choices[0].text and completion.usage.completion_tokens == 16

        pieces = list(client.completions.create(model="tiny", prompt="hello", max_tokens=8, stream=True))
        assert "".join(p.choices[0].text for p in pieces if p.choices)

        (shard,) = _replica(single)["shards"]
        assert shard["state"] == "ready"
        assert [m.id for m in client.models.list()] == ["tiny"]


class TestTwoNodesOverRpc:
    """The RPC worker on one node, llama-server --rpc on the other; failures of the worker are recovered."""

    def test_serves_then_recovers_from_a_killed_worker(self, rpc):
        """Killing the RPC worker fails the replica; it is rebuilt and serves the same greedy text."""
        client = _client(rpc)
        replica = _replica(rpc)
        ranks = {s["rank"]: s for s in replica["shards"]}
        assert ranks[0]["node"] != ranks[1]["node"]
        text = _chat(client)

        os.kill(ranks[1]["pid"], signal.SIGKILL)
        attempt = replica["attempt"]
        rpc.wait(
            lambda: _replica(rpc)["attempt"] > attempt and rpc.all_ready(),
            "the replica to be rebuilt after its RPC worker was killed",
            120,
        )
        rpc.wait(lambda: _routed(rpc), "the gateway to route the rebuilt replica")
        assert _chat(client) == text, "greedy text is the same after the rebuild"

    def test_hung_worker_is_taken_out_of_routes_and_rebuilt(self, rpc):
        """A SIGSTOPped worker: /health stays 200, requests hang; llmgw still unroutes and rebuilds it."""
        if not hasattr(Engine, "liveness_probe"):
            pytest.fail(
                "llmgw's agent probes only /health, which stays 200 here: it needs Engine.liveness_probe "
                "and the supervisor's liveness loop (issue 7's agent patch)"
            )
        client = _client(rpc)
        replica = _replica(rpc)
        ranks = {s["rank"]: s for s in replica["shards"]}
        head = f"http://{_address(rpc, ranks[0]['node'])}:{ranks[0]['port']}"
        _chat(client)

        worker = ranks[1]["pid"]
        os.kill(worker, signal.SIGSTOP)
        try:
            assert httpx.get(f"{head}/health", timeout=5).status_code == 200, "health does not see the hang"
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{head}/completion", json={"prompt": "a", "n_predict": 1}, timeout=2)
            attempt = replica["attempt"]
            rpc.wait(
                lambda: _replica(rpc)["attempt"] > attempt or _replica(rpc)["state"] != "ready",
                "llmgw to find the hung replica although /health answers 200",
                90,
            )
        finally:
            try:
                os.kill(worker, signal.SIGCONT)
            except ProcessLookupError:
                pass
        rpc.wait(
            lambda: _replica(rpc)["attempt"] > attempt and rpc.all_ready(),
            "the replica to be rebuilt after its RPC worker hung",
            120,
        )
        rpc.wait(lambda: _routed(rpc), "the gateway to route the rebuilt replica")
        _chat(client)


def _address(cluster: LocalCluster, node_id: str) -> str:
    return cluster.nodes[node_id].address


def test_engine_check_passes_on_the_built_binaries():
    """`llmgw ctl engine-check llamacpp --binary ...` accepts the real binaries' help."""
    result = subprocess.run(
        [
            program("llmgw"),
            "ctl",
            "engine-check",
            "llamacpp",
            "--binary",
            f"llama-server={SERVER}",
            "--binary",
            f"rpc-server={WORKER}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
