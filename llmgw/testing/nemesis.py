"""The nemesis's faults: a seeded random schedule of them, and the injector that applies and heals them.

A run (:mod:`llmgw.testing.nemesis_run`) asks :func:`schedule` for a list of
:class:`PlannedFault` (when, which kind, how long) drawn from one seed, so
the same seed gives the same schedule; several may start at once. The
:class:`Injector` applies each against a :class:`Target` (the real cluster),
records what it did as a :class:`Fault` (the time line the invariant checks
explain failures with, and the report prints), and heals it when its time is
up: SIGCONT after SIGSTOP, a start after kill -9, uncordon after a drain, a
new certificate after a revocation, the files back in an emptied seed folder.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import attrs

__all__ = [
    "CONTROL_PLANE",
    "DATA_PATH",
    "Fault",
    "FaultKind",
    "Injector",
    "PlannedFault",
    "Target",
    "parse_kinds",
    "schedule",
]


class FaultKind(enum.Enum):
    """What a fault does; the value is its name on the command line (``--faults``)."""

    KILL_SERVER = "kill-server"
    STOP_SERVER = "stop-server"
    KILL_AGENT = "kill-agent"
    STOP_AGENT = "stop-agent"
    KILL_ENGINE = "kill-engine"
    STOP_ENGINE = "stop-engine"
    KILL_GATEWAY = "kill-gateway"
    STOP_GATEWAY = "stop-gateway"
    KILL_POSTGRES = "kill-postgres"
    STOP_POSTGRES = "stop-postgres"
    REVOKE_NODE = "revoke-node"
    APPLY_ARGS = "apply-args"
    APPLY_SCALE = "apply-scale"
    APPLY_PRUNE = "apply-prune"
    DRAIN = "drain"
    EMPTY_SEED = "empty-seed"


#: faults that stop the control plane (a server, the store): they fail no client request by themselves
CONTROL_PLANE = frozenset(
    {FaultKind.KILL_SERVER, FaultKind.STOP_SERVER, FaultKind.KILL_POSTGRES, FaultKind.STOP_POSTGRES}
)
#: faults of the gateway itself: every request in flight through it may fail, whatever the replicas
DATA_PATH = frozenset({FaultKind.KILL_GATEWAY, FaultKind.STOP_GATEWAY})

#: seconds each kind lasts before it is healed: (shortest, longest); kinds absent here are instant
_DURATIONS: dict[FaultKind, tuple[float, float]] = {
    FaultKind.KILL_SERVER: (2, 8),
    FaultKind.STOP_SERVER: (2, 12),
    FaultKind.KILL_AGENT: (1, 6),
    FaultKind.STOP_AGENT: (1, 3),
    FaultKind.STOP_ENGINE: (1, 4),
    FaultKind.KILL_GATEWAY: (0.5, 3),
    FaultKind.STOP_GATEWAY: (0.5, 3),
    FaultKind.KILL_POSTGRES: (2, 10),
    FaultKind.STOP_POSTGRES: (2, 8),
    FaultKind.REVOKE_NODE: (5, 15),
    FaultKind.DRAIN: (5, 20),
    FaultKind.EMPTY_SEED: (5, 20),
}
#: how often each kind is drawn, relative to the others
_WEIGHTS: dict[FaultKind, float] = {
    FaultKind.KILL_ENGINE: 3,
    FaultKind.STOP_ENGINE: 2,
    FaultKind.KILL_AGENT: 2,
    FaultKind.STOP_AGENT: 2,
    FaultKind.KILL_SERVER: 1.5,
    FaultKind.STOP_SERVER: 1,
    FaultKind.KILL_POSTGRES: 0.7,
    FaultKind.STOP_POSTGRES: 0.7,
    FaultKind.KILL_GATEWAY: 0.7,
    FaultKind.STOP_GATEWAY: 0.7,
    FaultKind.REVOKE_NODE: 0.7,
    FaultKind.APPLY_ARGS: 1,
    FaultKind.APPLY_SCALE: 1,
    FaultKind.APPLY_PRUNE: 0.7,
    FaultKind.DRAIN: 1,
    FaultKind.EMPTY_SEED: 1,
}
#: seconds between two tries to heal a fault whose healing failed, and how many tries in all
HEAL_RETRY = 2.0
HEAL_TRIES = 30
#: a paused agent is healed either well before the server's ``--lost-after`` or well after it, never near it
#: (a node resumed just as the limit passes may be declared lost or not: both are right)
LONG_AGENT_PAUSE = 2.5


def parse_kinds(text: str) -> tuple[FaultKind, ...]:
    """The kinds ``--faults`` names, comma-separated (``all``: every kind).

    :raises ValueError: naming the unknown kind and the known ones.
    """
    if text.strip() in ("", "all"):
        return tuple(FaultKind)
    kinds = []
    for name in (part.strip() for part in text.split(",")):
        try:
            kinds.append(FaultKind(name))
        except ValueError:
            known = ", ".join(k.value for k in FaultKind)
            raise ValueError(f"--faults: unknown fault kind {name!r}; expected some of: {known}") from None
    return tuple(kinds)


@attrs.frozen
class PlannedFault:
    """One fault of a schedule: ``at`` seconds into the run, healed ``duration`` seconds later (0: instant).

    ``pick`` is a number in [0, 1) that chooses the target among those available when it is applied.
    """

    at: float
    kind: FaultKind
    duration: float
    pick: float


def schedule(
    seed: int, duration: float, kinds: Sequence[FaultKind], *, rate: float = 0.2, lost_after: float = 6.0
) -> list[PlannedFault]:
    """The faults of one run: about ``rate`` per second over ``duration`` seconds, from ``seed`` alone.

    A third of the moments start two or three faults at once. A paused agent is paused for a short
    while or for longer than ``lost_after`` (see :data:`LONG_AGENT_PAUSE`). Returns them by time.
    """
    rng = random.Random(seed)
    kinds = list(kinds)
    weights = [_WEIGHTS[k] for k in kinds]
    planned: list[PlannedFault] = []
    at = rng.uniform(1, 1 / rate)
    while at < duration:
        together = rng.choice((1, 1, 1, 1, 2, 3))
        for kind in rng.choices(kinds, weights, k=together):
            low, high = _DURATIONS.get(kind, (0, 0))
            length = rng.uniform(low, high)
            if kind is FaultKind.STOP_AGENT and rng.random() < 0.3:
                length = lost_after * LONG_AGENT_PAUSE + rng.uniform(0, 4)
            planned.append(PlannedFault(round(at, 2), kind, round(length, 2), rng.random()))
        at += rng.expovariate(rate / (sum((1, 1, 1, 1, 2, 3)) / 6))
    return planned


@attrs.define
class Fault:
    """A fault as it was applied: the run's time line, what explains a failure, what the report counts."""

    kind: FaultKind
    #: the process, node or model it hit (``server-b``, ``node-3``, ``chat-1 on node-2 pid 1234``)
    target: str
    #: ``time.time()`` when it was applied and when it was healed (None: not yet, or instant and done)
    start: float
    end: float | None = None
    #: the nodes and replicas it touched (for explaining failures and engine exits)
    nodes: frozenset[str] = frozenset()
    replicas: frozenset[str] = frozenset()
    #: what was done, or why it could not be (no target available)
    note: str = ""
    #: seconds into the run it was planned at
    planned_at: float = 0.0

    def active(self, at: float, after: float = 0.0) -> bool:
        """Whether the fault was in force at ``at``, counting ``after`` more seconds past its healing."""
        end = self.end if self.end is not None else float("inf")
        return self.start <= at <= end + after

    def line(self, t0: float) -> str:
        """One line of the time line: ``+12.3 s  kill-agent node-3 (healed +15.0 s): note``."""
        healed = f" (healed +{self.end - t0:.1f} s)" if self.end is not None and self.end > self.start else ""
        note = f": {self.note}" if self.note else ""
        return f"+{self.start - t0:7.1f} s  {self.kind.value} {self.target}{healed}{note}"


class Target(Protocol):
    """What the injector needs of a cluster: one method per fault kind, and one to heal it.

    ``apply`` returns the :class:`Fault` it made (its ``note`` says why when nothing could be hit) and
    a function that heals it (None for an instant fault); the injector calls that at the planned time.
    """

    def apply(self, kind: FaultKind, pick: float) -> tuple[Fault, Callable[[], None] | None]:
        """Apply one fault of ``kind``, its target chosen by ``pick`` in [0, 1)."""
        ...


class Injector:
    """Applies a schedule to a :class:`Target` in time, heals each fault when its time is up."""

    def __init__(self, target: Target, planned: Iterable[PlannedFault], started: float) -> None:
        self.target = target
        self.pending = sorted(planned, key=lambda p: p.at)
        self.started = started
        #: every fault applied, in order
        self.faults: list[Fault] = []
        #: (time.time() to heal at, fault, heal)
        self._healing: list[tuple[float, Fault, Callable[[], None]]] = []
        #: id(fault) -> healing attempts that failed
        self._failed_heals: dict[int, int] = {}

    def step(self, now: float | None = None) -> list[Fault]:
        """Heal what is due, then apply what is due; returns the faults applied now.

        Called by the run every fraction of a second; an exception of one fault is recorded in its note.
        """
        now = time.time() if now is None else now
        for item in [h for h in self._healing if h[0] <= now]:
            self._heal(item)
        applied = []
        while self.pending and self.started + self.pending[0].at <= now:
            plan = self.pending.pop(0)
            try:
                fault, heal = self.target.apply(plan.kind, plan.pick)
            except Exception as exc:  # a fault that could not be applied is noted, never the end of the run
                fault, heal = (
                    Fault(plan.kind, "-", time.time(), time.time(), note=f"not applied: {exc!r}"),
                    None,
                )
            fault.planned_at = plan.at
            self.faults.append(fault)
            applied.append(fault)
            if heal is not None:
                self._healing.append((time.time() + plan.duration, fault, heal))
            elif fault.end is None:
                fault.end = fault.start
        return applied

    def heal_all(self) -> None:
        """Heal every fault still in force now (at the end of the run's fault phase), oldest first.

        A healing that fails is tried again by :meth:`step`, as always.
        """
        now = time.time()
        for item in sorted(self._healing, key=lambda h: h[0]):
            if item[0] > now:
                self._heal(item)
        self.step(now)

    @property
    def busy(self) -> bool:
        """Whether faults remain to apply or to heal."""
        return bool(self.pending or self._healing)

    def _heal(self, item: tuple[float, Fault, Callable[[], None]]) -> None:
        """Heal a fault; one whose healing failed (the store down while a server starts) is tried again
        every :data:`HEAL_RETRY` seconds, :data:`HEAL_TRIES` times in all."""
        self._healing.remove(item)
        _, fault, heal = item
        try:
            heal()
        except Exception as exc:
            tries = self._failed_heals[id(fault)] = self._failed_heals.get(id(fault), 0) + 1
            fault.note += f"; healing failed: {exc!r}"[:300]
            if tries < HEAL_TRIES:
                self._healing.append((time.time() + HEAL_RETRY, fault, heal))
                return
        fault.end = time.time()
