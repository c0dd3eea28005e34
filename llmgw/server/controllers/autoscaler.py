"""The autoscaler controller: each autoscaled model's desired replicas, from what its engines report.

For every model whose ``replicas:`` is a mapping (:class:`~llmgw.models.Autoscale`),
each pass reads the last load of its ready replicas (their agents send it
with every sync), turns each target's signal into the replicas it needs
(Kubernetes' rule: ``ceil(ready × value / target)``, unchanged within
:data:`TOLERANCE` of the target), and takes the most demanding one:

- up at once, by at most ``max_step``, unless the last change was less than
  ``cooldown`` ago, or was a step down less than ``scale_down_after`` ago (at
  most one change of direction per stabilization window); never above ``max``
  (a hold at ``max`` while over target is said once);
- down only once every recommendation stayed below the desired count for
  ``scale_down_after`` seconds (the stabilization window), to the highest of
  them, by at most ``max_step``, after the cooldown; never below ``min``. Each
  step down needs a window of its own, and leaves every signal at most
  :data:`DOWN_HEADROOM` of its target on the replicas left.

A model whose ``min`` is 0 goes to zero replicas once no gateway saw a request
for it for ``idle_after`` seconds (its signals alone never take it below one),
and wakes to one replica as soon as a gateway reports a request for it (a
gateway holds such requests until a replica is ready): no cooldown delays a
wake.

When the fleet is full (the scheduler finds no place for a model's new
replicas), a lower-priority autoscaled model above its ``min`` gives one
replica a pass (out of its cooldown), lowest priority first; meanwhile no
lower-priority model scales up.

:func:`decide` is a pure function of its inputs; :func:`step` runs it for
every model and hands each :class:`~llmgw.server.state.autoscale.ScaleDecision`
to the state's verb ``scale``, which records it (an event for every change).
The scheduler then places or removes replicas toward the new count; a
removed replica leaves the routes and stops with its grace, as a drained one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping

import attrs

from llmgw.models import Autoscale, Model, ScaleTarget
from llmgw.server.state.autoscale import Demand, ScaleCause, ScaleDecision, ScaleDirection, ScaleMemory
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import ReplicaRecord

__all__ = ["TOLERANCE", "DOWN_HEADROOM", "recommend", "decide", "give_way", "step"]

#: a signal within this share of its target asks for no change
TOLERANCE = 0.1
#: a step down leaves each signal at most this share of its target on the replicas left (their load now,
#: spread over fewer): what they then carry is not already at the edge of a step back up
DOWN_HEADROOM = 1 - 2 * TOLERANCE


def recommend(target: ScaleTarget, ready: int, values: Mapping[str, float]) -> tuple[int, str] | None:
    """The replicas the most demanding signal asks for, and its key; None when no target has a value."""
    best: tuple[int, str] | None = None
    for key, goal in target.signals().items():
        if key not in values:
            continue
        ratio = values[key] / goal
        wanted = ready if abs(ratio - 1) <= TOLERANCE else math.ceil(ready * ratio)
        if best is None or wanted > best[0]:
            best = (wanted, key)
    return best


def decide(
    name: str,
    policy: Autoscale,
    memory: ScaleMemory,
    ready: int,
    values: Mapping[str, float],
    now: float,
    *,
    idle_after: float | None = None,
    demand: Demand | None = None,
) -> tuple[ScaleDecision, ScaleMemory]:
    """One pass for one model: the decision, and what to remember. Pure: no clock, no state.

    :param memory: what the last pass remembered (its ``desired`` is the count now asked for).
    :param ready: the model's ready replicas.
    :param values: each target's signal (:meth:`~llmgw.server.state.autoscale.ScaleBook.signals`).
    :param idle_after: the model's ``idle_after`` (a model whose ``min`` is 0 has one).
    :param demand: what the gateways said of the model's requests (used when ``min`` is 0).
    """
    current = memory.desired
    decision = functools.partial(ScaleDecision, name, now, current)
    bounded = min(max(current, policy.min), policy.max)
    if bounded != current:
        way = ScaleDirection.UP if bounded > current else ScaleDirection.DOWN
        made = decision(bounded, way, ScaleCause.BOUNDS)
        return made, ScaleMemory(bounded, changed_at=now, last=made)
    if policy.min == 0 and idle_after is not None and demand is not None:
        # only requests take a model to zero or back: the engines' gauges say nothing at zero replicas
        if current == 0:
            if demand.wants_wake(memory.changed_at, now):  # no cooldown: a request waits for it
                made = decision(1, ScaleDirection.UP, ScaleCause.WAKE, value=float(demand.held))
                return made, ScaleMemory(1, changed_at=now, last=made)
            made = decision(0, ScaleDirection.HOLD, ScaleCause.IDLE)
            return made, ScaleMemory(0, memory.changed_at, last=made)
        idle = now - max(demand.active_at(), memory.changed_at)
        if idle >= idle_after:
            made = decision(0, ScaleDirection.DOWN, ScaleCause.IDLE, target=idle_after, window=idle)
            return made, ScaleMemory(0, changed_at=now, last=made)
        policy = attrs.evolve(policy, min=1)  # the signals never take it to zero
    found = recommend(policy.target, ready, values)
    if found is None:
        made = decision(current, ScaleDirection.HOLD, ScaleCause.NO_SIGNAL)
        return made, ScaleMemory(current, memory.changed_at, last=made)
    wanted, key = found
    inputs = {"signal": key, "value": values[key], "target": policy.target.signals()[key]}
    if wanted < current:
        goals = policy.target.signals()
        kept = max(math.ceil(ready * values[k] / (goals[k] * DOWN_HEADROOM)) for k in goals if k in values)
        wanted = max(wanted, kept)
    clamped = min(max(wanted, policy.min), policy.max)
    cooling = now - memory.changed_at < policy.cooldown
    if wanted > current:
        last = memory.last_change
        since_down = now - memory.changed_at
        stepped_down = last is not None and last.direction == ScaleDirection.DOWN
        if clamped == current:  # at max
            made = decision(current, ScaleDirection.HOLD, ScaleCause.AT_MAX, **inputs)
        elif stepped_down and since_down < policy.scale_down_after:
            # one change of direction per stabilization window: a scale-down is not undone within it
            made = decision(current, ScaleDirection.HOLD, ScaleCause.STABILIZING, **inputs, window=since_down)
        elif cooling:
            made = decision(current, ScaleDirection.HOLD, ScaleCause.COOLDOWN, **inputs)
        else:
            after = min(clamped, current + policy.max_step)
            made = decision(after, ScaleDirection.UP, ScaleCause.OVER_TARGET, **inputs)
            return made, ScaleMemory(after, changed_at=now, last=made)
        return made, ScaleMemory(current, memory.changed_at, last=made)
    if clamped < current:
        low_since = now if memory.low_since is None else memory.low_since
        peak = clamped if memory.low_since is None else max(memory.low_peak, clamped)
        low = now - low_since
        if low < policy.scale_down_after or cooling:
            cause = ScaleCause.STABILIZING if low < policy.scale_down_after else ScaleCause.COOLDOWN
            made = decision(current, ScaleDirection.HOLD, cause, **inputs, window=low)
            return made, ScaleMemory(current, memory.changed_at, low_since, peak, last=made)
        after = max(peak, current - policy.max_step)
        made = decision(after, ScaleDirection.DOWN, ScaleCause.UNDER_TARGET, **inputs, window=low)
        # the next step down needs a window of its own: recommendations were relative to the replicas then
        return made, ScaleMemory(after, changed_at=now, last=made)
    made = decision(current, ScaleDirection.HOLD, ScaleCause.AT_TARGET, **inputs)
    return made, ScaleMemory(current, memory.changed_at, last=made)


def give_way(
    models: Mapping[str, tuple[Model, ScaleMemory]], starving: Iterable[str], now: float
) -> tuple[ScaleDecision, ScaleMemory] | None:
    """When the fleet is full: one replica a lower-priority model gives to a higher-priority one. Pure.

    :param models: every autoscaled model: its catalog entry and its memory after this pass's decisions.
    :param starving: autoscaled models with replicas the scheduler found no place for.
    :returns: the giving model's step down (cause ``give-way``, naming the model it gives way to), or None:
        no starving model, or none of lower priority above its ``min`` and out of its cooldown.
    """
    takers = sorted(
        ((models[name][0].priority, name) for name in set(starving) if name in models), reverse=True
    )
    for priority, taker in takers:
        donors = [
            (model.priority, -memory.desired, name)
            for name, (model, memory) in models.items()
            if model.priority < priority
            and model.autoscale is not None
            and memory.desired > model.autoscale.min
            and now - memory.changed_at >= model.autoscale.cooldown
        ]
        if donors:
            _, _, donor = min(donors)
            memory = models[donor][1]
            made = ScaleDecision(
                donor, now, memory.desired, memory.desired - 1, ScaleDirection.DOWN, ScaleCause.GIVE_WAY,
                signal=None, value=float(models[donor][0].priority), target=float(priority), to=taker,
            )  # fmt: skip
            return made, ScaleMemory(memory.desired - 1, changed_at=now, last=made)
    return None


def step(state: ClusterState, now: float) -> None:
    """Decide for every autoscaled model of the catalog in force; called by the reconciler each pass.

    A model with replicas the scheduler could not place takes one from a lower-priority model (see
    :func:`give_way`), and while it waits for them no lower-priority model scales up.
    """
    book = state.autoscale
    by_model: dict[str, list[ReplicaRecord]] = {}
    for record in state.replicas.values():
        by_model.setdefault(record.placement.model, []).append(record)
    starving = {item.model for item in state.unplaced if item.replaces is None}
    decided: dict[str, tuple[Model, ScaleMemory]] = {}
    for name, model in sorted(state.catalog.models.items()):
        if model.autoscale is None:
            continue
        records = by_model.get(name, [])
        memory = book.memory(name, model, (r.placement for r in records))
        ready, values = book.signals(model.autoscale.target, records, now, name)
        demand = book.demand_of(name, now) if model.autoscale.min == 0 else None
        made, after = decide(
            name, model.autoscale, memory, ready, values, now, idle_after=model.idle_after, demand=demand
        )
        above = [
            o
            for o in starving
            if o in state.catalog.models and state.catalog.models[o].priority > model.priority
        ]
        if made.direction == ScaleDirection.UP and above:
            made = attrs.evolve(
                made, after=made.before, direction=ScaleDirection.HOLD, cause=ScaleCause.YIELD
            )
            after = ScaleMemory(memory.desired, memory.changed_at, last=made)
        state.scale(made, after, now)
        decided[name] = (model, book.models[name])
    given = give_way(decided, starving, now)
    if given is not None:
        state.scale(*given, now)
