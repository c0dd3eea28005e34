"""A replica retired while ready keeps running until every gateway routes by a table without it."""

from __future__ import annotations

import attrs
from test_cluster import ENGINES, Harness  # the reconciler's step-by-step harness

from llmgw.models import Catalog
from llmgw.server.persist.cluster import flush, load_cluster
from llmgw.server.reconciler import finish, reconcile
from llmgw.server.state.gateways import GATEWAY_TTL, GatewayBook
from llmgw.server.state.records import ReplicaState
from llmgw.server.views import cluster as views


def running_small() -> Harness:
    """One node running small-0, ready."""
    h = Harness()
    h.join("node-1")
    h.apply()
    h.run_all("small-0")
    assert h.cluster.replicas["small-0"].state == "ready"
    return h


def remove_small(h: Harness) -> int:
    """Take the model out of the catalog (its replica is retired while ready): the generation without it."""
    h.cluster.apply_catalog(Catalog(h.cluster.catalog.profiles, {}), "", h.now)
    reconcile(h.cluster, h.now)
    assert "small" not in views.route_table(h.cluster).routes
    return views.route_table(h.cluster).generation


def runs_small(h: Harness) -> bool:
    return any(s.replica_id == "small-0" for s in views.desired_for(h.cluster, "node-1"))


def small_events(h: Harness) -> list[str]:
    return [e.message for e in h.cluster.take_events() if e.subject == "small-0"]


def test_the_replica_runs_on_until_every_gateway_holds_routes_without_it():
    """Two gateway processes: the replica leaves the routes at once, and its node's shards only once
    both said they route by the new generation; in milliseconds, so no event."""
    h = running_small()
    before = views.route_table(h.cluster).generation
    h.cluster.gateways.note("gw-a/1", before, h.now)
    h.cluster.gateways.note("gw-b/2", before, h.now)
    after = remove_small(h)
    assert after > before
    assert runs_small(h)
    h.now += 0.05
    h.cluster.gateways.note("gw-a/1", after, h.now)
    reconcile(h.cluster, h.now)
    assert runs_small(h), "gw-b still routes to it"
    h.cluster.gateways.note("gw-b/2", after, h.now)
    reconcile(h.cluster, h.now)
    assert not runs_small(h)
    assert not any("stopping it" in m for m in small_events(h))


def test_a_gateway_that_never_takes_the_new_routes_is_waited_for_at_most_the_bound():
    """A gateway stuck on old routes (its server went silent) holds the stop for linger_max, no longer;
    the event names the gateway."""
    h = running_small()
    h.cluster.gateways.note("gw-a/1", views.route_table(h.cluster).generation, h.now)
    remove_small(h)
    bound = h.cluster.settings.linger_max
    stuck = views.route_table(h.cluster).generation - 1
    for _ in range(int(bound) - 1):  # it keeps reporting the old routes, every second
        h.now += 1
        h.cluster.gateways.note("gw-a/1", stuck, h.now)
        reconcile(h.cluster, h.now)
        assert runs_small(h)
    h.now += 1
    reconcile(h.cluster, h.now)
    assert not runs_small(h)
    events = small_events(h)
    assert any(f"gateway gw-a/1 did not take routes without it in {bound:g} s" in m for m in events)


def test_a_gateway_gone_quiet_is_not_waited_for():
    """A gateway not heard from within GATEWAY_TTL is gone (stopped, or cut off): nothing waits for it."""
    h = running_small()
    h.cluster.gateways.note("gw-a/1", views.route_table(h.cluster).generation, h.now)
    h.now += GATEWAY_TTL
    remove_small(h)
    assert not runs_small(h)


def test_a_slow_gateway_is_an_event():
    """A gateway that took seconds to take the new routes: the event says how long the replica waited."""
    h = running_small()
    h.cluster.gateways.note("gw-a/1", views.route_table(h.cluster).generation, h.now)
    after = remove_small(h)
    h.now += 3
    h.cluster.gateways.note("gw-a/1", after, h.now)
    reconcile(h.cluster, h.now)
    assert not runs_small(h)
    assert any("the gateways took routes without it after 3.0 s; stopping it" in m for m in small_events(h))


def test_a_failed_replica_does_not_linger():
    """A replica that failed is out of the routes because it does not answer: it stops at once."""
    h = running_small()
    h.cluster.gateways.note("gw-a/1", views.route_table(h.cluster).generation, h.now)
    attempt = h.cluster.replicas["small-0"].attempt
    h.set_state("node-1", "small-0", "exited", exit_code=1)
    h.sync("node-1")
    assert not h.cluster.stopping.lingering
    assert all(s.attempt != attempt for s in views.desired_for(h.cluster, "node-1"))


def test_a_lingering_two_node_replica_then_stops_rank_0_first():
    """Scaled to 0 with a gateway behind: both shards linger; once it lets go, rank 0 stops and the
    worker is held until rank 0 is gone, as without gateways."""
    h = Harness.running_big()
    h.cluster.gateways.note("gw-a/1", views.route_table(h.cluster).generation, h.now)
    h.apply(big=0)
    rank0 = h.cluster.stopping.lingering and next(iter(h.cluster.stopping.lingering.values())).shards
    assert rank0 and sorted(s.rank for _, s in rank0) == [0, 1]
    assert not h.cluster.stopping.held
    h.cluster.gateways.note("gw-a/1", views.route_table(h.cluster).generation, h.now)
    reconcile(h.cluster, h.now)
    assert not h.cluster.stopping.lingering and len(h.cluster.stopping.held) == 1
    shards = [
        (s.rank, s.stop_after_rank0)
        for n in h.states
        for s in views.desired_for(h.cluster, n)
        if s.replica_id == "big-0"
    ]
    assert shards == [(1, True)]


def test_a_retired_replica_lingers_even_when_its_id_is_given_to_a_new_replica_at_once():
    """A drain's second move may take the id of the first move's original in the same pass: the original
    (its attempt) lingers all the same."""
    h = running_small()
    record = h.cluster.replicas["small-0"]
    h.cluster.gateways.note("gw-a/1", views.route_table(h.cluster).generation, h.now)
    before = (views.desired(h.cluster), h.cluster.ready_ids())
    h.cluster.remove("small-0", h.now, "removed")
    reused = attrs.evolve(record, attempt=h.cluster.new_attempt(), state=ReplicaState.STARTING)
    h.cluster.replicas["small-0"] = reused  # the id, given to a new replica
    finish(h.cluster, h.now, before)
    assert f"small-0/{record.attempt}" in h.cluster.stopping.lingering
    assert any(s.attempt == record.attempt for s in views.desired_for(h.cluster, "node-1"))


def test_a_server_that_just_began_to_lead_waits_for_the_gateways_it_has_not_heard_from():
    """A new leader has no report yet from the gateways that route by the last leader's tables: a replica
    retired in its first GATEWAY_TTL seconds lingers until a report says the gateway took the new routes,
    or until that window ends (then no gateway it does not know can still be alive)."""
    h = running_small()
    h.cluster.gateways = GatewayBook(started=h.now)
    after = remove_small(h)
    h.now += 1
    reconcile(h.cluster, h.now)
    assert runs_small(h), "stopped while a gateway this server never heard from may still route to it"
    h.cluster.gateways.note("gw-a/1", after, h.now)
    reconcile(h.cluster, h.now)
    assert runs_small(h), "another gateway may not have reported yet"
    h.now += GATEWAY_TTL
    reconcile(h.cluster, h.now)
    assert not runs_small(h)
    assert any("the gateways took routes without it after" in m for m in small_events(h))


def test_a_server_long_in_the_lead_with_no_gateway_stops_at_once():
    """Past its first GATEWAY_TTL seconds, a leader that heard from no gateway stops a retired replica at
    once: nothing routes to it."""
    h = running_small()
    h.cluster.gateways = GatewayBook(started=h.now - GATEWAY_TTL)
    remove_small(h)
    assert not runs_small(h)


async def test_loaded_state_is_unsure_of_the_gateways(open_test_store):
    """What a server loads to lead starts a gateway book of its own start: it has heard from no gateway."""
    h = running_small()
    store = open_test_store()
    await store.write(lambda conn: flush(conn, h.cluster, h.now))
    later = h.now + 60
    loaded = await store.run(lambda conn: load_cluster(conn, h.cluster.settings, ENGINES, later))
    store.close()
    assert loaded.gateways.unsure(later + GATEWAY_TTL - 0.1)
    assert not loaded.gateways.unsure(later + GATEWAY_TTL)
