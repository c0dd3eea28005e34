"""An agent restarted on purpose (or killed and started again) costs its replicas no failure."""

from __future__ import annotations

import attrs
from test_cluster import Harness  # the reconciler's step-by-step harness
from test_rollout import Rollout, started, text

from llmgw.server.controllers.rollout.rollouts import FAILURES_TO_PAUSE
from llmgw.server.views import cluster as views
from llmgw.wire import PREVIOUS_AGENT_EXIT, SyncRequest
from llmgw.wire.causes import FailureCause


class Agents:
    """Harness mix-in: every sync carries its agent's instance; agents can leave and restart."""

    def sync(self, node_id: str, *, leaving: bool = False) -> None:
        instances = self.__dict__.setdefault("instances", {})
        instance = instances.setdefault(node_id, f"{node_id}-agent-1")
        original = self.cluster.sync

        def sync(request: SyncRequest, now: float) -> bool:
            return original(attrs.evolve(request, instance=instance, leaving=leaving), now)

        self.cluster.sync = sync
        try:
            super().sync(node_id)
        finally:
            self.cluster.sync = original

    def leave(self, node_id: str) -> None:
        """The agent's farewell on SIGTERM, sent before it stops any shard; it applies no reply."""
        self.now += 1
        states, revision = dict(self.states[node_id]), self.revisions[node_id]
        self.sync(node_id, leaving=True)
        self.states[node_id], self.revisions[node_id] = states, revision

    def restart(self, node_id: str) -> None:
        """A new agent process: a new instance, revision 0, its predecessor's shards reported exited."""
        self.now += 1
        number = int(self.instances[node_id].rpartition("-")[2]) + 1
        self.instances[node_id] = f"{node_id}-agent-{number}"
        self.revisions[node_id] = 0
        for key, shard in self.states[node_id].items():
            detail = f"{PREVIOUS_AGENT_EXIT} (pid 1); it starts again"
            cause = FailureCause.PREVIOUS_AGENT
            self.states[node_id][key] = attrs.evolve(shard, state="exited", detail=detail, cause=cause)
        self.sync(node_id)


class ClusterState(Agents, Harness):
    pass


class RollingCluster(Agents, Rollout):
    pass


def two_models() -> ClusterState:
    """node-1 and node-2 on one fabric: small-0 and the two-node big-0, both ready."""
    h = ClusterState.running_big(("node-1", "node-2"))
    h.run_all("small-0")
    assert {r.id: r.state for r in h.cluster.replicas.values()} == {"small-0": "ready", "big-0": "ready"}
    return h


def no_failures(h: Harness) -> None:
    for record in h.cluster.replicas.values():
        assert (record.failures, record.consecutive_failures) == (0, 0), record
    events = [e.message for e in h.cluster.event_log.take()]
    assert not [m for m in events if m.startswith("failed")], events


def test_a_leaving_agent_starts_its_replicas_again_without_a_failure():
    """The farewell: big-0 leaves the routes at once and starts again when the new agent is back."""
    h = two_models()
    big = h.cluster.replicas["big-0"]
    attempt = big.attempt
    worker = next(s.node_id for s in big.placement.shards if s.rank == 1)
    h.leave(worker)
    assert big.state == "starting" and big.attempt != attempt
    assert big.reason == f"the agent of {worker} is stopping"
    assert "big" not in views.route_table(h.cluster).routes
    events = [f"{e.subject}: {e.message}" for e in h.cluster.event_log.take()]
    assert f"big-0: starting again: the agent of {worker} is stopping (not counted as a failure)" in events
    assert any(e.startswith(f"{worker}: its agent is stopping on purpose") for e in events), events
    restarted = big.attempt
    h.restart(worker)
    h.sync_all()
    assert big.attempt == restarted, "the new agent's first sync starts nothing again"
    h.run_all("big-0")
    assert big.state == "ready" and h.cluster.replicas["small-0"].state == "ready"
    no_failures(h)


def test_an_agent_killed_and_started_again_is_no_failure_either():
    """No farewell: a new instance reporting its predecessor's shards exited restarts them, no backoff."""
    h = two_models()
    for node in ("node-1", "node-2"):
        attempts = {r.id: r.attempt for r in h.cluster.replicas.values()}
        h.restart(node)
        on_node = {r.id for r in h.cluster.replicas.values() if node in r.placement.node_ids}
        for replica_id in on_node:
            record = h.cluster.replicas[replica_id]
            assert record.state == "starting" and record.attempt != attempts[replica_id]
            assert record.reason == f"the agent of {node} restarted"
        h.sync_all()
        for replica_id in on_node:
            h.run_all(replica_id)
        assert all(r.state == "ready" for r in h.cluster.replicas.values())
    no_failures(h)
    # a real failure afterwards still counts
    node = h.cluster.replicas["small-0"].placement.rank0.node_id
    h.set_state(node, "small-0", "exited", exit_code=1)
    h.sync(node)
    assert h.cluster.replicas["small-0"].state == "backoff" and h.cluster.replicas["small-0"].failures == 1


def test_agent_restarts_under_a_replacement_do_not_pause_its_rollout():
    """A replacement whose agent restarts again and again is started again each time; the rollout rolls on."""
    h = started(cls=RollingCluster)
    h.apply_text(text(args='["--max-tokens", "64"]'))
    replacement = h.cluster.replicas["small-2"]
    node = replacement.placement.rank0.node_id
    for _ in range(FAILURES_TO_PAUSE + 1):
        h.leave(node)
        h.restart(node)
        h.sync_all()
        assert h.status().state == "rolling" and replacement.consecutive_failures == 0
    h.run_everything()
    h.run_everything()
    assert h.status().state == "done"
    assert all(r.failures == 0 for r in h.cluster.replicas.values())


def test_a_failure_while_the_killed_agent_was_gone_is_taken_back():
    """kill -9 of big-0's worker's agent: rank 0 exits on the lost peer; the new agent takes it back."""
    h = two_models()
    big = h.cluster.replicas["big-0"]
    rank0, worker = (s.node_id for s in big.placement.shards)
    h.now += 3
    h.set_state(rank0, "big-0", "exited", exit_code=1, detail="peer lost: rank 1: connection closed")
    h.sync(rank0)
    assert big.state == "backoff" and big.failures == 1
    h.restart(worker)
    assert big.state == "starting" and (big.failures, big.consecutive_failures) == (0, 0)
    events = [e.message for e in h.cluster.event_log.take()]
    assert any(
        m.startswith(f"starting again: the agent of {worker} restarted; its failure (") for m in events
    )
    h.sync_all()
    h.run_all("big-0")
    assert big.state == "ready" and big.failures == 0


def test_a_shard_the_leaving_agent_started_late_and_its_successor_ended_is_no_failure():
    """The old agent started the new attempt before it left; the new agent reports it exited: no failure."""
    h = two_models()
    node = h.cluster.replicas["small-0"].placement.rank0.node_id
    h.now += 1
    h.sync(node, leaving=True)  # this time the reply (small-0's new attempt) is applied before it stops
    attempt = h.cluster.replicas["small-0"].attempt
    h.restart(node)
    small = h.cluster.replicas["small-0"]
    assert small.state == "starting" and small.attempt != attempt and small.failures == 0
    h.sync_all()
    h.run_all("small-0")
    assert small.state == "ready"
    no_failures(h)
