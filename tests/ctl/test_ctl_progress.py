"""What `ctl apply --wait` counts as done, and how `ctl diff` prints a diff."""

from __future__ import annotations

import attrs

from llmgw.ctl.catalog import diff_lines, replica_progress
from llmgw.wire import CatalogChange, CatalogDiff, ReplicaList, ReplicaStatus, UnplacedStatus


def replica(rid: str, model: str, state: str, replaces: str | None = None) -> ReplicaStatus:
    return ReplicaStatus(rid, model, state, 1, 0, None, None, replaces)


class TestReplicaProgress:
    """replica_progress counts per model from the catalog, not from the replicas that exist."""

    def test_replicas_not_placed_yet_are_not_ready(self):
        """5 of 6 ready with the sixth not placed yet is not done (the bug `apply --wait` had)."""
        data = ReplicaList(replicas=tuple(replica(f"a-{i}", "a", "ready") for i in range(5)))
        lines, waiting = replica_progress(data, {"a": 6})
        assert lines == ["a: 5/6 ready (1 not placed yet)"] and waiting == lines

    def test_every_replica_ready_is_done(self):
        """Every model at its count, all ready: nothing waiting."""
        data = ReplicaList(replicas=(replica("a-0", "a", "ready"), replica("b-0", "b", "ready")))
        lines, waiting = replica_progress(data, {"a": 1, "b": 1})
        assert lines == ["a: 1/1 ready", "b: 1/1 ready"] and waiting == []

    def test_a_model_with_no_replica_yet_is_waited_for(self):
        """A new model none of whose replicas exist yet is 0/N, with the unplaced ones named."""
        data = ReplicaList(unplaced=(UnplacedStatus("new-0", "new", "no node has 8 free GPUs"),))
        lines, waiting = replica_progress(data, {"new": 2})
        assert lines == ["new: 0/2 ready (1 cannot be placed, 1 not placed yet)"] and waiting

    def test_drain_replacements_are_not_counted(self):
        """A drain's replacement does not stand in for a replica of the catalog."""
        data = ReplicaList(replicas=(replica("a-0", "a", "ready"), replica("a-1", "a", "starting", "a-0")))
        assert replica_progress(data, {"a": 1}) == (["a: 1/1 ready"], [])

    def test_removed_models_must_be_gone(self):
        """Replicas of a model the catalog removed keep it waiting until they are gone."""
        data = ReplicaList(replicas=(replica("old-0", "old", "ready"),))
        lines, waiting = replica_progress(data, {})
        assert lines == waiting == ["old: removed, 1 replica still stopping"]

    def test_failures_and_starts_are_named(self):
        """Starting and failed replicas are counted apart."""
        data = ReplicaList(replicas=(replica("a-0", "a", "starting"), replica("a-1", "a", "backoff")))
        assert replica_progress(data, {"a": 2})[0] == ["a: 0/2 ready (1 starting, 1 failed, rebuilding)"]

    def test_outdated_replicas_are_not_done(self):
        """A ready replica still running the old command is being rolled: not done yet."""
        outdated = attrs.evolve(replica("a-1", "a", "ready"), outdated=True)
        data = ReplicaList(replicas=(replica("a-0", "a", "ready"), outdated))
        assert replica_progress(data, {"a": 2}) == (["a: 1/2 ready (1 outdated, rolling)"],) * 2


def test_diff_lines_for_no_change():
    """An empty diff says so, with the revision compared against."""
    assert diff_lines(CatalogDiff(revision=4)) == ["no change against catalog revision 4"]


def test_diff_lines_show_outdated_replicas():
    """Outdated replicas are said to run the old command until replaced."""
    change = CatalogChange("model", "a", "changed", ("source: /a -> /b",), outdated=2)
    assert diff_lines(CatalogDiff(1, (change,)))[1:] == [
        "  ~ model a: changed: 2 outdated (to roll: each replaced once its replacement is ready)",
        "      source: /a -> /b",
    ]
