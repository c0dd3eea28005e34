"""Faults the fleet contains, across real processes: ``llmgw server``, agents, sim engines.

A hung engine whose /health still answers 200 is found by the agent's canary and
replaced; a busy one is left alone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.processes import free_port, pid_alive
from llmgw.wire import EventList, ReplicaStatus

pytestmark = pytest.mark.timeout(240)

#: each attempt of ``small-0`` answers 6 requests (its canaries: one every 2 s), then hangs
HANGING = """
profiles:
  hangs:
    engine: sim
    gpus_per_node: 1
    args: ["--hang-after-requests", "6"]
models:
  small:
    source: {models}/small
    profile: hangs
"""

#: one seat, 10 tokens a second: requests wait behind each other, as in a full batch
BUSY = """
profiles:
  busy:
    engine: sim
    gpus_per_node: 1
    args: ["--max-num-seqs", "1", "--tokens-per-second", "10"]
models:
  small:
    source: {models}/small
    profile: busy
"""


@pytest.fixture
def cluster(tmp_path: Path):
    """A server and 2 agents; no catalog yet."""
    local = LocalCluster(tmp_path / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    (tmp_path / "models" / "small").mkdir(parents=True)
    try:
        local.start(2)
        yield local
    finally:
        local.stop_all()


def small(cluster: LocalCluster) -> ReplicaStatus | None:
    """The replica ``small-0``, once placed."""
    return next((r for r in cluster.replicas().replicas if r.id == "small-0"), None)


def small_ready(cluster: LocalCluster, other_than: int | None = None) -> ReplicaStatus | None:
    """``small-0`` once it is ready (on an attempt other than ``other_than``), else None."""
    replica = small(cluster)
    if replica is not None and replica.state == "ready" and replica.attempt != other_than:
        return replica
    return None


def test_hung_sim_with_health_200_is_replaced(cluster, tmp_path):
    """A sim that stops answering while /health says 200 is failed, torn down and ready again elsewhere."""
    cluster.apply(HANGING.format(models=tmp_path / "models"))
    first = cluster.wait(lambda: small_ready(cluster), "small-0 to be ready", 60)
    old_pid = first.shards[0].pid
    cluster.wait(lambda: small(cluster).failures >= 1, "the hung replica to be failed", 60)
    events = cluster.client.request("GET", "/v1/admin/events", EventList).events
    failed = [e.message for e in events if e.subject == "small-0" and e.message.startswith("failed:")]
    assert failed and "unhealthy: liveness probe POST" in failed[0] and "hung" in failed[0], failed
    assert "no token was produced meanwhile" in failed[0]
    again = cluster.wait(lambda: small_ready(cluster, first.attempt), "small-0 ready on a new attempt", 60)
    assert again.shards[0].pid != old_pid
    cluster.wait(lambda: not pid_alive(old_pid), "the hung engine to be gone", 10)


def test_busy_sim_is_not_ejected(cluster, tmp_path):
    """A sim kept busy for 20 s (its canary waiting behind full seats) stays ready (a non-event)."""
    cluster.apply(BUSY.format(models=tmp_path / "models"))
    ready = cluster.wait(lambda: small_ready(cluster), "small-0 to be ready", 60)
    shard = ready.shards[0]
    address = cluster.nodes[shard.node].address
    url = f"http://{address}:{shard.port}/v1/completions"
    stop = threading.Event()

    def load(worker: int) -> None:
        with httpx.Client(timeout=60) as client:
            number = 0
            while not stop.is_set():
                body = {"model": "small", "prompt": f"busy {worker} {number}", "max_tokens": 60}
                client.post(url, json=body)
                number += 1

    threads = [threading.Thread(target=load, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(20)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    after = small(cluster)
    assert (after.state, after.failures, after.attempt) == ("ready", 0, ready.attempt)
    log = (cluster.logs / f"agent-{shard.node}.log").read_text()
    assert "busy, not hung" in log, "the canary never waited: the test did not load the sim enough"
