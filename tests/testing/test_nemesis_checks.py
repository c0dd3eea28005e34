"""The nemesis's checkers catch bad histories (and pass good ones); its schedule is the seed's alone."""

from __future__ import annotations

import time

import pytest

from llmgw.testing.nemesis import Fault, FaultKind, Injector, PlannedFault, parse_kinds, schedule
from llmgw.testing.nemesis_checks import (
    Acquire,
    Claim,
    EngineFailure,
    FinalState,
    Invariant,
    LostNode,
    ManifestMade,
    ReplicaRun,
    StoreWrite,
    check_converged,
    check_engine_failures,
    check_leadership,
    check_lost_nodes,
    check_manifests,
    check_writes,
)
from llmgw.testing.nemesis_requests import FailedRequest, check_requests

T = 1_000_000.0


def test_two_servers_claiming_one_epoch_is_caught_in_logs_and_store():
    claims = [Claim("server-a", 1, T), Claim("server-b", 1, T + 0.01), Claim("server-b", 2, T + 30)]
    acquires = [Acquire("server-a", 1, T), Acquire("server-b", 1, T + 0.005)]
    found = check_leadership(claims, acquires)
    assert [v.invariant for v in found] == [Invariant.ONE_HOLDER] * 2
    assert "epoch 1 held by server-a at" in found[0].text and "server-b" in found[0].text
    assert "(server logs)" in found[0].text and "(the store's log)" in found[1].text
    assert check_leadership([Claim("server-a", 1, T), Claim("server-b", 2, T + 9)]) == []


def test_a_write_after_another_server_took_the_lease_is_caught():
    acquires = [Acquire("server-a", 1, T), Acquire("server-b", 2, T + 10)]
    good = [StoreWrite("server-a", T + 5), StoreWrite("server-b", T + 11)]
    assert check_writes(acquires, good) == []
    (bad,) = check_writes(acquires, [*good, StoreWrite("server-a", T + 12)])
    assert bad.invariant is Invariant.FENCED_WRITES
    assert bad.text.startswith("write by server-a (epoch 1) after server-b took epoch 2")


def test_a_manifest_replaced_by_an_empty_holder_and_a_replica_on_other_files_are_caught():
    truth = {"seed:///m": "660b" + "0" * 60}
    made = [
        ManifestMade("seed:///m", "node-1", "660b00000000", 2, T),
        ManifestMade("seed:///m", "node-2", "e3b0c4429", 0, T + 0.5),
    ]
    runs = [
        ReplicaRun("m-0", "node-1", "seed:///m", "/a", truth["seed:///m"], T + 3),
        ReplicaRun("m-1", "node-2", "seed:///m", "/b", "e3b0" + "1" * 60, T + 4),
    ]
    found = check_manifests(made, runs, truth)
    texts = [v.text for v in found]
    assert {v.invariant for v in found} == {Invariant.SAME_FILES}
    assert any("made by node-2 lists 0 files" in t for t in texts)
    assert any("manifest of seed:///m replaced" in t for t in texts)
    assert any(t.startswith("m-1 runs on node-2") for t in texts)
    assert len(found) == 3
    assert check_manifests(made[:1], runs[:1], truth) == []
    # the folder emptied under an engine that started on the right files is no fault of llmgw's ...
    under = ReplicaRun("m-1", "node-2", "seed:///m", "/b", "e3b0" + "1" * 60, T + 4, started=T + 1)
    emptied = Fault(FaultKind.EMPTY_SEED, "node-2", T + 2, T + 20, nodes=frozenset({"node-2"}))
    assert check_manifests(made[:1], [under], truth, [emptied]) == []
    # ... but a replica started there after it was emptied runs on other files
    after = ReplicaRun("m-1", "node-2", "seed:///m", "/b", "e3b0" + "1" * 60, T + 9, started=T + 5)
    assert len(check_manifests(made[:1], [after], truth, [emptied])) == 1


def final(**changes) -> FinalState:
    values = dict(
        at=T,
        wanted={"chat": 2},
        replicas={"chat-0": ("chat", "ready"), "chat-1": ("chat", "ready")},
        unplaced={},
        engine_pids=frozenset({10, 11}),
        shard_pids=frozenset({10, 11}),
        node_states={"node-1": "ready", "node-2": "ready"},
        agents_up=frozenset({"node-1", "node-2"}),
    )
    return FinalState(**(values | changes))


def test_a_state_that_differs_from_the_catalog_is_caught():
    assert check_converged(final()) == []
    bad = final(
        replicas={"chat-0": ("chat", "backoff"), "old-0": ("old", "ready")},
        unplaced={"chat-2": "no room"},
        engine_pids=frozenset({10, 11, 99}),
        node_states={"node-1": "lost", "node-2": "ready"},
    )
    texts = [v.text for v in check_converged(bad)]
    assert texts == [
        "chat-0 is backoff",
        "chat: 1 replicas, the catalog asks for 2",
        "old: 1 replicas of a model the catalog no longer has",
        "chat-2 unplaced: no room",
        "engine pid 99 runs, and no replica's shard owns it",
        "node-1 is lost, and its agent runs and syncs",
    ]


def test_a_node_declared_lost_after_its_agent_came_back_is_caught():
    paused = Fault(FaultKind.STOP_AGENT, "node-3", T, T + 60, nodes=frozenset({"node-3"}))
    killed = Fault(FaultKind.KILL_AGENT, "node-5", T, T + 5, nodes=frozenset({"node-5"}))
    during = LostNode("node-3", T + 20, "lost: no sync for 20 s")
    at_resume = LostNode("node-3", T + 60.5, "lost: no sync for 60 s")  # the episode's end (defect 3)
    after = LostNode("node-3", T + 65, "lost: no sync for 64 s")
    elsewhere = LostNode("node-4", T + 20, "lost: no sync for 20 s")
    starting = LostNode("node-5", T + 12, "lost: no sync for 12 s")  # its new agent has not synced yet
    synced = LostNode("node-5", T + 30, "lost: no sync for 10 s")
    # node-6's new agent started before the loss but first synced 1.4 s after it: silent, rightly lost
    slow = Fault(FaultKind.KILL_AGENT, "node-6", T, T + 5, nodes=frozenset({"node-6"}))
    slow_start = LostNode("node-6", T + 10, "lost: no sync for 10 s")
    found = check_lost_nodes(
        [during, at_resume, after, elsewhere, starting, synced, slow_start],
        [paused, killed, slow],
        synced={"node-5": [T - 100, T + 14], "node-6": [T - 1, T + 11.4]},
        returned=[("node-3", T + 61), ("node-6", T + 11.4)],
    )
    assert [v.text for v in found] == [
        "node-3 lost: no sync for 60 s: its agent was back 0.5 s before (stop-agent healed); "
        "it synced again within 2 s",
        "node-3 lost: no sync for 64 s: its agent was back 5.0 s before (stop-agent healed)",
        "node-4 lost: no sync for 20 s: never stopped",
        "node-5 lost: no sync for 10 s: its agent was back 16.0 s before "
        "(kill-agent, then its new agent's first sync)",
    ]


def test_an_engine_failing_with_its_agent_or_without_any_fault_is_caught():
    killed = Fault(
        FaultKind.KILL_ENGINE, "chat-0 r0", T, T, nodes=frozenset({"node-1"}), replicas=frozenset({"chat-0"})
    )
    agent = Fault(
        FaultKind.KILL_AGENT, "node-2", T, T + 3, nodes=frozenset({"node-2"}), replicas=frozenset({"big-0"})
    )
    failures = [
        EngineFailure("chat-0", frozenset({"node-1"}), T + 2, "failed: shard r0 exited", T - 5),
        EngineFailure("big-0", frozenset({"node-2", "node-3"}), T + 1, "failed: shard r1 exited", T - 5),
        EngineFailure("chat-1", frozenset({"node-4"}), T + 200, "failed: liveness probe timed out", T - 5),
        # reported late (the control plane was down), still the kill's doing
        EngineFailure("chat-0", frozenset({"node-1"}), T + 90, "failed: shard r0 exited", T - 5),
        # the kill was before it was ready again: this failure is another one
        EngineFailure("chat-0", frozenset({"node-1"}), T + 300, "failed: shard r0 exited", T + 100),
    ]
    found = check_engine_failures(failures, [killed, agent])
    assert [v.text for v in found] == [
        "big-0 failed: shard r1 exited (faults then on its nodes: kill-agent node-2)",
        "chat-1 failed: liveness probe timed out",
        "chat-0 failed: shard r0 exited",
    ]


def test_a_failed_request_with_another_ready_replica_is_caught():
    killed = Fault(
        FaultKind.KILL_ENGINE, "chat-0 r0", T, T, nodes=frozenset({"node-1"}), replicas=frozenset({"chat-0"})
    )
    server = Fault(FaultKind.KILL_SERVER, "server-a", T + 50, T + 55)
    ready = [(T - 1, {"chat": frozenset({"chat-0", "chat-1"}), "big": frozenset({"big-0"})})]
    failed = [
        FailedRequest(
            "chat", "chat-0", T - 0.2, T + 0.1, "stream ended without [DONE]"
        ),  # on the killed engine
        FailedRequest("chat", "", T + 1, T + 1.1, "502: no replica answered"),  # chat-1 was ready
        FailedRequest("big", "", T + 52, T + 52.1, "503"),  # only a server was down
    ]
    found, explained = check_requests(failed, [killed, server], ready)
    assert len(explained) == 1 and "kill-engine chat-0 r0 hit chat-0, which served it" in explained[0]
    assert [v.invariant for v in found] == [Invariant.EXPLAINED_REQUESTS] * 2
    assert "failed with chat-1 ready; faults then: kill-engine chat-0 r0" in found[0].text
    assert "failed with big-0 ready; faults then: no fault" in found[1].text
    gateway = Fault(FaultKind.KILL_GATEWAY, "gateway", T + 100, T + 102)
    later = [
        FailedRequest("chat", "", T + 105, T + 105, "ConnectError"),
        FailedRequest("chat", "", T + 150, T + 150, "503"),
    ]
    found, explained = check_requests(later, [gateway], ready, served=[T + 99, T + 140])
    assert "kill-gateway gateway: in flight through it, or sent before it served again" in explained[0]
    assert len(found) == 1 and found[0].at == T + 150
    found, explained = check_requests(later, [gateway], ready, served=[T + 99, T + 151])
    assert found == [] and len(explained) == 2, "it had not served again: both are its fault"
    # a request another model's success came before: the routes the paused gateway holds are still old
    resumed = [FailedRequest("chat", "", T + 102.8, T + 102.8, "503: no ready replica")]
    found, explained = check_requests(resumed, [gateway], ready, served=[T + 102.05])
    assert found == [] and "kill-gateway gateway" in explained[0]
    found, _ = check_requests(
        [FailedRequest("chat", "", T + 103.5, T + 103.5, "503")], [gateway], ready, served=[T + 102.05]
    )
    assert len(found) == 1, "served again and ROUTES_LAG past its healing: no longer its fault"
    # a slow rebuild: the model had no ready replica for 40 s after its only replica's engine was killed
    slow = [(T - 1, {"chat": frozenset({"chat-0"})}), (T + 1, {}), (T + 40, {"chat": frozenset({"chat-0"})})]
    late = [
        FailedRequest("chat", "", T + 35, T + 35, "503"),
        FailedRequest("chat", "", T + 45, T + 45, "503"),
    ]
    found, explained = check_requests(late, [killed], slow)
    assert [v.at for v in found] == [T + 45] and "no other ready replica" in explained[0]
    died = EngineFailure(
        "chat-0", frozenset({"node-1"}), T + 44, "failed: shard r0 exited: ended with its agent"
    )
    found, _ = check_requests(late[1:], [], slow, engines=[died])
    assert found[0].text.endswith(
        "faults then: no fault; after chat-0 failed: shard r0 exited: ended with its agent"
    )
    only = [(T - 1, {"chat": frozenset({"chat-0"})})]
    found, explained = check_requests(failed[1:2], [killed], only)
    assert found == [] and "chat had no other ready replica" in explained[0]
    # the leader saw chat-1 ready 0.3 s before the request: too soon for the gateway's routes to name it
    fresh = [(T - 1, {"chat": frozenset({"chat-0"})}), (T + 0.7, {"chat": frozenset({"chat-0", "chat-1"})})]
    found, explained = check_requests(failed[1:2], [killed], fresh)
    assert found == [] and "chat had no other ready replica" in explained[0]
    settled = [(T - 1, {"chat": frozenset({"chat-0"})}), (T - 0.5, {"chat": frozenset({"chat-0", "chat-1"})})]
    found, _ = check_requests(failed[1:2], [killed], settled)
    assert len(found) == 1 and "failed with chat-1 ready" in found[0].text, "ready 1.5 s before: it counts"


def test_the_schedule_is_the_seeds_alone_and_mixes_kinds():
    kinds = tuple(FaultKind)
    first = schedule(7, 600, kinds)
    assert first == schedule(7, 600, kinds) != schedule(8, 600, kinds)
    assert len(first) >= 100 and len({p.kind for p in first}) >= 8
    times = [p.at for p in first]
    assert times == sorted(times) and len(set(times)) < len(times), "some faults start together"


def test_fault_kinds_are_parsed_with_a_clear_error():
    assert parse_kinds("all") == tuple(FaultKind)
    assert parse_kinds("kill-agent, drain") == (FaultKind.KILL_AGENT, FaultKind.DRAIN)
    with pytest.raises(ValueError, match="--faults: unknown fault kind 'kill-everything'; expected some of"):
        parse_kinds("kill-agent,kill-everything")


def test_the_injector_applies_in_time_heals_and_notes_what_failed():
    done: list[str] = []

    class Target:
        def apply(self, kind, pick):
            if kind is FaultKind.DRAIN:
                raise RuntimeError("no leader")
            return Fault(kind, "node-1", T + 1), lambda: done.append("healed")

    plan = [PlannedFault(1, FaultKind.STOP_AGENT, 5, 0.1), PlannedFault(2, FaultKind.DRAIN, 5, 0.5)]
    injector = Injector(Target(), plan, started=T)
    assert injector.step(T + 0.5) == []
    (stopped,) = injector.step(T + 1.5)
    assert stopped.end is None and injector.busy
    (drain,) = injector.step(T + 2.5)
    assert drain.note == "not applied: RuntimeError('no leader')"
    injector.heal_all()
    assert done == ["healed"] and stopped.end is not None and not injector.busy


def test_a_healing_that_fails_is_tried_again():
    tries: list[float] = []

    def heal() -> None:
        tries.append(1)
        if len(tries) < 3:
            raise OSError("the store is down")

    class Target:
        def apply(self, kind, pick):
            return Fault(kind, "server-a", T), heal

    injector = Injector(Target(), [PlannedFault(0, FaultKind.KILL_SERVER, 0, 0.5)], started=T)
    (fault,) = injector.step(T + 1)
    for _ in range(3):
        injector.step(time.time() + 10)
    assert len(tries) == 3 and fault.end is not None and not injector.busy
    assert fault.note.count("healing failed: OSError('the store is down')") == 2


STORE_LOG = """\
2026-12-03 17:28:30.726 UTC|server_a|s1|LOG:  duration: 0.08 ms  bind <u>: UPDATE leader SET holder = $1
2026-12-03 17:28:30.726 UTC|server_a|s1|DETAIL:  parameters: $1 = 'https://a#1', $3 = '1', $4 = '6'
2026-12-03 17:28:30.727 UTC|server_a|s1|LOG:  duration: 0.35 ms  execute <u>: UPDATE leader SET holder = $1
2026-12-03 17:28:30.737 UTC|server_b|s2|LOG:  duration: 0.19 ms  execute <u>: UPDATE leader SET holder = $1
2026-12-03 17:28:30.727 UTC|server_a|s1|DETAIL:  parameters: $1 = 'https://a#1', $3 = '1', $4 = '6'
2026-12-03 17:28:30.737 UTC|server_b|s2|DETAIL:  parameters: $1 = 'https://b#2', $3 = '1', $4 = '6'
2026-12-03 17:28:30.755 UTC|server_b|s3|LOG:  duration: 0.05 ms  statement: UPDATE feed SET revision = 2
"""


def test_the_store_log_and_server_logs_are_read_into_records(tmp_path):
    """The readers give the checkers the store's leases and writes (by role) and the servers' claims."""
    from llmgw.testing.nemesis_run import engine_failures, read_agent_syncs, read_claims, read_store_log

    (tmp_path / "pg.log").write_text(STORE_LOG)
    acquires, writes = read_store_log(tmp_path / "pg.log")
    assert [(a.writer, a.epoch) for a in acquires] == [("server-a", 1), ("server-b", 1)]
    assert [w.writer for w in writes] == ["server-b"]
    assert check_leadership([], acquires)[0].text.startswith("epoch 1 held by server-a at")
    (tmp_path / "server-b.log").write_text(
        "2026-12-03 17:28:30,736 llmgw.server WARNING this server leads now (epoch 1): the lease was free\n"
    )
    (claim,) = read_claims(tmp_path)
    assert (claim.server, claim.epoch) == ("server-b", 1)
    (tmp_path / "agent-node-2.log").write_text(
        "2026-12-03 17:28:31,000 llmgw.agent INFO synced with server https://a,https://b as node node-2\n"
    )
    assert list(read_agent_syncs(tmp_path)) == ["node-2"]
    events = [
        (T, "replica", "chat-0", "ready on node-1"),
        (T + 1, "replica", "chat-0", "failed: shard r0 on node-1 exited with code -9"),
        (
            T + 2,
            "replica",
            "chat-0",
            "failed: not ready within 30 s",
        ),  # it was not ready: not a healthy engine
    ]
    assert engine_failures(events) == [
        EngineFailure(
            "chat-0", frozenset({"node-1"}), T + 1, "failed: shard r0 on node-1 exited with code -9", T
        )
    ]
