"""The reconciler, driven step by step with a fake clock: placement, readiness, rebuild, loss, drain."""

from __future__ import annotations

import attrs
import pytest
from llmgw_engine_sim import SimEngine

from llmgw.catalog import parse_catalog
from llmgw.models import GPU, Fabric, NodeFacts
from llmgw.server.persist import cluster as persist
from llmgw.server.persist.cluster import flush, load_cluster
from llmgw.server.persist.sqlite import open_store
from llmgw.server.reconciler import begin, finish, reconcile
from llmgw.server.state.cluster import ClusterState, Settings
from llmgw.server.views import cluster as views
from llmgw.wire import ObservedShard, Route, SyncRequest

ENGINES = {"sim": SimEngine()}
CATALOG = """
profiles:
  one:
    engine: sim
    gpus_per_node: 2
  two:
    engine: sim
    nodes: 2
    gpus_per_node: 4
models:
  small:
    source: /models/small
    profile: one
  big:
    source: /models/big
    profile: two
    replicas: {big}
"""


def facts(node_id: str, fabric: str | None = None) -> NodeFacts:
    """A node with 8 fake GPUs, the sim engine, both model sources, and maybe a fabric."""
    gpus = [GPU(i, f"GPU-{node_id}-{i}", "H100", 81559, 81000, f"0000:{i:02x}:00.0", "550") for i in range(8)]
    fabrics = [Fabric(fabric, ["mlx5_0", "mlx5_1"])] if fabric else []
    return NodeFacts(
        node_id=node_id,
        agent_version="0.1.0",
        gpus=gpus,
        fabrics=fabrics,
        engines={"sim": "0.1.0"},
        model_sources=["/models/small", "/models/big"],
    )


class Harness:
    """A cluster plus agents that report whatever the test says their shards do."""

    def __init__(self) -> None:
        self.cluster = ClusterState(Settings(lost_after=30, backoff_base=2))
        self.now = 1000.0
        self.states: dict[str, dict[str, ObservedShard]] = {}
        self.revisions: dict[str, int] = {}
        self.fabrics: dict[str, str | None] = {}

    @classmethod
    def running_big(cls, nodes: tuple[str, str] = ("a1", "a2")) -> Harness:
        """A harness whose two ``nodes`` (fabric ib-a) run the two-node replica big-0, ready."""
        h = cls()
        for node_id in nodes:
            h.join(node_id, fabric="ib-a")
        h.apply(big=1)
        h.sync_all()
        h.run_all("big-0")
        return h

    def join(self, node_id: str, fabric: str | None = None, address: str | None = None) -> None:
        self.fabrics[node_id] = fabric
        self.states[node_id] = {}
        self.revisions[node_id] = 0
        self._addresses = getattr(self, "_addresses", {})
        self._addresses[node_id] = address or f"127.0.0.{len(self.states) + 1}"
        self.sync(node_id)

    def apply(self, big: int = 0) -> None:
        text = CATALOG.format(big=big)
        self.cluster.apply_catalog(parse_catalog(text, ENGINES), text, self.now)
        reconcile(self.cluster, self.now)
        self.sync_all()

    def facts_of(self, node_id: str) -> NodeFacts:
        """What ``node_id``'s agent reports of its node (a subclass may report other facts)."""
        return facts(node_id, self.fabrics[node_id])

    def sync(self, node_id: str) -> None:
        """One agent sync: report, reconcile, then 'apply' the reply (start what is new)."""
        request = SyncRequest(
            node_id=node_id,
            address=self._addresses[node_id],
            facts=self.facts_of(node_id),
            port_range=(20000, 20999),
            observed=list(self.states[node_id].values()),
            revision=self.revisions[node_id],
            checked_sources=self.cluster.sources_to_check(),
        )
        self.cluster.sync(request, self.now)
        reconcile(self.cluster, self.now)
        desired = {s.key: s for s in views.desired_for(self.cluster, node_id)}
        for key in list(self.states[node_id]):
            if key not in desired:
                del self.states[node_id][key]
        for key, shard in desired.items():
            self.states[node_id].setdefault(
                key, ObservedShard(shard.replica_id, shard.attempt, shard.rank, "starting")
            )
        self.revisions[node_id] = self.cluster.revision

    def set_state(self, node_id: str, replica_id: str, state: str, **fields) -> None:
        for key, shard in self.states[node_id].items():
            if shard.replica_id == replica_id:
                self.states[node_id][key] = attrs.evolve(shard, state=state, **fields)

    def run_all(self, replica_id: str) -> None:
        """Every shard of the replica up, rank 0 healthy, then everyone syncs."""
        record = self.cluster.replicas[replica_id]
        for shard in record.placement.shards:
            self.set_state(shard.node_id, replica_id, "ready" if shard.rank == 0 else "running")
        self.sync_all()

    def sync_all(self) -> None:
        for node_id in self.states:
            self.sync(node_id)


def test_places_and_becomes_ready():
    """A catalog applied to synced nodes gets a replica placed, started, and ready once rank 0 is healthy."""
    h = Harness()
    h.join("node-1")
    h.join("node-2")
    h.apply()
    record = h.cluster.replicas["small-0"]
    node = record.placement.rank0.node_id
    h.sync_all()
    assert [s.replica_id for s in views.desired_for(h.cluster, node)] == ["small-0"]
    assert record.state == "starting"
    h.set_state(node, "small-0", "ready")
    h.sync(node)
    assert record.state == "ready"
    assert views.route_table(h.cluster).routes["small"] == (
        Route("small-0", f"http://{h._addresses[node]}:{record.placement.rank0.port}"),
    )


def test_exited_shard_tears_down_and_rebuilds_with_backoff():
    """A shard that exits takes its replica down; it is rebuilt after the backoff with a new attempt."""
    h = Harness()
    h.join("node-1")
    h.apply()
    h.sync_all()
    h.run_all("small-0")
    record = h.cluster.replicas["small-0"]
    first_attempt = record.attempt
    h.set_state("node-1", "small-0", "exited", exit_code=1, detail="CUDA error")
    h.sync("node-1")
    assert record.state == "backoff" and record.failures == 1
    assert "exited with code 1: CUDA error" in record.reason
    assert views.desired_for(h.cluster, "node-1") == ()
    assert "small" not in views.route_table(h.cluster).routes
    h.now += 1
    h.sync("node-1")
    assert record.state == "backoff", "rebuilt before the backoff passed"
    h.now += 1.5
    h.sync("node-1")
    assert record.state == "starting" and record.attempt != first_attempt
    assert [s.attempt for s in views.desired_for(h.cluster, "node-1")] == [record.attempt]


def test_backoff_grows_while_it_keeps_failing():
    """Each failure in a row doubles the wait, and the failure count is kept."""
    h = Harness()
    h.join("node-1")
    h.apply()
    delays = []
    for _ in range(3):
        h.sync_all()
        h.set_state("node-1", "small-0", "exited", exit_code=1)
        h.sync("node-1")
        record = h.cluster.replicas["small-0"]
        delays.append(record.not_before - h.now)
        h.now = record.not_before
        h.sync("node-1")
    assert delays == [2, 4, 8]
    assert h.cluster.replicas["small-0"].failures == 3


def test_multi_node_replica_on_one_fabric_with_its_adapters():
    """A two-node replica lands on two nodes of one fabric, never the island; rank 0 binds dist-init."""
    h = Harness()
    h.join("island")
    h.join("a1", fabric="ib-a")
    h.join("b1", fabric="ib-b")
    h.join("a2", fabric="ib-a")
    h.apply(big=1)
    h.sync_all()
    record = h.cluster.replicas["big-0"]
    assert sorted(record.placement.node_ids) == ["a1", "a2"]
    rank0, rank1 = record.placement.shards
    shards = {n: {s.rank: s for s in views.desired_for(h.cluster, n)} for n in ("a1", "a2")}
    spec0 = shards[rank0.node_id][0].spec
    spec1 = shards[rank1.node_id][1].spec
    assert (
        spec0.dist_init_addr
        == spec1.dist_init_addr
        == f"{h._addresses[rank0.node_id]}:{rank0.dist_init_port}"
    )
    assert spec0.nnodes == spec1.nnodes == 2
    assert spec1.adapters == ("mlx5_0", "mlx5_1")
    assert len(spec0.gpus) == 4


def test_lost_node_replicas_come_back_elsewhere():
    """A node that stops syncing is declared lost and its replica is placed on another node."""
    h = Harness()
    h.join("node-1")
    h.apply()
    h.sync_all()
    h.run_all("small-0")
    h.join("node-2")
    for _ in range(3):
        h.now += 12
        h.sync("node-2")
    assert h.cluster.nodes["node-1"].lost
    record = h.cluster.replicas["small-0"]
    assert record.placement.node_ids == ("node-2",)
    assert record.state == "starting"


def test_gone_shard_after_agent_restart_is_a_failure():
    """An agent that applied a revision but no longer reports the shard (it restarted) fails the replica."""
    h = Harness()
    h.join("node-1")
    h.apply()
    h.sync_all()
    h.run_all("small-0")
    h.states["node-1"].clear()
    h.sync("node-1")
    record = h.cluster.replicas["small-0"]
    assert record.state == "backoff"
    assert "is gone from node-1" in record.reason


def test_drain_keeps_the_ready_count():
    """Drain brings each replacement to ready before the original stops; the node ends with nothing."""
    h = Harness()
    h.join("node-1")
    h.join("node-2")
    h.apply()
    h.sync_all()
    h.run_all("small-0")
    source = h.cluster.replicas["small-0"].placement.rank0.node_id
    h.cluster.set_cordon(source, True, h.now, drain=True)
    reconcile(h.cluster, h.now)
    h.sync_all()
    ready = lambda: len(views.route_table(h.cluster).routes.get("small", ()))  # noqa: E731
    assert ready() == 1
    replacement = next(r for r in h.cluster.replicas.values() if r.placement.replaces == "small-0")
    assert source not in replacement.placement.node_ids
    h.sync_all()
    assert "small-0" in h.cluster.replicas, "original stopped before its replacement was ready"
    h.run_all(replacement.id)
    assert ready() == 1
    h.sync_all()
    assert "small-0" not in h.cluster.replicas
    assert not any(source in r.placement.node_ids for r in h.cluster.replicas.values())
    assert h.cluster.nodes[source].cordoned and not h.cluster.nodes[source].draining
    assert views.desired_for(h.cluster, source) == ()


async def test_state_survives_a_restart(open_test_store):
    """Flushed state loads back: catalog, replicas with their attempts, nodes not lost at once."""
    h = Harness()
    h.join("node-1")
    h.apply()
    h.sync_all()
    h.run_all("small-0")
    store = open_test_store()
    await store.write(lambda conn: flush(conn, h.cluster, h.now))
    later = h.now + 3600
    loaded = await store.run(lambda conn: load_cluster(conn, h.cluster.settings, ENGINES, later))
    store.close()
    assert loaded.catalog == h.cluster.catalog
    assert loaded.replicas["small-0"].placement == h.cluster.replicas["small-0"].placement
    assert loaded.replicas["small-0"].attempt == h.cluster.replicas["small-0"].attempt
    assert loaded.revision > h.cluster.revision - 1
    reconcile(loaded, later)
    assert not loaded.nodes["node-1"].lost
    assert views.desired_for(loaded, "node-1") == views.desired_for(h.cluster, "node-1")


async def test_events_are_bounded_to_the_newest(open_test_store, monkeypatch):
    """The store keeps the newest MAX_EVENTS events; older ones go as new ones are flushed."""
    monkeypatch.setattr(persist, "MAX_EVENTS", 5)
    h = Harness()
    store = open_test_store()
    try:
        for i in range(12):
            h.cluster.record_event(h.now, "node", f"node-{i}", "registered")
            await store.write(lambda conn: flush(conn, h.cluster, h.now))
        listed = await store.run(lambda conn: persist.recent_events(conn, 0, 100))
    finally:
        store.close()
    assert [e.subject for e in listed.events] == [f"node-{i}" for i in range(7, 12)]


async def test_state_dir_from_schema_2_is_migrated_and_loads(tmp_path):
    """A state dir written before the dead storage was dropped (schema 2) migrates and still loads.

    Schema 3 drops the ``observed`` table and ``catalog.data``: both were
    written or created, never read.
    """
    import json
    import sqlite3

    from llmgw.server.persist.sqlite import MIGRATIONS, schema_version
    from llmgw.wire import to_json

    text = CATALOG.format(big=0)
    old = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    for script in MIGRATIONS[:2]:
        old.executescript(script)
    old.execute("PRAGMA user_version = 2")
    old.execute(
        "INSERT INTO catalog (revision, text, data, applied_at) VALUES (3, ?, ?, 900)",
        (text, json.dumps(to_json(parse_catalog(text, ENGINES)))),
    )
    old.execute(
        "INSERT INTO nodes (node_id, address, facts, port_range, cordoned, first_seen, last_seen)"
        " VALUES ('node-1', '127.0.0.2', ?, '[20000, 20999]', 1, 900, 950)",
        (json.dumps(to_json(facts("node-1"))),),
    )
    old.execute("INSERT INTO observed VALUES ('node-1', 'small-0/1/r0', '{}', 950)")
    old.close()

    store = open_store(tmp_path)
    try:
        assert await store.run(schema_version) == len(MIGRATIONS)
        tables = await store.run(
            lambda conn: {
                row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        )
        columns = await store.run(lambda conn: [row[1] for row in conn.execute("PRAGMA table_info(catalog)")])
        loaded = await store.run(lambda conn: load_cluster(conn, Settings(), ENGINES, 1000.0))
        assert "observed" not in tables
        assert "data" not in columns
        assert loaded.catalog_revision == 3 and loaded.catalog == parse_catalog(text, ENGINES)
        assert loaded.nodes["node-1"].cordoned and loaded.nodes["node-1"].facts == facts("node-1")
        loaded.apply_catalog(loaded.catalog, text, 1000.0)
        await store.write(lambda conn: flush(conn, loaded, 1000.0))
    finally:
        store.close()


def test_placement_waits_until_every_node_checked_the_sources():
    """After a catalog change, replicas are placed once every node said which sources it has, spread."""
    h = Harness()
    h.join("node-1")
    h.join("node-2")
    text = CATALOG.format(big=0).replace("profile: one", "profile: one\n    replicas: 2")
    h.cluster.apply_catalog(parse_catalog(text, ENGINES), text, h.now)
    reconcile(h.cluster, h.now)
    assert h.cluster.replicas == {}, "placed before the nodes were asked about the sources"
    h.sync("node-1")
    assert h.cluster.replicas == {}, "placed before node-2 answered"
    h.sync("node-2")
    nodes = sorted(r.placement.rank0.node_id for r in h.cluster.replicas.values())
    assert nodes == ["node-1", "node-2"]


def test_unplaceable_replica_has_a_reason():
    """A replica no node can take is listed with the reason."""
    h = Harness()
    h.join("island")
    h.apply(big=1)
    assert [u.id for u in h.cluster.unplaced] == ["big-0"]
    assert "island" in h.cluster.unplaced[0].reason


def test_many_unplaceable_replicas_are_one_event():
    """500 replicas no node can take are one event for their model, with the count; one alone keeps its id."""
    h = Harness()
    h.join("island")
    h.cluster.take_events()
    h.apply(big=500)
    unplaced = [e for e in h.cluster.take_events() if "cannot be placed" in e.message]
    assert len(h.cluster.unplaced) == 500
    assert [(e.kind, e.subject) for e in unplaced] == [("model", "big")]
    assert unplaced[0].message.startswith("500 replicas (big-0 … big-499) cannot be placed: ")
    h.apply(big=1)
    h.cluster.take_events()
    h.apply(big=2)
    assert [(e.kind, e.subject) for e in h.cluster.take_events() if "cannot be placed" in e.message] == [
        ("replica", "big-1")
    ]


@pytest.mark.parametrize("state", ["exited", "unhealthy"])
def test_worker_failure_takes_down_every_shard(state):
    """A failing worker shard stops the whole replica: no node keeps a shard of it."""
    h = Harness.running_big()
    worker = h.cluster.replicas["big-0"].placement.shards[1].node_id
    h.set_state(worker, "big-0", state)
    h.sync(worker)
    shards = [s for n in ("a1", "a2") for s in views.desired_for(h.cluster, n)]
    assert not any(s.replica_id == "big-0" for s in shards)


def test_a_heartbeat_asks_for_no_reconcile_and_steady_state_schedules_nothing():
    """Syncs that change nothing cost no reconcile; a reconcile with nothing new runs no schedule."""
    h = Harness()
    h.join("node-1")
    h.apply()
    h.run_all("small-0")
    request = SyncRequest(
        node_id="node-1",
        address=h._addresses["node-1"],
        facts=facts("node-1"),
        port_range=(20000, 20999),
        observed=list(h.states["node-1"].values()),
        revision=h.revisions["node-1"],
        checked_sources=h.cluster.sources_to_check(),
    )
    assert h.cluster.sync(request, h.now + 1) is False, "a plain heartbeat asked for a reconcile"
    plan, before = begin(h.cluster, h.now + 1)
    assert plan is None, "nothing changed, yet the reconciler would schedule"
    assert finish(h.cluster, h.now + 1, before) == frozenset()
    gpus = [attrs.evolve(g, memory_free_mib=1) for g in facts("node-1").gpus]
    fresher = attrs.evolve(facts("node-1"), gpus=gpus)
    assert h.cluster.sync(attrs.evolve(request, facts=fresher), h.now + 2) is False, "free memory moved"
    stopped = [attrs.evolve(s, state="exited", exit_code=1) for s in request.observed]
    assert h.cluster.sync(attrs.evolve(request, observed=stopped), h.now + 3) is True


def test_repeated_refusals_are_one_event_with_a_count():
    """A node retrying a refused sync every 30 s makes one event per 10 minutes, saying how many it folds."""
    cluster = ClusterState()
    for second in range(0, 1200, 30):
        message = "sync refused: certificate is for 'node-1'"
        cluster.record_event(1000.0 + second, "refusal", "node-9", message)
    cluster.record_event(1000.0, "node", "node-1", "cordoned")
    cluster.record_event(1001.0, "node", "node-1", "cordoned")
    events = cluster.take_events()
    refusals = [e.message for e in events if e.kind == "refusal"]
    assert len(refusals) == 2
    assert refusals[1].startswith("sync refused: certificate is for 'node-1' (19 more since ")
    operator = [e.message for e in events if e.kind == "node"]
    assert operator == ["cordoned", "cordoned"], "operator actions are never folded"


async def test_events_older_than_the_retention_are_deleted(open_test_store):
    """Events past persist.MAX_EVENT_AGE are deleted at the next flush that stores an event."""
    store = open_test_store()
    try:
        cluster = ClusterState()
        cluster.record_event(1000.0, "node", "node-1", "old")
        await store.write(lambda conn: flush(conn, cluster, 1000.0))
        later = 1000.0 + persist.MAX_EVENT_AGE + 1
        cluster.record_event(later, "node", "node-1", "new")
        await store.write(lambda conn: flush(conn, cluster, later))
        events = await store.run(lambda conn: persist.recent_events(conn, 0, 100))
        assert [e.message for e in events.events] == ["new"]
    finally:
        store.close()
def test_profile_timings_reach_the_agent_and_the_ready_deadline():
    """A profile's ready_timeout and stop_grace go out with its shards; its replica fails at that timeout."""
    h = Harness()
    h.join("node-1")
    text = CATALOG.format(big=0).replace(
        "gpus_per_node: 2", "gpus_per_node: 2\n    ready_timeout: 90\n    stop_grace: 7"
    )
    h.cluster.apply_catalog(parse_catalog(text, ENGINES), text, h.now)
    reconcile(h.cluster, h.now)
    h.sync_all()
    [shard] = views.desired_for(h.cluster, "node-1")
    assert (shard.ready_timeout, shard.stop_grace) == (90.0, 7.0)
    h.now += 89
    h.sync_all()
    assert h.cluster.replicas["small-0"].state == "starting"
    h.now += 2
    h.sync_all()
    record = h.cluster.replicas["small-0"]
    assert record.state == "backoff" and record.reason == "not ready within 90 s"


def test_profile_without_timings_gets_the_defaults():
    """A profile that sets neither gets the server's ready timeout (600 s) and a 30 s stop grace."""
    h = Harness()
    h.join("node-1")
    h.apply()
    [shard] = views.desired_for(h.cluster, "node-1")
    assert (shard.ready_timeout, shard.stop_grace) == (600.0, 30.0)
