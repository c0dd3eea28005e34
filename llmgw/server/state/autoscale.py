"""The autoscaler's records: each autoscaled model's desired replicas, its memory, and the decisions.

The autoscaler controller (:mod:`llmgw.server.controllers.autoscaler`) decides
a :class:`ScaleDecision` and a new :class:`ScaleMemory` per model; the state's
verb :meth:`~llmgw.server.state.cluster.ClusterState.scale` keeps them here.
:meth:`ScaleBook.scaled` gives the scheduler the catalog with each autoscaled
model's replicas at its desired count. Nothing here is stored: a server that
starts (or takes the lead) begins each model at the replicas it finds, within
its ``min`` and ``max``.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Iterable

import attrs

from llmgw.models import Catalog, Model, ScaleTarget
from llmgw.scheduler import Replica
from llmgw.server.state.records import ReplicaRecord, ReplicaState
from llmgw.wire import GatewayActivity, ShardLoad

__all__ = [
    "SIGNAL_MAX_AGE", "SIGNAL_WORDS", "ScaleDirection", "ScaleCause", "ScaleDecision", "Demand",
    "ScaleMemory", "ScaleBook",
]  # fmt: skip


class ScaleDirection(enum.StrEnum):
    """Which way a decision moves a model's replicas."""

    UP = "up"
    DOWN = "down"
    HOLD = "hold"


class ScaleCause(enum.StrEnum):
    """Why the autoscaler decided what it did: ``ctl events``, the metric label."""

    #: a signal is over its target: more replicas
    OVER_TARGET = "over-target"
    #: every signal stayed under its target for the whole stabilization window: fewer replicas
    UNDER_TARGET = "under-target"
    #: the desired count was outside the catalog's min..max (a catalog changed them)
    BOUNDS = "bounds"
    #: over target, but already at ``max``
    AT_MAX = "at-max"
    #: a change is wanted, but the last one was less than ``cooldown`` ago
    COOLDOWN = "cooldown"
    #: under target, but not for the whole stabilization window yet; or over it within the window after
    #: a step down (one change of direction per window)
    STABILIZING = "stabilizing"
    #: a higher-priority model had no room: this one gives it a replica (down to its min)
    GIVE_WAY = "give-way"
    #: over target, but a higher-priority model waits for room: no scale-up meanwhile
    YIELD = "yield"
    #: no ready replica reported the signals the model's targets name
    NO_SIGNAL = "no-signal"
    #: the signals are at their targets
    AT_TARGET = "at-target"
    #: a model at zero replicas got a request (a gateway holds it): one replica
    WAKE = "wake"
    #: a model whose ``min`` is 0 had no request for ``idle_after`` seconds: zero replicas (or stays there)
    IDLE = "idle"


#: seconds after which a replica's last load reading no longer counts (its agent went quiet)
SIGNAL_MAX_AGE = 15.0

#: a target key -> how an event names its signal
SIGNAL_WORDS = {
    "waiting_per_replica": "waiting per replica",
    "kv_cache_usage": "KV-cache usage",
    "ttft_p95": "s time to first token (p95)",
}


@attrs.frozen
class ScaleDecision:
    """One decision for one model, with its inputs: what an event says and ``ctl autoscale`` shows."""

    model: str
    at: float
    before: int
    after: int
    direction: ScaleDirection
    cause: ScaleCause
    #: the target key that decided (None: no signal, or bounds)
    signal: str | None = None
    value: float | None = None
    target: float | None = None
    #: seconds the signal was measured over (the stabilization window for a scale-down)
    window: float | None = None
    #: ``give-way``: the model given a replica (``value`` and ``target`` are then the two priorities)
    to: str | None = None

    def describe(self) -> str:
        """One line for people: ``2 → 3: 7.5 waiting per replica > target 4``."""
        head = f"{self.before} → {self.after}: " if self.after != self.before else f"stays at {self.before}: "
        if self.cause == ScaleCause.WAKE:
            held = f"{self.value:.0f} requests held at the gateways" if self.value else "a request came"
            return head + f"woken: {held}"
        if self.cause == ScaleCause.IDLE and self.window is not None:
            return head + f"idle: no request for {self.window:.0f} s (idle_after {self.target or 0:g})"
        if self.cause == ScaleCause.GIVE_WAY and self.value is not None and self.target is not None:
            return (
                head
                + f"gives way to {self.to} (priority {self.target:g} > {self.value:g}): the fleet is full"
            )
        if self.signal is None or self.value is None or self.target is None:
            return head + self.cause.value.replace("-", " ")
        word = SIGNAL_WORDS.get(self.signal, self.signal)
        compare = ">" if self.value > self.target else "<=" if self.value == self.target else "<"
        measured = f"{_number(self.value)} {word} {compare} target {_number(self.target)}"
        if self.cause == ScaleCause.UNDER_TARGET:
            measured = f"{measured} for {self.window or 0:.0f} s"
        elif self.cause == ScaleCause.STABILIZING and self.value > self.target:
            measured += f" (stabilizing: scaled down {self.window or 0:.0f} s ago)"
        elif self.cause in (ScaleCause.AT_MAX, ScaleCause.COOLDOWN, ScaleCause.STABILIZING):
            measured += f" ({self.cause.value.replace('-', ' ')})"
        return head + measured


def _number(value: float) -> str:
    return (
        f"{value:.2f}".rstrip("0").rstrip(".") if not math.isclose(value, round(value)) else str(round(value))
    )


@attrs.frozen
class Demand:
    """What the gateways said of one model's requests (``POST /v1/gateway/activity``), on the server's clock.

    Only a model whose ``min`` is 0 uses it: to go to zero replicas when idle, and to wake.
    """

    #: when this server first heard of the model's demand, or started deciding for it (idle counts from
    #: here at the latest: a server that starts does not put every model to sleep at once)
    since: float
    #: when the latest request reached a gateway (None: none reported since :attr:`since`)
    last_request: float | None = None
    #: requests a gateway holds for the model now, and when that was reported (None: none held)
    held: int = 0
    held_at: float | None = None

    def active_at(self) -> float:
        """The last moment the model was in use: its latest request, or :attr:`since`."""
        return max(self.since, self.last_request if self.last_request is not None else self.since)

    def wants_wake(self, slept_at: float, now: float) -> bool:
        """Whether a model at zero replicas since ``slept_at`` must wake: a request held now, or one that
        reached a gateway after it went to zero."""
        held_at = self.held_at
        if self.held and held_at is not None and held_at > slept_at and now - held_at <= SIGNAL_MAX_AGE:
            return True
        return self.last_request is not None and self.last_request > max(slept_at, self.since)


@attrs.frozen
class ScaleMemory:
    """What the autoscaler remembers of one model between passes."""

    #: the replicas the autoscaler asks for
    desired: int
    #: when the desired count last changed (cooldown counts from it)
    changed_at: float = -math.inf
    #: since when every recommendation was below ``desired`` (None: the last one was not)
    low_since: float | None = None
    #: the highest recommendation since ``low_since`` (a scale-down goes no lower)
    low_peak: int = 0
    #: the last decision, for ``ctl autoscale`` and for saying a hold at max once
    last: ScaleDecision | None = None
    #: the last decision that changed the count (kept by :meth:`ScaleBook.keep`)
    last_change: ScaleDecision | None = None


class ScaleBook:
    """Every autoscaled model's memory, and the last load each replica's agent sent."""

    def __init__(self) -> None:
        #: model name -> its memory
        self.models: dict[str, ScaleMemory] = {}
        #: replica id -> (when received, the reading)
        self.loads: dict[str, tuple[float, ShardLoad]] = {}
        #: (model, direction) -> how many changes the autoscaler made (the metric)
        self.changes: Counter[tuple[str, str]] = Counter()
        #: model name -> what the gateways said of its requests (models whose ``min`` is 0)
        self.demand: dict[str, Demand] = {}
        #: model name -> (when received, a gateway process's time to first token p95), the recent ones
        self.ttft: dict[str, list[tuple[float, float]]] = {}

    def record_activity(self, activity: GatewayActivity, catalog: Catalog, now: float) -> bool:
        """Keep what a gateway process saw of each autoscaled model of ``catalog`` (by served name): the
        requests of those whose ``min`` is 0, and the time to first token of all.

        Called for every ``POST /v1/gateway/activity``.

        :returns: whether a model at zero replicas is held at a gateway now (decide at once).
        """
        model_of = {
            catalog.served_name(name): name
            for name, model in catalog.models.items()
            if model.autoscale is not None
        }
        wake = False
        for seen in activity.models:
            name = model_of.get(seen.model)
            if name is None:
                continue
            if seen.ttft_p95 is not None and seen.streams:
                readings = [r for r in self.ttft.get(name, ()) if now - r[0] <= SIGNAL_MAX_AGE]
                self.ttft[name] = [*readings[-63:], (now, seen.ttft_p95)]
            auto = catalog.models[name].autoscale
            if auto is None or auto.min != 0:
                continue
            known = self.demand.get(name) or Demand(since=now)
            last = known.last_request
            if seen.idle is not None:
                last = max(last if last is not None else -math.inf, now - seen.idle)
            # the latest report says what is held now (another gateway's held ones also moved the
            # last request past the moment the model went to zero)
            held_at = now if seen.held else None
            self.demand[name] = attrs.evolve(known, last_request=last, held=seen.held, held_at=held_at)
            memory = self.models.get(name)
            wake = wake or (seen.held > 0 and memory is not None and memory.desired == 0)
        return wake

    def demand_of(self, name: str, now: float) -> Demand:
        """``name``'s demand; one starting ``now`` for a model no gateway spoke of yet."""
        return self.demand.setdefault(name, Demand(since=now))

    def record_loads(self, loads: Iterable[ShardLoad], now: float) -> None:
        """Keep the readings an agent sent with its sync (called for every sync)."""
        for load in loads:
            self.loads[load.replica_id] = (now, load)

    def forget(self, catalog: Catalog) -> None:
        """Forget the memory of models ``catalog`` does not autoscale (gone, or fixed now); called as it
        is applied. A model autoscaled again starts afresh at the replicas it has."""
        scaled = {name for name, model in catalog.models.items() if model.autoscale is not None}
        for name in set(self.models) - scaled:
            del self.models[name]
        for name in set(self.demand) - scaled:
            del self.demand[name]
        for name in set(self.ttft) - scaled:
            del self.ttft[name]

    def signals(
        self, target: ScaleTarget, replicas: Iterable[ReplicaRecord], now: float, model: str = ""
    ) -> tuple[int, dict[str, float]]:
        """A model's ready replicas, and the value of each of ``target``'s signals over those reporting.

        A reading counts when it is of the replica's current attempt and at most
        :data:`SIGNAL_MAX_AGE` seconds old. A signal no replica reports is absent. ``ttft_p95`` is the
        highest the gateway processes of ``model`` reported in that time (several gateways: the worst).
        """
        ready = [r for r in replicas if r.state == ReplicaState.READY]
        readings = []
        for record in ready:
            entry = self.loads.get(record.id)
            if entry is not None and entry[1].attempt == record.attempt and now - entry[0] <= SIGNAL_MAX_AGE:
                readings.append(entry[1])
        values: dict[str, float] = {}
        if readings and target.waiting_per_replica is not None:
            values["waiting_per_replica"] = sum(r.waiting for r in readings) / len(readings)
        usage = [r.kv_cache_usage for r in readings if r.kv_cache_usage is not None]
        if usage and target.kv_cache_usage is not None:
            values["kv_cache_usage"] = sum(usage) / len(usage)
        ttft = [value for at, value in self.ttft.get(model, ()) if now - at <= SIGNAL_MAX_AGE]
        if ttft and target.ttft_p95 is not None and ready:
            values["ttft_p95"] = max(ttft)
        return len(ready), values

    def keep(self, decision: ScaleDecision, memory: ScaleMemory) -> bool:
        """Remember a model's latest ``decision`` and ``memory``.

        :returns: whether the decision is worth an event: a change, or the first hold at ``max``.
        """
        said = self.models.get(decision.model)
        changed = decision.direction != ScaleDirection.HOLD
        last_change = decision if changed else said.last_change if said is not None else None
        self.models[decision.model] = attrs.evolve(memory, last_change=last_change)
        if changed:
            self.changes[(decision.model, decision.direction.value)] += 1
            return True
        before = said.last.cause if said is not None and said.last is not None else None
        return decision.cause == ScaleCause.AT_MAX and before != ScaleCause.AT_MAX

    def memory(self, name: str, model: Model, placements: Iterable[Replica]) -> ScaleMemory:
        """``name``'s memory; for a model not seen yet, one at the replicas it has, within min..max."""
        known = self.models.get(name)
        if known is not None:
            return known
        have = sum(1 for p in placements if p.model == name and not p.replaces)
        assert model.autoscale is not None
        return ScaleMemory(desired=min(max(have, model.autoscale.min), model.autoscale.max))

    def scaled(self, catalog: Catalog, placements: Iterable[Replica]) -> Catalog:
        """``catalog`` with each autoscaled model's ``replicas`` at its desired count (what to schedule)."""
        placed = tuple(placements)
        models = dict(catalog.models)
        for name, model in catalog.models.items():
            if model.autoscale is not None:
                auto = model.autoscale
                desired = min(max(self.memory(name, model, placed).desired, auto.min), auto.max)
                models[name] = attrs.evolve(model, replicas=desired)
        return attrs.evolve(catalog, models=models)
