"""One nemesis run: a cluster under seeded faults for a set time, its history read back and checked.

:func:`run` builds a :class:`~llmgw.testing.nemesis_cluster.NemesisCluster`
on a throwaway PostgreSQL (whose statement log records who wrote what, and
when), starts ``clients`` clients on the gateway (half streaming), applies
the schedule of :func:`~llmgw.testing.nemesis.schedule` for ``duration``
seconds while checking the invariants every few seconds, heals every fault,
waits up to ``settle`` seconds for the running state to equal the catalog,
and checks everything once more. It returns a :class:`Report`, whose
:meth:`Report.text` is the table ``bench/nemesis.py`` prints: faults by kind,
invariants checked, each violation with the seed and the time line around it.
Every process group it started is ended, however it ends.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import attrs

from llmgw.dev.cluster import ClusterError
from llmgw.testing.load import GatewayLoad
from llmgw.testing.nemesis import Fault, FaultKind, Injector, schedule
from llmgw.testing.nemesis_checks import (
    MANIFEST_MESSAGE,
    Acquire,
    Claim,
    EngineFailure,
    FinalState,
    Invariant,
    LostNode,
    ManifestMade,
    StoreWrite,
    Violation,
    check_converged,
    check_engine_failures,
    check_leadership,
    check_lost_nodes,
    check_manifests,
    check_writes,
)
from llmgw.testing.nemesis_cluster import MODELS, SEED, NemesisCluster, engine_processes
from llmgw.testing.nemesis_faults import ClusterFaults
from llmgw.testing.nemesis_requests import FailedRequest, check_requests
from llmgw.testing.postgres import PostgresCluster
from llmgw.wire import NodeList, ReplicaList

__all__ = ["Options", "Report", "engine_failures", "read_agent_syncs", "read_claims", "read_store_log", "run"]

#: seconds between two checks of the history while the run goes
CHECK_EVERY = 15.0
#: violations printed per check while the run goes, and per invariant in the report
LIVE_LINES = 10
SHOWN = 10
_SYNCED = re.compile(r"^(\S+ \S+) .*synced with server \S+ as node (\S+)")
_CLAIM = re.compile(r"^(\S+ \S+) .*this server leads now \(epoch (\d+)\)")
#: a statement's end in PostgreSQL's log, with the prefix the run sets (``%m|%u|%c|``: time, role, session)
_STATEMENT = re.compile(
    r"^(\S+ \S+) UTC\|([^|]*)\|([^|]*)\|LOG:  duration: [\d.]+ ms  (?:execute [^:]*|statement): (.*)"
)
_PARAMETERS = re.compile(r"^\S+ \S+ UTC\|[^|]*\|([^|]*)\|DETAIL:  parameters: (.*)")


@attrs.frozen
class Options:
    """What a run does: ``bench/nemesis.py``'s options."""

    seed: int
    duration: float
    servers: int = 2
    agents: int = 6
    clients: int = 16
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    #: faults per second, on average
    rate: float = 0.2
    #: seconds after the last fault within which the running state must equal the catalog
    settle: float = 120.0
    #: start every server at the same instant (False: one after the other, the first leading first)
    together: bool = True
    #: the servers' ``--lost-after``: 10 s, as two loaded cores can delay an agent's sync by seconds
    lost_after: float = 10.0


@attrs.define
class Report:
    """What a run found; :meth:`text` is the table printed."""

    options: Options
    started: float
    faults: list[Fault]
    violations: list[Violation]
    explained: list[str]
    requests: tuple[int, int]
    checks: Counter[Invariant]
    logs: Path

    def text(self) -> str:
        """Faults by kind, invariants (records checked, violations), each violation with its time line."""
        o = self.options
        lines = [
            f"nemesis seed {o.seed}, {o.duration:.0f} s, {o.servers} servers, {o.agents} agents, "
            f"{o.clients} clients; logs in {self.logs}"
        ]
        applied = [f for f in self.faults if not f.note.startswith("not applied")]
        kinds = Counter(f.kind.value for f in applied)
        lines.append(f"faults injected: {len(applied)} of {len(self.faults)} planned, {len(kinds)} kinds")
        lines += [f"  {kind:<15} {count:>4}" for kind, count in sorted(kinds.items())]
        ok, failed = self.requests
        lines.append(f"client requests: {ok} succeeded, {failed} failed ({len(self.explained)} explained)")
        lines.append("invariants (records checked, violations):")
        found = Counter(v.invariant for v in self.violations)
        lines += [f"  {self.checks[i]:>6} {found[i]:>4}  {i.value}" for i in Invariant]
        for invariant in Invariant:
            mine = sorted((v for v in self.violations if v.invariant is invariant), key=lambda v: v.at)
            for violation in mine[:SHOWN]:
                lines.append(
                    f"VIOLATION +{violation.at - self.started:.1f} s {invariant.value}: {violation.text}"
                )
                lines += [
                    "    " + f.line(self.started)
                    for f in self.faults
                    if f.start <= violation.at and f.active(violation.at, 30) and f.start >= violation.at - 60
                ]
            if len(mine) > SHOWN:
                lines.append(f"... and {len(mine) - SHOWN} more violations of: {invariant.value}")
        if self.violations:
            lines.append(
                f"reproduce: python bench/nemesis.py --seed {o.seed} --duration {o.duration:g} "
                f"--rate {o.rate:g} --servers {o.servers} --agents {o.agents} --clients {o.clients}"
                + ("" if o.together else " --one-by-one")
                + (
                    ""
                    if set(o.kinds) == set(FaultKind)
                    else f" --faults {','.join(k.value for k in o.kinds)}"
                )
            )
        lines.append("time line:")
        lines += ["  " + f.line(self.started) for f in self.faults]
        return "\n".join(lines)


def run(root: Path, options: Options, bindir: Path, *, say=print) -> Report:
    """Run the nemesis under ``root``, PostgreSQL from ``bindir``; return its report, every process ended."""
    # its own folder under /tmp: PostgreSQL runs as another user when we are root, and ``root`` may be private
    postgres = PostgresCluster(Path(tempfile.mkdtemp(prefix="llmgw-nemesis-pg-")), bindir)
    cluster = None
    try:
        postgres.start()
        for setting in (
            "log_min_duration_statement = 0",
            "log_line_prefix = '%m|%u|%c|'",
            "log_timezone = 'UTC'",
        ):
            postgres.sql(f"ALTER SYSTEM SET {setting}")
        postgres.sql("SELECT pg_reload_conf()")
        cluster = NemesisCluster(root, postgres, servers=options.servers, agents=options.agents,
                                 lost_after=options.lost_after)  # fmt: skip
        say(
            f"starting {options.servers} servers, {options.agents} agents, a gateway "
            f"(logs in {cluster.local.logs})"
        )
        try:
            cluster.start(together=options.together)
        except ClusterError as exc:
            say(f"the cluster did not start: {exc}")
            return _not_started(cluster, options, str(exc))
        return _run(cluster, options, say)
    finally:
        if cluster is not None:
            cluster.stop()
        with contextlib.suppress(OSError):
            shutil.copy(postgres.log, root / "postgres.log")  # the store's history, kept with the run's logs
        postgres.stop()


def _run(cluster: NemesisCluster, options: Options, say) -> Report:
    planned = schedule(
        options.seed, options.duration, options.kinds, rate=options.rate, lost_after=options.lost_after
    )
    say(f"seed {options.seed}: {len(planned)} faults planned over {options.duration:.0f} s")
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(cluster, stop), daemon=True)
    sampler.start()
    reported: set[tuple] = set()
    try:
        with GatewayLoad(cluster.local.gateway_url, options.clients, models=MODELS) as load:
            load.wait_served(options.clients, 120)
            started = time.time()
            faults = ClusterFaults(cluster)
            supervisor = threading.Thread(
                target=faults.run_supervisor,
                args=(stop, lambda line: say(f"  + {time.time() - started:7.1f} s  {line}")),
                daemon=True,
            )
            supervisor.start()
            injector = Injector(faults, planned, started)
            next_check, healed = started + CHECK_EVERY, False
            while time.time() < started + options.duration or injector.busy:
                for fault in injector.step():
                    say("  " + fault.line(started))
                if time.time() >= started + options.duration and not healed:
                    injector.heal_all()
                    healed = True
                if time.time() >= next_check and "postgres" not in faults.busy:
                    next_check = time.time() + CHECK_EVERY
                    try:
                        found = _history_checks(cluster, injector.faults, load)[0]
                    except Exception as exc:  # PostgreSQL restarting: the next check reads it
                        say(f"(history not read this time: {exc!r})")
                        found = []
                    new = [v for v in found if (v.invariant, v.text) not in reported]
                    if len(new) > LIVE_LINES:
                        say(f"{len(new)} new violations; the first {LIVE_LINES}:")
                    reported.update((v.invariant, v.text) for v in new)
                    for v in new[:LIVE_LINES]:
                        say(
                            f"VIOLATION (while running) +{v.at - started:.1f} s {v.invariant.value}: {v.text}"
                        )
                time.sleep(0.1)
            say("every fault healed; waiting for the running state to equal the catalog")
            final = _converge(cluster, faults.busy, options.settle)
            stuck = None
            if final is not None:
                try:
                    load.wait_served(options.clients, 60)
                except AssertionError as exc:
                    stuck = Violation(Invariant.CONVERGED, time.time(), f"clients not served again: {exc}")
        violations, explained, checks = _history_checks(cluster, injector.faults, load)
        if final is None:
            why = f"the control plane did not answer within {options.settle:.0f} s of the last fault"
            converged = [Violation(Invariant.CONVERGED, time.time(), why)]
        else:
            converged = check_converged(final)
            checks[Invariant.CONVERGED] += (
                len(final.replicas) + len(final.engine_pids) + len(final.node_states)
            )
        found = violations + converged + ([stuck] if stuck else [])
        return Report(
            options, started, injector.faults, found, explained, load.counts(), checks, cluster.local.logs
        )
    finally:
        stop.set()
        sampler.join(10)


def _not_started(cluster: NemesisCluster, options: Options, why: str) -> Report:
    """The report of a run whose cluster never got ready: that, and what its history shows."""
    violations, explained, checks = _history_checks(cluster, [], None)
    first = why.splitlines()[0]
    violations.append(Violation(Invariant.CONVERGED, time.time(), f"the cluster did not start: {first}"))
    return Report(options, time.time(), [], violations, explained, (0, 0), checks, cluster.local.logs)


def _sample(cluster: NemesisCluster, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        cluster.sample()


def _final_state(cluster: NemesisCluster, busy: set[str]) -> FinalState:
    """The state as the leader sees it now (a standby's view has no pids).

    :raises ClusterError: no leader answered.
    """
    replicas = cluster.leader_read("/v1/admin/replicas", ReplicaList)
    nodes = cluster.leader_read("/v1/admin/nodes", NodeList)
    if replicas is None or nodes is None:
        raise ClusterError("no leader answered")
    return FinalState(
        at=time.time(),
        wanted=cluster.wanted(),
        replicas={r.id: (r.model, r.state) for r in replicas.replicas},
        unplaced={u.id: u.reason for u in replicas.unplaced},
        engine_pids=frozenset(engine_processes(cluster.root)),
        shard_pids=frozenset(s.pid for r in replicas.replicas for s in r.shards if s.pid),
        node_states={n.node_id: n.state for n in nodes.nodes},
        agents_up=cluster.agents_up(busy),
    )


def _converge(cluster: NemesisCluster, busy: set[str], bound: float) -> FinalState | None:
    """The state once it equals the catalog, or as it stands ``bound`` seconds after the last fault
    (None: no leader answered by then); the supervisor starts servers that exit meanwhile again."""
    deadline = time.time() + bound
    while True:
        try:
            final = _final_state(cluster, busy)
        except Exception:
            final = None
        if final is not None and not check_converged(final) or time.time() >= deadline:
            return final
        time.sleep(1.0)


# -- reading the history back ----------------------------------------------------------------------


def _history_checks(
    cluster: NemesisCluster, faults: Sequence[Fault], load: GatewayLoad | None
) -> tuple[list[Violation], list[str], Counter[Invariant]]:
    """Every invariant but convergence, over the history so far.

    :returns: the violations, the explained failures, and how many records each invariant checked.
    """
    events = cluster.postgres.sql(
        "SELECT at, kind, subject, message FROM events ORDER BY id", cluster.database
    )
    claims = read_claims(cluster.local.logs)
    acquires, writes = read_store_log(cluster.postgres.log)
    with cluster.lock:
        runs, ready = list(cluster.runs), list(cluster.ready)
    manifests = [
        ManifestMade(m["source"], m["node"], m["digest"], int(m["files"]), at)
        for at, kind, _, message in events if kind == "weights" and (m := MANIFEST_MESSAGE.search(message))
    ]  # fmt: skip
    lost = [LostNode(s, at, m) for at, k, s, m in events if k == "node" and m.startswith("lost")]
    returned = [(s, at) for at, k, s, m in events if k == "node" and m == "is back after being lost"]
    failures = engine_failures(events)
    answers = []
    if load is not None:
        with load.lock:
            answers = list(load.answers)
    failed = [FailedRequest(a.model, a.replica, a.began, a.ended, a.failure) for a in answers if a.failure]
    served = [a.ended for a in answers if a.failure is None]
    request_violations, explained = check_requests(failed, faults, ready, served, failures)
    violations = (
        check_leadership(claims, acquires) + check_writes(acquires, writes)
        + check_manifests(manifests, runs, {SEED: cluster.seed_truth}, faults)
        + check_lost_nodes(lost, faults, read_agent_syncs(cluster.local.logs), returned)
        + check_engine_failures(failures, faults) + request_violations
    )  # fmt: skip
    checks = Counter({
        Invariant.ONE_HOLDER: len(claims) + len(acquires), Invariant.FENCED_WRITES: len(writes),
        Invariant.SAME_FILES: len(manifests) + len(runs), Invariant.LOST_SYNCING: len(lost),
        Invariant.HEALTHY_ENGINES: len(failures), Invariant.EXPLAINED_REQUESTS: len(failed),
    })  # fmt: skip
    return violations, explained, checks


def engine_failures(events: Sequence[tuple]) -> list[EngineFailure]:
    """``failed: ...`` events of replicas that were ready (their last ``ready on`` since the last failure)."""
    ready_on: dict[str, tuple[frozenset[str], float]] = {}
    found = []
    for at, kind, subject, message in events:
        if kind != "replica":
            continue
        if message.startswith("ready on "):
            ready_on[subject] = (frozenset(message.removeprefix("ready on ").split(", ")), at)
        elif message.startswith("failed: ") and subject in ready_on:
            nodes, since = ready_on.pop(subject)
            found.append(EngineFailure(subject, nodes, at, message, since))
        elif message.startswith(("removed", "rebuilding", "starting again")):
            ready_on.pop(subject, None)
    return found


def read_claims(logs: Path) -> list[Claim]:
    """``this server leads now (epoch N)`` lines of every server's log."""
    found = []
    for path in sorted(logs.glob("server*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if (m := _CLAIM.match(line)) is not None:
                at = _log_time(m[1])
                found.append(Claim(path.stem, int(m[2]), at))
    return found


def read_agent_syncs(logs: Path) -> dict[str, list[float]]:
    """node -> when each of its agents logged its first sync (``synced with server ... as node N``)."""
    found: dict[str, list[float]] = {}
    for path in sorted(logs.glob("agent-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if (m := _SYNCED.match(line)) is not None:
                found.setdefault(m[2], []).append(_log_time(m[1]))
    return found


def _log_time(text: str) -> float:
    """``time.time()`` of a log line's ``2026-12-03 17:28:30,736`` (local time)."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def read_store_log(path: Path) -> tuple[list[Acquire], list[StoreWrite]]:
    """Leases taken and writes made, from PostgreSQL's log of statement ends, by role (one per server)."""
    acquires, writes = [], []
    pending: dict[str, tuple[str, float]] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return [], []
    for line in text.splitlines():
        if (m := _STATEMENT.match(line)) is not None:
            at = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp()
            writer, session, statement = m[2].replace("_", "-"), m[3], m[4]
            pending.pop(session, None)
            if statement.startswith("UPDATE leader SET holder"):  # taking the lease: $3 is the epoch
                pending[session] = (writer, at)
            elif statement.startswith("UPDATE feed SET revision"):
                writes.append(StoreWrite(writer, at))
        elif (p := _PARAMETERS.match(line)) is not None and p[1] in pending:
            writer, at = pending.pop(p[1])
            epoch = dict(re.findall(r"\$(\d+) = '([^']*)'", p[2])).get("3")
            if epoch is not None:
                acquires.append(Acquire(writer, int(epoch), at))
    return acquires, writes
