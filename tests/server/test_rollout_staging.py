"""Weights in the server's views and rollouts: staging replicas, ctl models, rollouts that stage first."""

from __future__ import annotations

import attrs
from llmgw_engine_sim import SimEngine
from test_cluster import Harness, facts  # the reconciler's step-by-step harness

from llmgw.catalog import parse_catalog
from llmgw.models import ModelCopy, NodeFacts
from llmgw.server.reconciler import reconcile
from llmgw.server.views import cluster as views
from llmgw.server.views.models import model_list
from llmgw.server.views.rollouts import rollout_status
from llmgw.testing.catalogs import catalog_yaml, model
from llmgw.weights import Manifest, ManifestFile
from llmgw.wire import StagingProgress

ENGINES = {"sim": SimEngine()}
OLD, NEW = "seed:///data/old", "seed:///data/new"
GB = 10**9


def manifest(source: str, size: int) -> Manifest:
    return Manifest(source, (ManifestFile("model.safetensors", size, "a" * 64),), made_by="node-1")


def seed_of(source: str) -> ModelCopy:
    """A verified seed of ``source`` (OLD is 2 GB, NEW 1 GB)."""
    held = manifest(source, 2 * GB if source == OLD else GB)
    return ModelCopy(held.digest, source, held.total_bytes, held.total_bytes, complete=True, seed=True)


OLD_COPY = ModelCopy(manifest(OLD, 2 * GB).digest, OLD, 2 * GB, 2 * GB, complete=True)


class Weights(Harness):
    """The cluster harness with nodes whose copies and free bytes the test sets."""

    def __init__(self) -> None:
        super().__init__()
        self.node_facts: dict[str, NodeFacts] = {}

    def set_weights(self, node_id: str, *, free: int, sources=(), copies=()) -> None:
        """The node holds ``sources`` (verified: reported as seeds, as an agent does once it hashed them)."""
        complete = {c.source for c in copies if c.complete}
        copies = (*copies, *(seed_of(s) for s in sources if s not in complete))
        self.node_facts[node_id] = attrs.evolve(
            facts(node_id), model_sources=sources, model_copies=copies, models_free_bytes=free, peer_port=7444
        )

    def facts_of(self, node_id: str) -> NodeFacts:
        return self.node_facts.get(node_id) or facts(node_id)

    def apply_source(self, source: str) -> None:
        text = catalog_yaml(
            {"chat": model(source, replicas=2, rollout={"max_surge": 0, "max_unavailable": 1})}
        )
        self.cluster.apply_catalog(parse_catalog(text, ENGINES), text, self.now)
        reconcile(self.cluster, self.now)
        self.sync_all()

    def source_of(self, replica_id: str) -> str:
        return self.cluster.launch_of(self.cluster.replicas[replica_id]).model.source

    def node_of(self, replica_id: str) -> str:
        return self.cluster.replicas[replica_id].placement.rank0.node_id


def serving_old(free_2: int = 10 * GB) -> Weights:
    """chat-0 and chat-1 ready on node-1 (OLD's seed) and node-2 (a copy of OLD); NEW's manifest (1 GB) is
    stored."""
    h = Weights()
    h.set_weights("node-1", free=10 * GB, sources=(OLD,))
    h.set_weights("node-2", free=free_2, sources=(OLD,), copies=(OLD_COPY,))
    h.join("node-1")
    h.join("node-2")
    h.cluster.note_manifest(manifest(OLD, 2 * GB))
    h.cluster.note_manifest(manifest(NEW, GB))
    h.apply_source(OLD)
    for _ in range(2):  # a shard is handed out at its node's next sync
        for replica_id in ("chat-0", "chat-1"):
            if h.cluster.replicas[replica_id].state != "ready":
                h.run_all(replica_id)
    assert {h.node_of("chat-0"), h.node_of("chat-1")} == {"node-1", "node-2"}
    assert all(r.state == "ready" for r in h.cluster.replicas.values())
    return h


def test_a_staging_replica_shows_staging_with_bytes_rate_and_eta():
    """A replica whose shard fetches 1 of 4 GB at 100 MB/s is staging, 25%, ETA 30 s; starting once copied."""
    h = serving_old()
    h.apply_source(NEW)
    on_1 = next(r for r in ("chat-0", "chat-1") if h.node_of(r) == "node-1")
    h.set_weights("node-1", free=10 * GB, sources=(OLD, NEW))  # node-1 has the new copy: restarted in place
    h.sync_all()
    assert h.cluster.replicas[on_1].state == "starting" and h.source_of(on_1) == NEW
    progress = StagingProgress(GB, 4 * GB, 100e6)
    h.set_state("node-1", on_1, "staging", detail="fetching 25% (1000 of 4000 MB, 100 MB/s)", staged=progress)
    h.sync_all()
    status = next(r for r in views.replica_list(h.cluster).replicas if r.id == on_1)
    assert status.state == "staging" and status.staging == progress and status.eta == 30.0
    h.set_state("node-1", on_1, "starting", detail=None, staged=None)
    h.sync_all()
    assert next(r for r in views.replica_list(h.cluster).replicas if r.id == on_1).state == "starting"


def test_a_rollout_to_new_weights_copies_them_before_it_restarts_anything():
    """max_unavailable 1, no surge: both nodes copy NEW while both replicas serve OLD; a replica is restarted
    in place only once its node holds the copy."""
    h = serving_old()
    h.apply_source(NEW)
    assert h.cluster.rollouts.stage_sources() == {"node-1": (NEW,), "node-2": (NEW,)}
    assert all(r.state == "ready" and h.source_of(r.id) == OLD for r in h.cluster.replicas.values())
    status = rollout_status(h.cluster, "chat").rollouts[0]
    assert status.state == "staging" and "node-1 0%, node-2 0%" in status.reason, status.reason

    partial = ModelCopy("b" * 64, NEW, GB // 2, GB)
    h.set_weights("node-2", free=10 * GB, sources=(OLD,), copies=(OLD_COPY, partial))
    h.now += 1
    h.sync_all()
    assert "node-2 50%" in rollout_status(h.cluster, "chat").rollouts[0].reason
    assert all(r.state == "ready" for r in h.cluster.replicas.values()), "nothing restarts while copying"

    h.set_weights(
        "node-2", free=10 * GB, sources=(OLD, NEW), copies=(attrs.evolve(partial, bytes_present=GB),)
    )
    h.now += 1
    h.sync_all()
    on_2 = next(r for r in ("chat-0", "chat-1") if h.node_of(r) == "node-2")
    assert h.source_of(on_2) == NEW and h.cluster.replicas[on_2].state == "starting"
    assert h.cluster.rollouts.stage_sources() == {"node-1": (NEW,)}, "node-2 holds it now"


def test_a_node_without_room_beside_the_old_copy_is_not_asked_to_stage():
    """node-2 has 0.5 GB free and its OLD copy is in use: it is not asked; its replica is restarted in
    place (the agent evicts the old copy, unused once stopped), while node-1 copies ahead."""
    h = serving_old(free_2=GB // 2)
    h.apply_source(NEW)
    assert h.cluster.rollouts.stage_sources() == {"node-1": (NEW,)}
    on_2 = next(r for r in ("chat-0", "chat-1") if h.node_of(r) == "node-2")
    assert h.source_of(on_2) == NEW, "restarted in place: its old copy, unused now, makes the room"


def test_models_view_lists_source_size_digest_holders_and_copies():
    """ctl models' record: OLD held by both nodes; NEW being copied on node-2 (50%)."""
    h = serving_old()
    h.set_weights(
        "node-2",
        free=10 * GB,
        sources=(OLD,),
        copies=(ModelCopy(manifest(NEW, GB).digest, NEW, GB // 2, GB),),
    )
    h.apply_source(NEW)
    [chat] = model_list(h.cluster).models
    assert (chat.name, chat.source, chat.size, chat.digest) == ("chat", NEW, GB, manifest(NEW, GB).digest)
    assert chat.holders == () and chat.distributable
    assert [(c.node, c.bytes_present, c.bytes_total) for c in chat.copying] == [("node-2", GB // 2, GB)]
