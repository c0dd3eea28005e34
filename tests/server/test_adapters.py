"""The adapter controller, driven step by step: a held request loads its adapter where it costs least, the
routes feed says where each is loaded, pressure unloads the least recently used, a failure is reported."""

from __future__ import annotations

from llmgw_engine_sim import SimEngine

from llmgw.server.reconciler import reconcile
from llmgw.server.state.records import EventKind
from llmgw.server.views import cluster as views
from llmgw.server.views.adapters import adapter_list, desired_adapters
from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.stepped import SteppedFleet
from llmgw.wire import AdapterActivity, AdapterCause, AdapterState, ObservedAdapter, ObservedShard

ENGINES = {"sim": SimEngine()}
CATALOG = catalog_yaml(
    {"chat": model("/models/chat", replicas=2, adapters={name: f"/adapters/{name}" for name in "abcde"})},
    one=sim_profile(1, max_adapters=2),
)


class Fleet(SteppedFleet):
    """Two nodes running chat-0 and chat-1, ready; agents that report the adapters the test says."""

    def __init__(self) -> None:
        super().__init__(CATALOG, ENGINES, gpus=1, sources=("/models/chat",))
        self.report("ready")
        assert sorted(self.cluster.ready_ids()) == ["chat-0", "chat-1"]
        #: replica id -> adapter -> what its agent reports
        self.reported: dict[str, dict[str, ObservedAdapter]] = {}

    def node_of(self, replica: str) -> str:
        return self.cluster.replicas[replica].placement.rank0.node_id

    def held(self, adapter: str) -> None:
        """A gateway holds a request for ``adapter``; the server runs a pass."""
        self.now += 1
        self.cluster.adapters.note_activity(
            {"chat": "chat"}, [AdapterActivity("chat", adapter, misses=1, held=1)], self.now
        )
        reconcile(self.cluster, self.now)

    def used(self, adapter: str) -> None:
        """A gateway served ``adapter`` from a loaded replica (a hit)."""
        self.now += 1
        self.cluster.adapters.note_activity(
            {"chat": "chat"}, [AdapterActivity("chat", adapter, hits=1)], self.now
        )

    def desired(self) -> dict[str, set[str]]:
        """Replica -> the adapters the server asks its agent to keep loaded."""
        out: dict[str, set[str]] = {}
        for node in self.nodes:
            for entry in desired_adapters(self.cluster, node):
                out[entry.replica_id] = set(entry.adapters)
        return out

    def agents_act(self, fail: dict[str, tuple[AdapterCause, str]] | None = None) -> None:
        """Every agent does what its sync answer says: loads (or fails ``fail``'s) and unloads."""
        fail = fail or {}
        desired = self.desired()
        self.reported = {r: held for r, held in self.reported.items() if r in self.cluster.replicas}
        for replica in sorted(self.cluster.replicas):
            attempt = self.cluster.replicas[replica].attempt
            held = self.reported.setdefault(replica, {})
            for name in list(held):
                if name not in desired.get(replica, set()):
                    del held[name]
            for name in desired.get(replica, set()):
                if name in held:
                    continue
                if name in fail:
                    cause, detail = fail[name]
                    held[name] = ObservedAdapter(
                        replica, attempt, name, AdapterState.FAILED, cause, detail, 0.1
                    )
                else:
                    held[name] = ObservedAdapter(replica, attempt, name, AdapterState.LOADED, seconds=0.5)
        self.now += 1
        for node in self.nodes:
            shards = [
                ObservedShard(s.replica_id, s.attempt, s.rank, "ready")
                for s in views.desired_for(self.cluster, node)
            ]
            mine = [
                a
                for r, names in self.reported.items()
                if r in self.cluster.replicas and self.node_of(r) == node
                for a in names.values()
            ]
            self.sync(node, shards, tuple(mine))

    def loaded(self) -> dict[str, tuple[str, ...]]:
        """Adapter -> the replicas the routes feed says have it loaded."""
        table = views.route_table(self.cluster, engines=ENGINES)
        return {name: tuple(sorted(e.loaded)) for name, e in table.adapters.items() if e.loaded}


def test_a_held_request_loads_its_adapter_and_the_routes_say_where():
    """A held request for `a` has one replica load it; once its agent reports it loaded, the routes feed
    names that replica with the sim's request fields, and an event says so."""
    fleet = Fleet()
    fleet.held("a")
    assert sum("a" in names for names in fleet.desired().values()) == 1
    assert fleet.loaded() == {}
    fleet.agents_act()
    loaded = fleet.loaded()
    assert list(loaded) == ["a"] and len(loaded["a"]) == 1
    table = views.route_table(fleet.cluster, engines=ENGINES)
    assert table.adapters["a"].loaded[loaded["a"][0]] == {"model": "a"}
    assert table.adapters["a"].model == "chat"
    kinds = [e.kind for e in fleet.cluster.event_log.take()]
    assert EventKind.ADAPTER_LOADED in kinds


def test_loads_go_to_free_slots_first():
    """Two adapters on two empty replicas: one each."""
    fleet = Fleet()
    fleet.held("a")
    fleet.held("b")
    assert sorted(len(v) for v in fleet.desired().values()) == [1, 1]


def test_pressure_unloads_the_least_used():
    """Four slots full (a, b, c, d); c, a, b used since: e replaces d, the one used least."""
    fleet = Fleet()
    for name in "abcd":
        fleet.held(name)
        fleet.agents_act()
    assert set(fleet.loaded()) == set("abcd")
    for name in "cab":
        fleet.used(name)
    fleet.held("e")
    assert "d" not in fleet.loaded(), "the evicted adapter leaves the routes at once"
    fleet.agents_act()
    assert set(fleet.loaded()) == set("abce")
    kinds = [e.kind for e in fleet.cluster.event_log.take()]
    assert EventKind.ADAPTER_UNLOADED in kinds


def test_a_failed_load_is_in_the_routes_with_its_cause_and_the_replica_keeps_the_others():
    """`b` fails to load: the routes feed carries the failure (cause, detail, a count that moves) and the
    replica keeps `a`; `ctl adapters` shows the failure."""
    fleet = Fleet()
    fleet.held("a")
    fleet.agents_act()
    fleet.held("b")
    fleet.agents_act(fail={"b": (AdapterCause.REFUSED, "LoRA rank 64 is greater than max_lora_rank 16.")})
    table = views.route_table(fleet.cluster, engines=ENGINES)
    failure = table.adapters["b"].failure
    assert failure is not None
    assert (failure.cause, failure.count) == (AdapterCause.REFUSED, 1)
    assert "max_lora_rank" in failure.detail
    assert fleet.loaded() == {"a": fleet.loaded()["a"]}
    assert not any("b" in names for names in fleet.desired().values()), "the failed adapter is let go"
    fleet.held("b")
    fleet.agents_act(fail={"b": (AdapterCause.REFUSED, "again")})
    table = views.route_table(fleet.cluster, engines=ENGINES)
    assert table.adapters["b"].failure.count == 2, "a second failure moves the count (held requests answered)"
    status = {s.adapter: s for s in adapter_list(fleet.cluster, "chat").adapters}
    assert (status["b"].failures, status["a"].loads) == (2, 1)


def test_a_replica_that_fails_holds_nothing_and_another_loads_on_demand():
    """The replica with `a` exits: `a` leaves the routes and its desired set; a new request has the other
    replica load it (the restarted one starts empty: tests/e2e shows it loading again)."""
    fleet = Fleet()
    fleet.held("a")
    fleet.agents_act()
    replica = fleet.loaded()["a"][0]
    node = fleet.node_of(replica)
    shards = [
        ObservedShard(
            s.replica_id, s.attempt, s.rank, "exited" if s.replica_id == replica else "ready", exit_code=1
        )
        for s in views.desired_for(fleet.cluster, node)
    ]
    fleet.sync(node, shards)
    assert fleet.loaded() == {}
    assert replica not in fleet.desired()
    fleet.reported.pop(replica, None)  # the engine that held `a` is gone
    fleet.held("a")
    fleet.agents_act()
    assert list(fleet.loaded()) == ["a"]
    assert fleet.loaded()["a"] != (replica,)


def test_a_hot_adapter_gets_a_second_copy():
    """`a` takes every request lately: the other replica loads it too, and the routes name both."""
    fleet = Fleet()
    fleet.held("a")
    fleet.agents_act()
    fleet.now += 1
    fleet.cluster.adapters.note_activity(
        {"chat": "chat"}, [AdapterActivity("chat", "a", hits=100)], fleet.now
    )
    reconcile(fleet.cluster, fleet.now)
    assert sorted(r for r, names in fleet.desired().items() if "a" in names) == ["chat-0", "chat-1"]
    fleet.agents_act()
    assert fleet.loaded()["a"] == ("chat-0", "chat-1")
