"""The nemesis's invariants: checkers over a run's history that return the violations they find.

The failed requests' checker is :mod:`llmgw.testing.nemesis_requests`.

Each checker is a plain function of records read from the store's own history
(the events table, PostgreSQL's statement log), the processes' own logs
(servers' "leads now (epoch N)"), what the run sampled (replicas, nodes,
engine processes, the files under each replica), and the faults the
injector applied (:class:`~llmgw.testing.nemesis.Fault`). None of them starts
a process, so each can be shown to catch a bad history in a unit test.
"""

from __future__ import annotations

import enum
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import attrs

from llmgw.testing.nemesis import Fault, FaultKind

__all__ = [
    "Acquire",
    "Claim",
    "EngineFailure",
    "FinalState",
    "Invariant",
    "LostNode",
    "ManifestMade",
    "ReplicaRun",
    "StoreWrite",
    "Violation",
    "check_converged",
    "check_engine_failures",
    "check_leadership",
    "check_lost_nodes",
    "check_manifests",
    "check_writes",
]


class Invariant(enum.Enum):
    """The invariants a run checks; the value is how the report names each."""

    ONE_HOLDER = "at most one holder per epoch"
    FENCED_WRITES = "every committed write carries its writer's current epoch"
    SAME_FILES = "no replica runs on files that differ from its source's manifest"
    CONVERGED = "the running state equals the catalog after the last fault"
    LOST_SYNCING = "no node declared lost while it was syncing"
    HEALTHY_ENGINES = "no healthy engine failed outside an injected fault"
    EXPLAINED_REQUESTS = "every failed request is explained by a fault and no other ready replica"


@attrs.frozen
class Violation:
    """One breach of an invariant: when, and what was seen."""

    invariant: Invariant
    at: float
    text: str


#: seconds a fault's effects are allowed to last past its healing (a replica rebuilt, routes moved)
AFTERMATH = 20.0
#: seconds between a fault and the failure it causes being reported (probes, syncs, event flushes)
REPORT_DELAY = 15.0


# -- leadership ------------------------------------------------------------------------------------


@attrs.frozen
class Claim:
    """A server's log line ``this server leads now (epoch N)``."""

    server: str
    epoch: int
    at: float


@attrs.frozen
class Acquire:
    """The store's own record of a lease taken: a statement setting the ``leader`` row to ``epoch``."""

    writer: str
    epoch: int
    at: float


def check_leadership(claims: Iterable[Claim], acquires: Iterable[Acquire] = ()) -> list[Violation]:
    """At most one holder per epoch: by the servers' own logs, and by the store's statement log."""
    found = []
    for source, records in (("server logs", claims), ("the store's log", acquires)):
        holders: dict[int, dict[str, float]] = defaultdict(dict)
        for record in records:
            who = record.server if isinstance(record, Claim) else record.writer
            holders[record.epoch].setdefault(who, record.at)
        for epoch, who in sorted(holders.items()):
            if len(who) > 1:
                names = ", ".join(
                    f"{name} at {at:.3f}" for name, at in sorted(who.items(), key=lambda x: x[1])
                )
                found.append(
                    Violation(
                        Invariant.ONE_HOLDER, min(who.values()), f"epoch {epoch} held by {names} ({source})"
                    )
                )
    return found


@attrs.frozen
class StoreWrite:
    """A committed write in the store's statement log: who made it, when it ended."""

    writer: str
    at: float


def check_writes(acquires: Sequence[Acquire], writes: Iterable[StoreWrite]) -> list[Violation]:
    """Every write is made by the holder of the latest lease taken before it (by the store's own clock).

    A takeover waits for the old leader's fenced transaction to end, so a write of the old epoch that
    ends after the new lease was taken was never fenced.
    """
    ordered = sorted(acquires, key=lambda a: a.at)
    found = []
    for write in writes:
        before = [a for a in ordered if a.at < write.at]
        if not before:
            found.append(
                Violation(Invariant.FENCED_WRITES, write.at, f"write by {write.writer} before any lease")
            )
            continue
        holder = before[-1]
        if holder.writer != write.writer:
            mine = [a.epoch for a in before if a.writer == write.writer]
            epoch = f"epoch {mine[-1]}" if mine else "no epoch"
            found.append(
                Violation(
                    Invariant.FENCED_WRITES,
                    write.at,
                    f"write by {write.writer} ({epoch}) after {holder.writer} took epoch {holder.epoch} "
                    f"at {holder.at:.3f}",
                )
            )
    return found


# -- weights ---------------------------------------------------------------------------------------


@attrs.frozen
class ManifestMade:
    """An event ``manifest of SOURCE made by NODE: N files, ..., digest D``."""

    source: str
    node: str
    digest: str
    files: int
    at: float


@attrs.frozen
class ReplicaRun:
    """A shard seen ready for the first time, with the digest of the folder its engine was given."""

    replica: str
    node: str
    source: str
    folder: str
    digest: str
    at: float
    #: when the run first saw this shard (any state): its engine started on the files as they were then
    started: float = 0.0


MANIFEST_MESSAGE = re.compile(
    r"manifest of (?P<source>\S+) made by (?P<node>\S+): (?P<files>\d+) files, .*digest (?P<digest>[0-9a-f]+)"
)


def check_manifests(
    made: Iterable[ManifestMade],
    runs: Iterable[ReplicaRun],
    truth: Mapping[str, str],
    faults: Sequence[Fault] = (),
) -> list[Violation]:
    """A source keeps its first manifest, which matches its seed's files, and every replica runs on those.

    :param truth: source -> digest of the files the run put in its seed folders (the only right content).
    :param faults: a shard whose node's seed folder was emptied after it started is not judged (its
        engine started on the right files; nothing tells its agent they changed under it).
    """
    found = []
    first: dict[str, ManifestMade] = {}
    for manifest in sorted(made, key=lambda m: m.at):
        kept = first.setdefault(manifest.source, manifest)
        right = truth.get(manifest.source)
        if right is not None and not right.startswith(manifest.digest):
            found.append(
                Violation(
                    Invariant.SAME_FILES, manifest.at,
                    f"manifest of {manifest.source} made by {manifest.node} lists {manifest.files} files, "
                    f"digest {manifest.digest}: not the seed's files (digest {right[:12]})",
                )
            )  # fmt: skip
        if kept is not manifest and kept.digest != manifest.digest:
            found.append(
                Violation(
                    Invariant.SAME_FILES, manifest.at,
                    f"manifest of {manifest.source} replaced: {kept.digest} by {kept.node} at {kept.at:.3f}, "
                    f"then {manifest.digest} ({manifest.files} files) by {manifest.node}",
                )
            )  # fmt: skip
    for run in runs:
        right = truth.get(run.source)
        emptied = any(
            f.kind is FaultKind.EMPTY_SEED and run.node in f.nodes and f.start >= run.started - SLACK
            and f.start <= run.at
            for f in faults
        )  # fmt: skip
        if right is not None and run.digest != right and not emptied:
            found.append(
                Violation(
                    Invariant.SAME_FILES, run.at,
                    f"{run.replica} runs on {run.node} on {run.folder} (digest {run.digest[:12]}), "
                    f"not the manifest's files (digest {right[:12]})",
                )
            )  # fmt: skip
    return found


# -- the end state ---------------------------------------------------------------------------------


@attrs.frozen
class FinalState:
    """What the run saw once every fault was healed and the bound passed."""

    at: float
    #: model -> replicas the last applied catalog asks for
    wanted: Mapping[str, int]
    #: replica id -> (model, state)
    replicas: Mapping[str, tuple[str, str]]
    #: replica ids the server could not place, with why
    unplaced: Mapping[str, str]
    #: pids of engine processes running under the run's nodes, and those the replicas' shards report
    engine_pids: frozenset[int]
    shard_pids: frozenset[int]
    #: node -> its state on the server; the nodes whose agent runs (not paused, not revoked)
    node_states: Mapping[str, str]
    agents_up: frozenset[str]


def check_converged(final: FinalState) -> list[Violation]:
    """The running state equals the catalog: every replica ready, none unplaced, no stray engine, no lost node
    whose agent runs."""

    def bad(text: str) -> Violation:
        return Violation(Invariant.CONVERGED, final.at, text)

    found = []
    counts: dict[str, int] = defaultdict(int)
    for replica, (model, state) in sorted(final.replicas.items()):
        counts[model] += 1
        if state != "ready":
            found.append(bad(f"{replica} is {state}"))
    for model, wanted in sorted(final.wanted.items()):
        if counts[model] != wanted:
            found.append(bad(f"{model}: {counts[model]} replicas, the catalog asks for {wanted}"))
    for model in sorted(set(counts) - set(final.wanted)):
        found.append(bad(f"{model}: {counts[model]} replicas of a model the catalog no longer has"))
    for replica, why in sorted(final.unplaced.items()):
        found.append(bad(f"{replica} unplaced: {why}"))
    for pid in sorted(final.engine_pids - final.shard_pids):
        found.append(bad(f"engine pid {pid} runs, and no replica's shard owns it"))
    for node in sorted(final.agents_up):
        if final.node_states.get(node) == "lost":
            found.append(bad(f"{node} is lost, and its agent runs and syncs"))
    return found


# -- nodes and engines -----------------------------------------------------------------------------


@attrs.frozen
class LostNode:
    """An event ``NODE: lost: ...``."""

    node: str
    at: float
    message: str


#: seconds of slack between the injector's clock and the server's (the same machine: only scheduling)
SLACK = 0.5


#: seconds a resumed agent has to send its next sync (it long-polls: the answer waits for it)
RESUME = 2.0


def check_lost_nodes(
    lost: Iterable[LostNode],
    faults: Sequence[Fault],
    synced: Mapping[str, Sequence[float]] | None = None,
    returned: Iterable[tuple[str, float]] = (),
) -> list[Violation]:
    """A node is declared lost only while its agent is down, paused or revoked, never once it syncs again.

    The agent is back :data:`RESUME` seconds after a pause ends, and after a kill once the new agent
    logged its first sync (``synced`` times, per node); a node the server saw return (``returned``:
    "is back after being lost" events) within :data:`RESUME` seconds of being declared lost was syncing.
    """
    synced = synced or {}
    came_back = list(returned)
    found = []
    own = (FaultKind.KILL_AGENT, FaultKind.STOP_AGENT, FaultKind.REVOKE_NODE)
    for event in lost:
        mine = [f for f in faults if f.kind in own and event.node in f.nodes and f.start <= event.at + SLACK]
        if any(f.end is None or f.end >= event.at for f in mine):
            continue  # its agent was down, paused or revoked then
        if not mine:
            found.append(
                Violation(Invariant.LOST_SYNCING, event.at, f"{event.node} {event.message}: never stopped")
            )
            continue
        back, how = _back(mine[-1], synced.get(event.node, ()))
        if back is None:
            continue  # a killed agent that had not synced again yet
        # back within RESUME of the loss: lost while syncing, unless its new agent's first sync came after
        # the loss (a killed agent restarted but silent for lost_after is rightly lost)
        soon = back <= event.at + SLACK and any(
            node == event.node and event.at < at <= event.at + RESUME for node, at in came_back
        )
        if event.at - back > RESUME or soon:
            how = f"its agent was back {event.at - back:.1f} s before ({how})"
            how += "; it synced again within 2 s" if soon else ""
            found.append(Violation(Invariant.LOST_SYNCING, event.at, f"{event.node} {event.message}: {how}"))
    return found


def _back(fault: Fault, synced: Sequence[float]) -> tuple[float | None, str]:
    """When a node's agent was back from ``fault`` (None: not yet), and how."""
    assert fault.end is not None
    if fault.kind is not FaultKind.KILL_AGENT:
        return fault.end, f"{fault.kind.value} healed"
    first = next((at for at in sorted(synced) if at >= fault.end), None)
    return first, "kill-agent, then its new agent's first sync"


@attrs.frozen
class EngineFailure:
    """An event ``REPLICA: failed: ...`` of a replica that was ready, on ``nodes``."""

    replica: str
    nodes: frozenset[str]
    at: float
    message: str
    #: when the replica was last reported ready before it failed
    ready_at: float = 0.0


def check_engine_failures(failures: Iterable[EngineFailure], faults: Sequence[Fault]) -> list[Violation]:
    """A ready replica fails only after a fault of its own engine (or its node revoked) since it was ready.

    The agent's faults do not count: an engine outlives its agent, and a paused agent's canary re-arms.
    However late the failure is reported (the control plane down meanwhile), the fault explains it.
    """
    found = []
    own = (FaultKind.KILL_ENGINE, FaultKind.STOP_ENGINE)
    for failure in failures:
        explained = any(
            (
                (f.kind in own and failure.replica in f.replicas)
                or (f.kind is FaultKind.REVOKE_NODE and f.nodes & failure.nodes)
            )
            and failure.ready_at - SLACK <= f.start <= failure.at + SLACK
            for f in faults
        )  # fmt: skip
        if explained:
            continue
        near = [
            f"{f.kind.value} {f.target}" for f in faults
            if f.nodes & failure.nodes and failure.ready_at - SLACK <= f.start <= failure.at
        ]  # fmt: skip
        why = f" (faults then on its nodes: {', '.join(near)})" if near else ""
        found.append(
            Violation(Invariant.HEALTHY_ENGINES, failure.at, f"{failure.replica} {failure.message}{why}")
        )
    return found
