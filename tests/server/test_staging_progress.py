"""Copy progress in ``ctl models`` and ``ctl replicas``: one source (the staging shard's bytes), never stale.

Issue 24: a dead node's "8.2 MB/s, ETA 11 s" stayed in ``ctl replicas`` until it
was declared lost, and ``ctl models`` moved by whole files (the node's facts)
while ``ctl replicas`` moved by bytes.
"""

from __future__ import annotations

from test_rollout_staging import GB, NEW, Weights, manifest

from llmgw.models import ModelCopy
from llmgw.server.controllers.nodes.lost import STALE_PROGRESS
from llmgw.server.views import cluster as views
from llmgw.server.views.models import model_list
from llmgw.wire import CopyProgress, StagingProgress


def staging_on_node_1() -> tuple[Weights, str]:
    """node-2 holds NEW (its seed); node-1 stages the replica placed there, its facts a file behind."""
    h = Weights()
    digest = manifest(NEW, GB).digest
    h.set_weights("node-1", free=10 * GB, copies=(ModelCopy(digest, NEW, GB // 4, GB),))
    h.set_weights(
        "node-2", free=10 * GB, sources=(NEW,), copies=(ModelCopy(digest, NEW, GB, GB, True, seed=True),)
    )
    h.join("node-1")
    h.join("node-2")
    h.cluster.note_manifest(manifest(NEW, GB))
    h.apply_source(NEW)
    h.sync_all()  # a shard is handed out at its node's next sync
    on_1 = next(r for r in ("chat-0", "chat-1") if h.node_of(r) == "node-1")
    progress = StagingProgress(400_000_000, GB, 50e6)
    h.set_state("node-1", on_1, "staging", detail="fetching 40% (400 of 1000 MB, 50 MB/s)", staged=progress)
    h.sync_all()
    return h, on_1


def test_ctl_models_and_ctl_replicas_show_the_same_bytes():
    """The shard reports 400 of 1000 MB while the node's facts still say 250: both views say 400 (40%)."""
    h, on_1 = staging_on_node_1()
    [chat] = model_list(h.cluster).models
    assert chat.holders == ("node-2",)
    assert chat.copying == (CopyProgress("node-1", 400_000_000, GB),)
    status = next(r for r in views.replica_list(h.cluster).replicas if r.id == on_1)
    assert status.staging == StagingProgress(400_000_000, GB, 50e6) and status.eta == 12.0


def test_the_progress_of_a_node_that_stopped_syncing_is_dropped():
    """node-1 silent for STALE_PROGRESS: no rate nor ETA in ctl replicas, no copy under way in ctl models."""
    h, on_1 = staging_on_node_1()
    for _ in range(int(STALE_PROGRESS) + 1):
        h.now += 1
        h.sync("node-2")
    status = next(r for r in views.replica_list(h.cluster).replicas if r.id == on_1)
    assert status.staging is None and status.eta is None, status
    [shard] = status.shards
    assert shard.detail == f"no progress known: node-1 has not synced for over {STALE_PROGRESS:.0f} s"
    [chat] = model_list(h.cluster).models
    assert chat.copying == ()
    h.sync("node-1")  # it syncs again: its progress is back
    assert model_list(h.cluster).models[0].copying == (CopyProgress("node-1", 400_000_000, GB),)
