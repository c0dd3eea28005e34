"""What the server does with model copies: a copy's progress reschedules nothing; staging is not a failure."""

from __future__ import annotations

import attrs

from llmgw.models import ModelCopy
from llmgw.server.state.cluster import ClusterState, Settings
from llmgw.wire import SyncRequest
from tests.server.test_cluster import Harness, facts


def request(copy: ModelCopy | None, sources: tuple[str, ...] = (), free: int = 10**12) -> SyncRequest:
    node_facts = attrs.evolve(
        facts("node-1"),
        model_copies=[copy] if copy else [],
        models_free_bytes=free,
        model_sources=sources,
        peer_port=7444,
    )
    return SyncRequest(node_id="node-1", address="127.0.0.2", facts=node_facts, port_range=(20000, 20999))


def test_copy_progress_is_not_a_placement_fact():
    """Bytes fetched, last use and free bytes change the stored facts but ask for no schedule."""
    cluster = ClusterState(Settings())
    copy = ModelCopy("d" * 64, "seed:///m", 10, 100)
    cluster.sync(request(copy), 1000.0)
    cluster.schedule_wanted = False
    cluster.dirty_nodes.clear()
    wanted = cluster.sync(request(attrs.evolve(copy, bytes_present=60, last_used=5.0), free=10**11), 1001.0)
    assert not wanted and not cluster.schedule_wanted
    assert cluster.dirty_nodes == {"node-1"}, "the new facts should still be stored"
    complete = attrs.evolve(copy, bytes_present=100, complete=True)
    assert cluster.sync(request(complete, sources=("seed:///m",)), 1002.0)
    assert cluster.schedule_wanted, "holding the source now is a placement fact"


def test_a_staging_shard_is_not_held_to_the_ready_timeout():
    """A replica whose shard copies weights for longer than the ready timeout is not failed for it."""
    harness = Harness()
    harness.join("node-1")
    harness.apply()
    [replica_id] = [r for r in harness.cluster.replicas if r.startswith("small")][:1]
    harness.set_state("node-1", replica_id, "staging", detail="fetching 40% (40 of 100 MB, 10 MB/s)")
    harness.now += harness.cluster.settings.ready_timeout * 3
    harness.sync_all()
    record = harness.cluster.replicas[replica_id]
    assert record.state == "starting" and record.failures == 0
    harness.set_state("node-1", replica_id, "starting", detail=None)
    harness.now += harness.cluster.settings.ready_timeout + 1
    harness.sync_all()
    assert harness.cluster.replicas[replica_id].failures == 1, "once started, the ready timeout applies again"
