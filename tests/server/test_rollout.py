"""Rollouts, driven step by step with a fake clock: outdated replicas, surge order, waiting, pause, undo."""

from __future__ import annotations

import pytest
from llmgw_engine_sim import SimEngine
from test_cluster import Harness  # the reconciler's step-by-step harness

import llmgw.server.reconciler
from llmgw.catalog import parse_catalog
from llmgw.errors import CatalogError
from llmgw.server.controllers.rollout.rollouts import FAILURES_TO_PAUSE, undo_refusal
from llmgw.server.persist.cluster import flush, load_cluster
from llmgw.server.persist.sqlite import open_store
from llmgw.server.reconciler import reconcile
from llmgw.server.views import cluster as views
from llmgw.server.views.rollouts import rollout_status

ENGINES = {"sim": SimEngine()}
CATALOG = """
profiles:
  one:
    engine: sim
    gpus_per_node: {gpus}
    args: {args}
  other:
    engine: sim
models:
  small:
    source: /models/small
    profile: one
    replicas: {replicas}
    rollout: {rollout}
  big:
    source: /models/big
    profile: other
"""


def text(args: str = "[]", replicas: int = 2, gpus: int = 2, rollout: str = "{}") -> str:
    return CATALOG.format(args=args, replicas=replicas, gpus=gpus, rollout=rollout)


class Rollout(Harness):
    """The cluster harness with this file's catalog, and helpers that read what agents are told."""

    def apply_text(self, catalog: str) -> None:
        self.cluster.apply_catalog(parse_catalog(catalog, ENGINES), catalog, self.now)
        reconcile(self.cluster, self.now)
        self.sync_all()

    def args_of(self, replica_id: str) -> tuple[str, ...]:
        """The extra args the replica's shards are told to run with."""
        node = self.cluster.replicas[replica_id].placement.rank0.node_id
        shard = next(s for s in views.desired_for(self.cluster, node) if s.replica_id == replica_id)
        return shard.spec.extra_args

    def ready_ids(self) -> list[str]:
        return sorted(
            r.replica for routes in views.route_table(self.cluster).routes.values() for r in routes
        )

    def status(self, model: str = "small"):
        return rollout_status(self.cluster, model).rollouts[0]

    def run_everything(self) -> None:
        for replica_id, record in list(self.cluster.replicas.items()):
            if record.state == "starting":
                self.run_all(replica_id)

    def events(self) -> list[str]:
        return [f"{e.subject}: {e.message}" for e in self.cluster.event_log.take()]


def started(nodes: int = 2, cls: type[Rollout] = Rollout, **catalog) -> Rollout:
    h = cls()
    for index in range(1, nodes + 1):
        h.join(f"node-{index}")
    h.apply_text(text(**catalog))
    h.run_everything()
    h.run_everything()
    assert all(r.state == "ready" for r in h.cluster.replicas.values())
    return h


def test_a_changed_command_leaves_replicas_outdated_running_what_they_started_with(monkeypatch):
    """New args: the running replicas are outdated (ctl replicas says so) and still told their old args."""
    h = started()
    # look before any replacement starts
    monkeypatch.setattr(llmgw.server.reconciler, "step_rollouts", lambda cluster, now: [])
    h.apply_text(text(args='["--max-tokens", "64"]'))
    listed = {r.id: r.outdated for r in views.replica_list(h.cluster).replicas}
    assert listed == {"big-0": False, "small-0": True, "small-1": True}
    assert h.args_of("small-0") == () and h.args_of("small-1") == ()


def test_a_timing_change_leaves_nothing_outdated():
    """stop_grace is not part of the command: nothing is outdated, nothing is replaced."""
    h = started()
    h.apply_text(text().replace("gpus_per_node: 2", "gpus_per_node: 2\n    stop_grace: 5"))
    assert not any(r.outdated for r in views.replica_list(h.cluster).replicas)
    assert sorted(h.cluster.replicas) == ["big-0", "small-0", "small-1"]
    assert h.status().state == "done"


def test_surge_replaces_one_at_a_time_and_never_drops_below_the_replicas_asked_for():
    """max_surge 1: one replacement at a time, placed with the new args, ready before its original stops."""
    h = started()
    h.apply_text(text(args='["--max-tokens", "64"]'))
    events = []
    for original, replacement in (("small-0", "small-2"), ("small-1", "small-0")):
        replacements = [r for r in h.cluster.replicas.values() if r.placement.replaces]
        assert [(r.id, r.placement.replaces) for r in replacements] == [(replacement, original)]
        assert h.args_of(replacement) == ("--max-tokens", "64")
        status = h.status()
        assert status.state == "rolling" and status.outdated >= 1
        assert len([r for r in h.ready_ids() if r.startswith("small")]) == 2  # both originals serve
        h.run_all(replacement)
        h.sync_all()
        assert h.cluster.replicas[replacement].placement.replaces is None  # it took its original's place
        events += h.events()
        assert f"{original}: replaced: {replacement} is ready, stopping the original" in events
    h.run_everything()
    assert sorted(h.cluster.replicas) == ["big-0", "small-0", "small-2"]
    assert all(h.args_of(r) == ("--max-tokens", "64") for r in ("small-0", "small-2"))
    assert h.status().state == "done" and h.status().updated == 2
    assert "small: done: every replica runs catalog revision 2" in events + h.events()


def test_max_surge_two_places_two_replacements_at_once():
    h = started(replicas=3, rollout="{max_surge: 2}")
    h.apply_text(text(args='["--x"]', replicas=3, rollout="{max_surge: 2}"))
    assert sorted(r.placement.replaces for r in h.cluster.replicas.values() if r.placement.replaces) == [
        "small-0",
        "small-1",
    ]


def test_no_room_to_surge_waits_and_says_why():
    """The one node is full (7 GPUs + 1 of 8): with max_unavailable 0 the rollout waits, saying why."""
    h = started(nodes=1, replicas=1, gpus=7)
    h.apply_text(text(args='["--x"]', replicas=1, gpus=7))
    h.sync_all()
    status = h.status()
    assert status.state == "waiting" and "no room to place a replacement" in status.reason
    assert "max_unavailable is 0" in status.reason and "GPU" in status.reason
    assert any("small: waits: no room" in e for e in h.events())
    assert h.ready_ids() == ["big-0", "small-0"]  # the outdated replica serves on


def test_max_unavailable_restarts_in_place_without_room():
    h = started(nodes=1, replicas=1, gpus=7, rollout="{max_surge: 0, max_unavailable: 1}")
    h.apply_text(text(args='["--x"]', replicas=1, gpus=7, rollout="{max_surge: 0, max_unavailable: 1}"))
    assert h.args_of("small-0") == ("--x",)
    assert h.cluster.replicas["small-0"].state == "starting"


def fail_replacement(h: Rollout, replacement: str) -> None:
    """The replacement's engine exits as an engine does on an unknown flag; the backoff passes."""
    node = h.cluster.replicas[replacement].placement.rank0.node_id
    detail = "sim: error: unrecognized arguments: --bogus"
    h.set_state(node, replacement, "exited", exit_code=2, detail=detail)
    h.sync_all()
    h.now += 20  # past the backoff, before the nodes are lost
    h.sync_all()


def test_failing_replacements_pause_the_rollout_and_say_what_failed():
    """Three failures in a row: paused, the replacement is stopped, the originals serve, the flag is named."""
    h = started()
    h.apply_text(text(args='["--bogus"]'))
    for _ in range(FAILURES_TO_PAUSE):
        assert h.status().state == "rolling"
        fail_replacement(h, "small-2")
    status = h.status()
    assert status.state == "paused"
    assert "small-2 failed 3 times in a row" in status.failure
    assert "node-" in status.failure and "code 2" in status.failure and "--bogus" in status.failure
    assert "ctl rollout undo small" in status.reason
    assert sorted(h.cluster.replicas) == ["big-0", "small-0", "small-1"]
    assert all(not any(s.replica_id == "small-2" for s in views.desired_for(h.cluster, n)) for n in h.states)
    assert h.ready_ids() == ["big-0", "small-0", "small-1"]
    for _ in range(5):
        h.now += 20
        h.sync_all()
    assert h.status().state == "paused" and "small-2" not in h.cluster.replicas  # nothing is retried
    # a fixed catalog resumes
    h.apply_text(text(args='["--max-tokens", "64"]'))
    assert h.status().state == "rolling"
    assert h.args_of("small-2") == ("--max-tokens", "64")


def test_launches_and_paused_rollouts_survive_a_restart(tmp_path):
    """What each replica runs is stored: after a restart old replicas are still outdated and still paused."""
    h = started()
    h.apply_text(text(args='["--bogus"]'))
    for _ in range(FAILURES_TO_PAUSE):
        fail_replacement(h, "small-2")
    store = open_store(tmp_path)
    with store._conn:
        flush(store._conn, h.cluster, h.now)
    loaded = load_cluster(store._conn, h.cluster.settings, ENGINES, h.now)
    assert loaded.replicas["small-0"].launch.profile.args == ()
    assert loaded.is_outdated(loaded.replicas["small-0"])
    assert rollout_status(loaded, "small").rollouts[0].state == "paused"
    assert loaded.rollouts.rolling == {"small"}  # no second "started" event after a restart
    # a row stored before launches were recorded runs the catalog in force
    store._conn.execute("UPDATE replicas SET launch = NULL")
    loaded = load_cluster(store._conn, h.cluster.settings, ENGINES, h.now)
    assert loaded.replicas["small-0"].launch.profile.args == ("--bogus",)
    assert not loaded.is_outdated(loaded.replicas["small-0"])


def test_rollout_keys_are_validated():
    bad = text(rollout="{max_surge: 0, max_unavailable: 0}")
    with pytest.raises(CatalogError) as caught:
        parse_catalog(bad, ENGINES)
    assert "models.small.rollout.max_unavailable: expected at least 1 when max_surge is 0" in str(
        caught.value
    )
    for rollout, message in (
        ("{max_surge: -1}", "models.small.rollout.max_surge: expected an integer >= 0, got -1"),
        (
            "{surge: 1}",
            "models.small.rollout.surge: unknown key (expected one of: max_surge, max_unavailable)",
        ),
        ("3", "models.small.rollout: expected a mapping with the keys max_surge, max_unavailable"),
    ):
        with pytest.raises(CatalogError) as caught:
            parse_catalog(text(rollout=rollout), ENGINES)
        assert message in str(caught.value)


def test_undo_is_refused_when_the_previous_revision_changes_other_models():
    before = parse_catalog(text(), ENGINES)
    after = parse_catalog(text(args='["--bogus"]'), ENGINES)
    assert undo_refusal("small", after, before, 1) is None
    assert "nothing to undo" in undo_refusal("small", before, before, 1)
    both = parse_catalog(text(args='["--bogus"]').replace("/models/big", "/models/big2"), ENGINES)
    refusal = undo_refusal("small", both, before, 1)
    assert "also differs from the catalog in force in model big" in refusal
    assert "ctl catalog --revision 1" in refusal
    shared = parse_catalog(text().replace("profile: other", "profile: one"), ENGINES)
    changed = parse_catalog(text(args='["--x"]').replace("profile: other", "profile: one"), ENGINES)
    assert "profile one (used by other models)" in undo_refusal("small", changed, shared, 1)


TWO_NODE = """
profiles:
  tp2:
    engine: sim
    nodes: 2
    gpus_per_node: 4
    args: {args}
models:
  big:
    source: /models/big
    profile: tp2
"""


def test_a_two_node_replica_is_rolled_and_its_original_stops_rank_0_first():
    """The replacement of a two-node replica is ready before the original stops; the original's worker
    is held (stop_after_rank0) while its rank 0 finishes."""
    h = Rollout()
    h.join("node-1", "ib-a")
    h.join("node-2", "ib-a")
    h.apply_text(TWO_NODE.format(args="[]"))
    h.sync_all()  # every node learns its shard
    h.run_all("big-0")
    assert h.ready_ids() == ["big-0"]
    h.apply_text(TWO_NODE.format(args='["--x"]'))
    h.sync_all()
    assert h.cluster.replicas["big-1"].placement.replaces == "big-0"
    assert h.args_of("big-1") == ("--x",) and h.ready_ids() == ["big-0"]
    h.events()
    h.run_all("big-1")  # ready: the original is retired
    assert sorted(h.cluster.replicas) == ["big-1"] and h.ready_ids() == ["big-1"]
    old = {
        n: [(s.rank, s.stop_after_rank0) for s in views.desired_for(h.cluster, n) if s.replica_id == "big-0"]
        for n in h.states
    }
    assert sorted(old.values()) == [[], [(1, True)]]  # rank 0 stops; its worker is held meanwhile
    h.sync_all()
    h.sync_all()
    assert not any(s.replica_id == "big-0" for n in h.states for s in views.desired_for(h.cluster, n))
    assert h.status("big").state == "done"
    events = [e for e in h.events() if e.startswith("big-0:")]
    assert events[0] == "big-0: replaced: big-1 is ready, stopping the original"
    assert events[1].endswith("rank 0 stopped; stopping its workers"), events


def test_a_new_shape_is_rolled_too_the_old_replicas_serve_until_replaced():
    """gpus_per_node 2 -> 3: the replicas stay (not dropped for their shape) and are replaced one by one."""
    h = started()
    h.apply_text(text(gpus=3))
    assert sorted(h.ready_ids()) == ["big-0", "small-0", "small-1"]
    replacement = h.cluster.replicas["small-2"]
    assert replacement.placement.replaces == "small-0" and len(replacement.placement.shards[0].gpus) == 3
    h.run_everything()
    h.run_everything()
    h.run_everything()
    assert h.status().state == "done"
    assert all(len(h.cluster.replicas[r].placement.shards[0].gpus) == 3 for r in ("small-0", "small-2"))


def test_a_replica_restarted_in_place_that_keeps_failing_pauses_too():
    """max_unavailable 1: one replica restarted in place fails 3 times; the other outdated one serves on."""
    rollout = "{max_surge: 0, max_unavailable: 1}"
    h = started(rollout=rollout)
    h.apply_text(text(args='["--bogus"]', rollout=rollout))
    restarted = [
        r for r in h.cluster.replicas.values() if r.placement.model == "small" and r.state != "ready"
    ]
    assert [r.id for r in restarted] == ["small-0"]
    for _ in range(FAILURES_TO_PAUSE):
        fail_replacement(h, "small-0")
    assert h.status().state == "paused" and "small-0 failed 3 times in a row" in h.status().failure
    assert "small-1" in h.ready_ids() and h.cluster.is_outdated(h.cluster.replicas["small-1"])
    # small-0 goes back to what it ran before, and serves again
    assert h.args_of("small-0") == () and h.cluster.is_outdated(h.cluster.replicas["small-0"])
    assert "small-0: back on the command it ran before the rollout, which paused" in h.events()
    h.now += 20
    h.sync_all()
    h.run_all("small-0")
    assert h.cluster.replicas["small-0"].state == "ready" and h.status().state == "paused"


def test_a_drain_while_paused_moves_replicas_on_their_own_command():
    """A paused rollout's catalog command keeps failing: a drain's replacement runs what its original runs."""
    h = started(nodes=3)
    h.apply_text(text(args='["--bogus"]'))
    for _ in range(FAILURES_TO_PAUSE):
        fail_replacement(h, "small-2")
    assert h.status().state == "paused"
    node = h.cluster.replicas["small-0"].placement.rank0.node_id
    h.cluster.set_cordon(node, True, h.now, drain=True)
    reconcile(h.cluster, h.now)
    h.sync_all()
    [moved] = [r for r in h.cluster.replicas.values() if r.placement.replaces == "small-0"]
    assert h.args_of(moved.id) == () and h.cluster.is_outdated(moved)  # not the failing --bogus
    h.run_all(moved.id)
    h.sync_all()
    assert "small-0" not in h.cluster.replicas and h.cluster.replicas[moved.id].state == "ready"
    assert h.status().state == "paused" and h.status().outdated == 2


def test_a_rollout_that_makes_no_progress_within_its_deadline_pauses():
    """progress_deadline 60 s: a replacement still not ready after it pauses the rollout, naming it."""
    h = started()
    catalog = text(args='["--max-tokens", "64"]').replace(
        "gpus_per_node: 2", "gpus_per_node: 2\n    progress_deadline: 60"
    )
    h.apply_text(catalog)
    for _ in range(5):
        h.now += 10
        h.sync_all()
        assert h.status().state == "rolling"  # small-2 starting, within the deadline
    h.now += 15
    h.sync_all()
    status = h.status()
    assert status.state == "paused", status
    assert "no replica replaced within its progress_deadline (60 s)" in status.reason
    assert status.failure.startswith("small-2 is still starting after 65 s"), status.failure
    assert sorted(h.cluster.replicas) == ["big-0", "small-0", "small-1"] and h.ready_ids() == sorted(
        h.cluster.replicas
    )
