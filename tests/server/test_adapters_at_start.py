"""Adapters on an engine that loads them only at start (llama.cpp), on the server: the launch lists every
adapter, a ready replica is routed for all of them at once with no load asked of its agent, base-model
requests get the engine's fields, and a changed set of adapters makes the replicas outdated."""

from __future__ import annotations

import attrs
from llmgw_engine_llamacpp import LlamaCppEngine

from llmgw.catalog import parse_catalog
from llmgw.server.reconciler import reconcile
from llmgw.server.state.records import EventKind, Launch
from llmgw.server.views import cluster as views
from llmgw.server.views.adapters import adapter_list, desired_adapters
from llmgw.testing.stepped import SteppedFleet
from llmgw.wire import AdapterActivity, ObservedShard, from_json, to_json

ENGINES = {"llamacpp": LlamaCppEngine()}
CATALOG = """
profiles:
  cpu: {engine: llamacpp, gpus_per_node: 0, max_adapters: 4}
models:
  tiny:
    source: /models/tiny.gguf
    profile: cpu
    replicas: 2
    adapters: {sql: seed:///adapters/sql, chat: /adapters/chat.gguf}
"""


class Fleet(SteppedFleet):
    """Two CPU nodes running tiny-0 and tiny-1 of llama.cpp."""

    def __init__(self, catalog: str = CATALOG) -> None:
        # chat: a path, needed at start
        sources = ("/models/tiny.gguf", "/adapters/chat.gguf")
        super().__init__(catalog, ENGINES, gpus=0, installed={"llamacpp": "0c1e570"}, sources=sources)

    def loaded(self) -> dict[str, tuple[str, ...]]:
        """Adapter -> the replicas the routes feed says have it loaded."""
        table = views.route_table(self.cluster, engines=ENGINES)
        return {name: tuple(sorted(e.loaded)) for name, e in table.adapters.items() if e.loaded}


def test_the_launch_lists_every_adapter_with_its_source_in_catalog_order():
    """Rank 0's launch spec carries (name, source) of every adapter, in the catalog's order (their ids)."""
    fleet = Fleet()
    shards = [s for node in fleet.nodes for s in views.desired_for(fleet.cluster, node)]
    (shard,) = [s for s in shards if s.replica_id == "tiny-0"]
    assert shard.spec.lora is not None
    assert shard.spec.lora.at_start == (("sql", "seed:///adapters/sql"), ("chat", "/adapters/chat.gguf"))


def test_a_ready_replica_is_routed_for_every_adapter_with_no_load_asked():
    """Once ready, both replicas have both adapters in the routes with llama.cpp's per-request fields;
    no agent is asked to load anything; an event per adapter and replica says it was loaded at start;
    ``ctl adapters`` shows them loaded."""
    fleet = Fleet()
    fleet.report("running")
    assert fleet.loaded() == {}, "not ready: its adapters are not routed"
    fleet.report("ready")
    assert fleet.loaded() == {"sql": ("tiny-0", "tiny-1"), "chat": ("tiny-0", "tiny-1")}
    table = views.route_table(fleet.cluster, engines=ENGINES)
    sql = {"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]}
    chat = {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]}
    assert table.adapters["sql"].loaded["tiny-0"] == sql
    assert table.adapters["chat"].loaded["tiny-1"] == chat
    assert all(desired_adapters(fleet.cluster, node) == () for node in fleet.nodes)
    events = [e for e in fleet.cluster.event_log.take() if e.kind == EventKind.ADAPTER_LOADED]
    assert sorted((e.subject, e.message) for e in events) == [
        ("tiny/chat", "loaded at start on replica tiny-0"),
        ("tiny/chat", "loaded at start on replica tiny-1"),
        ("tiny/sql", "loaded at start on replica tiny-0"),
        ("tiny/sql", "loaded at start on replica tiny-1"),
    ]
    listed = {a.adapter: a for a in adapter_list(fleet.cluster).adapters}
    assert listed["sql"].loaded == ("tiny-0", "tiny-1") and listed["sql"].loads == 2
    assert listed["sql"].loading == ()


def test_base_model_requests_get_every_adapter_at_scale_zero():
    """The routes feed gives each ready replica's base-model fields (llama.cpp: every adapter at 0)."""
    fleet = Fleet()
    fleet.report("ready")
    table = views.route_table(fleet.cluster, engines=ENGINES)
    zero = {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]}
    assert table.base_fields == {"tiny-0": zero, "tiny-1": zero}
    assert from_json(to_json(table), type(table)).base_fields == table.base_fields


def test_a_held_request_loads_nothing_and_is_satisfied():
    """A gateway holding a request for an adapter asks for no load: every ready replica has it."""
    fleet = Fleet()
    fleet.report("ready")
    fleet.now += 1
    held = [AdapterActivity("tiny", "sql", held=1)]
    fleet.cluster.adapters.note_activity({"tiny": "tiny"}, held, fleet.now)
    reconcile(fleet.cluster, fleet.now)
    assert fleet.cluster.adapters.wanted == {}
    assert fleet.cluster.adapters.desired == {}
    assert all(desired_adapters(fleet.cluster, node) == () for node in fleet.nodes)


def test_a_replica_no_longer_ready_leaves_the_adapter_routes():
    """A replica whose shard exited is no longer routed for its adapters; the other still is."""
    fleet = Fleet()
    fleet.report("ready")
    node = fleet.cluster.replicas["tiny-0"].placement.rank0.node_id
    shards = [
        ObservedShard(s.replica_id, s.attempt, s.rank, "exited" if s.replica_id == "tiny-0" else "ready")
        for s in views.desired_for(fleet.cluster, node)
    ]
    fleet.sync(node, shards)
    assert fleet.loaded() == {"sql": ("tiny-1",), "chat": ("tiny-1",)}


def test_a_changed_set_of_adapters_makes_the_replicas_outdated():
    """Adding an adapter changes llama-server's --lora arguments: the running replicas are outdated (on an
    engine loading adapters at run time it would not be)."""
    fleet = Fleet()
    fleet.report("ready")
    more = CATALOG.replace("chat: /adapters/chat.gguf}", "chat: /adapters/chat.gguf, law: /law.gguf}")
    fleet.cluster.apply_catalog(parse_catalog(more, ENGINES), more, fleet.now)
    assert fleet.cluster.is_outdated(fleet.cluster.replicas["tiny-0"])


def test_a_stored_launch_keeps_adapters_at_start():
    """A replica's recorded launch reads back with its profile's adapters_at_start; a profile without it is
    stored as before (no key)."""
    catalog = parse_catalog(CATALOG, ENGINES)
    launch = Launch.of(catalog, "tiny")
    assert launch is not None and launch.profile.adapters_at_start
    assert from_json(to_json(launch), Launch) == launch
    plain = attrs.evolve(launch.profile, adapters_at_start=False)
    assert "adapters_at_start" not in to_json(plain)


def test_reordered_adapters_keep_each_running_replicas_numbering():
    """The catalog lists chat before sql now: the running replicas are not outdated, and the routes feed
    still selects sql as id 0 on them (their own launch's order, llama-server's ids)."""
    fleet = Fleet()
    fleet.report("ready")
    before = "{sql: seed:///adapters/sql, chat: /adapters/chat.gguf}"
    swapped = CATALOG.replace(before, "{chat: /adapters/chat.gguf, sql: seed:///adapters/sql}")
    fleet.cluster.apply_catalog(parse_catalog(swapped, ENGINES), swapped, fleet.now)
    reconcile(fleet.cluster, fleet.now)
    assert not fleet.cluster.is_outdated(fleet.cluster.replicas["tiny-0"])
    table = views.route_table(fleet.cluster, engines=ENGINES)
    sql = {"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]}
    assert table.adapters["sql"].loaded["tiny-0"] == sql
