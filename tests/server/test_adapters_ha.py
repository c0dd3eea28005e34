"""LoRA adapters across a leader change: what each replica should keep and has loaded is stored with its
row, a standby's routes list it, and a new leader keeps what agents hold (stored, or adopted from their
reports) instead of having them unload everything."""

from __future__ import annotations

import logging

from llmgw.server.persist.cluster import flush, load_cluster
from llmgw.server.reconciler import reconcile
from llmgw.server.state.records import EventKind
from llmgw.server.views import cluster as views
from llmgw.wire import AdapterState, ObservedAdapter, ObservedShard
from tests.server.test_adapters import ENGINES, Fleet


def loaded_fleet() -> Fleet:
    """chat-0 and chat-1 ready, `a` and `b` loaded (one each), `c` asked for and still loading."""
    fleet = Fleet()
    fleet.held("a")
    fleet.held("b")
    fleet.agents_act()
    assert sorted(fleet.loaded()) == ["a", "b"]
    fleet.held("c")
    [replica] = [r for r, names in fleet.desired().items() if "c" in names]
    fleet.reported[replica]["c"] = ObservedAdapter(
        replica, fleet.cluster.replicas[replica].attempt, "c", AdapterState.LOADING
    )
    fleet.cluster.event_log.take()
    return fleet


async def stored(fleet: Fleet, open_test_store, *, forget_adapters: bool = False):
    """``fleet``'s cluster written to a new store and read back as a new leader (or a standby) reads it."""
    store = open_test_store()
    try:
        await store.write(lambda conn: flush(conn, fleet.cluster, fleet.now))
        if forget_adapters:  # as a store written before adapters were stored
            await store.write(lambda conn: conn.execute("UPDATE replicas SET adapters = NULL"))
        return await store.run(lambda conn: load_cluster(conn, fleet.cluster.settings, ENGINES, fleet.now))
    finally:
        store.close()


def c_loads(fleet: Fleet) -> None:
    """The load of `c` ends (loaded); its agent reports it."""
    for replica, held in fleet.reported.items():
        if "c" in held:
            held["c"] = ObservedAdapter(replica, held["c"].attempt, "c", AdapterState.LOADED, seconds=0.5)
    agents_report(fleet)


def agents_report(fleet: Fleet) -> None:
    """Every agent syncs with what it holds (shards ready, adapters as they were), before any answer."""
    fleet.now += 1
    for node in fleet.nodes:
        desired = views.desired_for(fleet.cluster, node)
        shards = [ObservedShard(s.replica_id, s.attempt, s.rank, "ready") for s in desired]
        mine = tuple(
            seen
            for replica, held in fleet.reported.items()
            if fleet.node_of(replica) == node
            for seen in held.values()
        )
        fleet.sync(node, shards, mine)


async def test_the_adapters_round_trip_through_the_store(open_test_store):
    """Desired (with sources) and routed adapters of each replica's attempt are read back as written."""
    fleet = loaded_fleet()
    before = fleet.cluster.adapters
    after = (await stored(fleet, open_test_store)).adapters
    assert after.desired == before.desired
    assert after.routed == before.routed
    assert sorted(after.adopting) == ["chat-0", "chat-1"]
    assert {c for c in after.counted} == {c for c in before.counted}


async def test_a_standbys_routes_list_the_adapters_as_the_leader_stored_them(open_test_store):
    """The routes feed built from the store (a standby's view) names where `a` and `b` are loaded."""
    fleet = loaded_fleet()
    standby = await stored(fleet, open_test_store)
    table = views.route_table(standby, engines=ENGINES)
    assert {n: sorted(e.loaded) for n, e in table.adapters.items() if e.loaded} == {
        n: list(r) for n, r in fleet.loaded().items()
    }
    assert table.adapters["a"].loaded[fleet.loaded()["a"][0]] == {"model": "a"}


async def test_a_new_leader_keeps_the_adapters_agents_hold(open_test_store):
    """A new leader's first answers ask for what the last leader's did: nothing is unloaded, no load is
    counted or announced again, and `c`, loading at the change, is counted once its load ends."""
    fleet = loaded_fleet()
    desired, routed = fleet.desired(), fleet.loaded()
    fleet.cluster = await stored(fleet, open_test_store)
    assert fleet.desired() == desired  # the answers before any agent synced
    assert fleet.loaded() == routed  # routed as stored until the agents report
    agents_report(fleet)
    assert fleet.desired() == desired and fleet.loaded() == routed
    c_loads(fleet)
    assert fleet.desired() == desired
    assert sorted(fleet.loaded()) == ["a", "b", "c"]
    events = [(e.kind, e.subject) for e in fleet.cluster.event_log.take()]
    assert events == [(EventKind.ADAPTER_LOADED, "chat/c")], events
    uses = fleet.cluster.adapters.uses
    assert uses[("chat", "c")].loads == 1 and ("chat", "a") not in uses


async def test_a_new_leader_adopts_what_agents_report_when_the_store_holds_nothing(open_test_store, caplog):
    """Rows without adapters (stored before them): once the rank-0 node synced, the adapters its agent
    reports loaded or loading are adopted, routed and kept; none is unloaded."""
    fleet = loaded_fleet()
    desired, routed = fleet.desired(), fleet.loaded()
    fleet.cluster = await stored(fleet, open_test_store, forget_adapters=True)
    assert fleet.desired() == {} and fleet.loaded() == {}
    agents_report(fleet)
    assert fleet.desired() == desired
    assert fleet.loaded() == routed
    assert fleet.cluster.adapters.adopting == set()
    c_loads(fleet)
    assert sorted(fleet.loaded()) == ["a", "b", "c"]
    kept = [e.subject for e in fleet.cluster.event_log.take() if "adopted" in e.message]
    assert sorted(kept) == ["chat/a", "chat/b", "chat/c"]


async def test_after_adoption_an_adapter_reported_and_not_desired_is_unloaded(open_test_store):
    """Adoption happens once per replica: an eviction afterwards is not undone by the agent's report."""
    fleet = loaded_fleet()
    fleet.cluster = await stored(fleet, open_test_store)
    c_loads(fleet)
    for name in ("d", "e"):  # both replicas full: each load evicts one
        fleet.now += 5
        fleet.held(name)
        fleet.agents_act()
    reconcile(fleet.cluster, fleet.now)
    held = {name for names in fleet.desired().values() for name in names}
    assert {"d", "e"} <= held and len(held) == 4


async def test_stored_adapters_that_do_not_read_are_skipped_with_a_warning(open_test_store, caplog):
    """A column that is not what was written: the replica starts with no adapters, and the log says why."""
    fleet = loaded_fleet()
    store = open_test_store()
    try:
        await store.write(lambda conn: flush(conn, fleet.cluster, fleet.now))
        await store.write(lambda conn: conn.execute("UPDATE replicas SET adapters = '{\"attempt\": \"x\"}'"))
        with caplog.at_level(logging.WARNING, "llmgw.server"):
            cluster = await store.run(lambda c: load_cluster(c, fleet.cluster.settings, ENGINES, fleet.now))
    finally:
        store.close()
    assert cluster.adapters.desired == {} and cluster.adapters.routed == {}
    assert "stored adapters not read" in caplog.text


async def test_adoption_keeps_adapters_of_the_replicas_model_within_its_slots(open_test_store):
    """An agent reporting more than its replica's slots, and an adapter the catalog does not have: the
    loaded ones of the model are adopted first, up to `max_adapters` (2); the rest is unloaded."""
    fleet = loaded_fleet()
    fleet.cluster = await stored(fleet, open_test_store, forget_adapters=True)
    replica = "chat-0"
    attempt = fleet.cluster.replicas[replica].attempt
    fleet.reported = {
        replica: {
            name: ObservedAdapter(replica, attempt, name, state)
            for name, state in (
                ("zzz", AdapterState.LOADED),
                ("b", AdapterState.LOADING),
                ("d", AdapterState.LOADED),
                ("e", AdapterState.LOADED),
            )
        }
    }
    agents_report(fleet)
    assert fleet.desired() == {replica: {"d", "e"}}
    assert fleet.loaded() == {"d": (replica,), "e": (replica,)}
