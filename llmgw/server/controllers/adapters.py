"""The adapter controller: which ready replica loads a LoRA adapter a gateway asked for, and which it unloads.

Each pass (:func:`step`) looks at the adapters' book
(:class:`~llmgw.server.state.adapters.AdapterBook`) and the ready replicas, and returns intents the
reconciler applies:

- :class:`Forget` a replica that is no longer ready or runs a new attempt (a restarted engine holds no
  adapter: it loads them again on demand);
- :class:`Adopt` what the agent of a ready replica reports loaded (or loading) at its current attempt
  when this server did not ask for it: a new leader (failover, or a restart) adopts it, as it adopts running
  shards, once the replica's rank-0 node has synced with it (only then: afterwards an adapter reported and
  not desired is one being unloaded); never more than the replica's slots, and only adapters of its model;
- :class:`Ended` a load its agent reports loaded or failed (counted once; a failure leaves the desired set,
  and the gateways answer the requests held for it with its cause);
- :class:`Routed` a replica whose loaded adapters differ from what the routes feed says. A replica whose
  engine loads adapters only at start (llama.cpp; its launch's ``profile.adapters_at_start``) has every
  adapter of its launch's model loaded once it is ready (its engine is not ready before they are): it is
  routed for all of them at once, is never asked to load or unload one, and holds them all for the
  placement of wanted adapters and their copies;
- :class:`Load` an adapter a gateway holds requests for and no replica loads: on the ready replica of its
  model where it costs least: a free slot first, on the least busy replica (its adapters' recent
  requests), else the replica whose least used loaded adapter is used least (requests decayed over a
  minute, :meth:`~llmgw.server.state.adapters.AdapterUse.score`; within one request: the least busy
  replica), that adapter unloaded in the same intent. Plain LRU unloads hot adapters: with a long tail,
  loads come faster than gateways report use. An adapter being loaded is never unloaded for another,
  nor is a replica chosen whose least used adapter was loaded less than ``RESIDENCY`` seconds ago (the
  requests that waited for it are being served; unloading a more used one in its stead would unload hot
  adapters under a long tail); when no replica can take it now, the want waits for the next pass, as
  it does on a replica whose agent still reports the adapter's last failed load;
- one more :class:`Load` of an adapter so hot that the one replica serving it would carry more than a
  quarter of its fair share for it alone: the gateways spread its requests over its copies, as they do a
  model's over its replicas. A copy unloads only an adapter used less than it would be per copy.

The controller writes nothing; :func:`step` is a pure function of the state and ``now``.
"""

from __future__ import annotations

import math

import attrs

from llmgw.server.state.adapters import RESIDENCY
from llmgw.server.state.cluster import ClusterState
from llmgw.server.state.records import ReplicaRecord, ReplicaState
from llmgw.wire import AdapterState, ObservedAdapter

__all__ = ["Forget", "Adopt", "Ended", "Routed", "Load", "Satisfied", "Intent", "loaded_at_start", "step"]


@attrs.frozen
class Forget:
    """``replica`` holds nothing any more (not ready, or a new attempt)."""

    replica: str


@attrs.frozen
class Adopt:
    """Keep on ``replica`` (at ``attempt``) the ``adapters`` (name -> source) its agent holds unasked;
    ``loaded`` of them are loaded (the others loading). Empty: nothing to adopt, its adoption is over."""

    replica: str
    attempt: int
    model: str
    adapters: dict[str, str]
    loaded: frozenset[str]


@attrs.frozen
class Ended:
    """A load on ``replica`` ended, as its agent reports it (``observed`` is loaded or failed)."""

    replica: str
    model: str
    observed: ObservedAdapter


@attrs.frozen
class Routed:
    """The routes feed should say ``replica`` has ``loaded`` (``added`` and ``removed`` since it last did)."""

    replica: str
    model: str
    loaded: frozenset[str]
    added: frozenset[str]
    removed: frozenset[str]
    #: the replica's engine loaded them at start (no load was asked for)
    at_start: bool = False


@attrs.frozen
class Load:
    """``replica`` (at ``attempt``) loads ``adapter`` of ``model`` from ``source``, ``evict`` first."""

    replica: str
    attempt: int
    model: str
    adapter: str
    source: str
    evict: str | None = None


@attrs.frozen
class Satisfied:
    """A wanted adapter is loaded or loading somewhere already, or cannot be (not in the catalog)."""

    model: str
    adapter: str


Intent = Forget | Adopt | Ended | Routed | Load | Satisfied

#: decayed requests of a model's adapters (:meth:`~llmgw.server.state.adapters.AdapterUse.score`) below
#: which no adapter gets a second copy (too few to tell a hot one)
SPREAD_AFTER = 50.0
#: an adapter gets a copy for each 1/SPREAD of a replica's fair share of the requests it takes
SPREAD = 4


def step(state: ClusterState, now: float) -> list[Intent]:
    """The adapter intents for this pass, in the order to apply them; called once per reconcile pass.

    :returns: the intents (empty when nothing is to change).
    """
    book = state.adapters
    ready = {r.id: r for r in state.replicas.values() if r.state == ReplicaState.READY}
    intents: list[Intent] = []
    desired: dict[str, dict[str, str]] = {}
    for replica in sorted(book.desired.keys() | book.routed.keys() | book.observed.keys()):
        record = ready.get(replica)
        held = book.desired.get(replica)
        if record is None or (held is not None and held[0] != record.attempt):
            intents.append(Forget(replica))
    forgotten = {i.replica for i in intents if isinstance(i, Forget)}
    for replica, record in sorted(ready.items()):
        at_start = loaded_at_start(state, record)
        if at_start is not None:  # every adapter loaded with the engine: nothing to load, unload or report
            desired[replica] = dict(at_start)
            before = book.routed.get(replica, frozenset()) if replica not in forgotten else frozenset()
            loaded = frozenset(at_start)
            if loaded != before:
                added, removed = loaded - before, before - loaded
                intents.append(Routed(replica, record.placement.model, loaded, added, removed, at_start=True))
            continue
        held = book.desired.get(replica)
        desired[replica] = dict(held[1]) if held is not None and replica not in forgotten else {}
        if replica in book.adopting and replica not in forgotten:
            # until its node synced, what the store holds stands (routed as it was); once adopted, its
            # loads are counted and routed when applied: the next pass goes on from there
            adopt = _adopt(state, record, desired[replica])
            if adopt is not None:
                intents.append(adopt)
                desired[replica].update(adopt.adapters)
            continue
        observed = {
            name: seen
            for name, seen in book.observed.get(replica, {}).items()
            if seen.attempt == record.attempt and replica not in forgotten
        }
        for seen in observed.values():
            ended = seen.state in (AdapterState.LOADED, AdapterState.FAILED)
            if (
                ended
                and (replica, seen.attempt, seen.name) not in book.counted
                and seen.name in desired[replica]
            ):
                intents.append(Ended(replica, record.placement.model, seen))
                if seen.state == AdapterState.FAILED:
                    desired[replica].pop(seen.name, None)
        loaded = frozenset(
            name
            for name, seen in observed.items()
            if seen.state == AdapterState.LOADED and name in desired[replica]
        )
        before = book.routed.get(replica, frozenset()) if replica not in forgotten else frozenset()
        if loaded != before:
            intents.append(Routed(replica, record.placement.model, loaded, loaded - before, before - loaded))
    intents.extend(_loads(state, ready, desired, now))
    return intents


def _adopt(state: ClusterState, record: ReplicaRecord, desired: dict[str, str]) -> Adopt | None:
    """The :class:`Adopt` of what ``record``'s agent reports holding beyond ``desired`` (loaded ones first,
    within its slots), once its rank-0 node has synced with this server; None before."""
    node = state.nodes.get(record.placement.rank0.node_id)
    if node is None or not node.reported:
        return None
    launch = state.launch_of(record)
    catalog_model = state.catalog.models.get(record.placement.model)
    known = catalog_model.adapters if catalog_model is not None else {}
    slots = launch.profile.max_adapters if launch is not None else 0
    reported = [
        seen
        for seen in state.adapters.observed.get(record.id, {}).values()
        if seen.attempt == record.attempt
        and seen.state in (AdapterState.LOADED, AdapterState.LOADING)
        and seen.name in known
        and seen.name not in desired
    ]
    reported.sort(key=lambda seen: (seen.state != AdapterState.LOADED, seen.name))
    kept = reported[: max(0, slots - len(desired))]
    adapters = {seen.name: known[seen.name] for seen in kept}
    loaded = frozenset(seen.name for seen in kept if seen.state == AdapterState.LOADED)
    return Adopt(record.id, record.attempt, record.placement.model, adapters, loaded)


def loaded_at_start(state: ClusterState, record: ReplicaRecord) -> dict[str, str] | None:
    """The adapters (name -> source) ``record``'s engine loaded at start, when its launch's profile runs an
    engine that loads adapters only at start; None otherwise (its adapters are loaded on demand)."""
    launch = state.launch_of(record)
    if launch is None or not launch.profile.adapters_at_start:
        return None
    return dict(launch.model.adapters)


def _loads(
    state: ClusterState, ready: dict[str, ReplicaRecord], desired: dict[str, dict[str, str]], now: float
) -> list[Intent]:
    """A :class:`Load` (or :class:`Satisfied`) for each wanted adapter, oldest want first; then one more
    copy of each adapter hot enough to need it (:func:`_copies`)."""
    book = state.adapters
    intents: list[Intent] = []
    for (model, adapter), _since in sorted(book.wanted.items(), key=lambda item: item[1]):
        catalog_model = state.catalog.models.get(model)
        source = catalog_model.adapters.get(adapter) if catalog_model is not None else None
        replicas = [r for r in ready.values() if r.placement.model == model]
        if source is None or any(adapter in desired[r.id] for r in replicas):
            intents.append(Satisfied(model, adapter))
            continue
        load = _place(state, model, adapter, source, replicas, desired, now)
        if load is not None:  # else no ready replica, or every slot is loading: the next pass tries again
            intents.append(load)
    for model, catalog_model in sorted(state.catalog.models.items()):
        replicas = [r for r in ready.values() if r.placement.model == model]
        if len(replicas) < 2 or not catalog_model.adapters:
            continue
        for adapter, wanted in _copies(state, model, len(replicas), now):
            holding = [r for r in replicas if adapter in desired[r.id]]
            if not holding or len(holding) >= wanted:
                continue
            others = [r for r in replicas if adapter not in desired[r.id]]
            score = book.use(model, adapter).score(now) / (len(holding) + 1)
            load = _place(state, model, adapter, catalog_model.adapters[adapter], others, desired, now, score)
            if load is not None:
                intents.append(load)
    return intents


def _copies(state: ClusterState, model: str, replicas: int, now: float) -> list[tuple[str, int]]:
    """The adapters of ``model`` that need more than one copy, each with how many: an adapter with share
    ``s`` of the model's recent requests gets ``ceil(SPREAD * s * replicas)`` (a replica would otherwise
    carry more than 1/SPREAD of its fair share for it alone: the adapters on one replica are uneven, and
    a replica kept busy by one while others idle loses throughput), once the model had
    :data:`SPREAD_AFTER` requests lately."""
    scores = {name: use.score(now) for (m, name), use in state.adapters.uses.items() if m == model}
    total = sum(scores.values())
    if total < SPREAD_AFTER:
        return []
    out = []
    for name, score in sorted(scores.items(), key=lambda item: -item[1]):
        wanted = min(replicas, math.ceil(SPREAD * replicas * score / total))
        if wanted < 2:
            break
        out.append((name, wanted))
    return out


def _place(
    state: ClusterState,
    model: str,
    adapter: str,
    source: str,
    replicas: list[ReplicaRecord],
    desired: dict[str, dict[str, str]],
    now: float,
    ceiling: float | None = None,
) -> Load | None:
    """The :class:`Load` of ``adapter`` on the one of ``replicas`` where it costs least (recorded in
    ``desired``): a free slot on the least busy replica (its adapters' recent requests, shared among their
    copies), else the replica whose least used adapter is used least (only one used less than ``ceiling``,
    when given); None when no replica can take it now."""
    book = state.adapters
    best: tuple[tuple, ReplicaRecord, str | None] | None = None
    for record in replicas:
        if loaded_at_start(state, record) is not None:
            continue  # its engine loads no adapter after its start
        seen = book.observed.get(record.id, {}).get(adapter)
        if seen is not None and seen.attempt == record.attempt and seen.state == AdapterState.FAILED:
            continue  # its agent still reports the last failure: once it lets go, a new load is clear
        launch = state.launch_of(record)
        slots = launch.profile.max_adapters if launch is not None else 0
        held = desired[record.id]
        if len(held) < slots:
            cost: tuple = (0, _busy(state, model, held, desired, now), len(held), record.id)
            evict = None
        else:
            evict = _least_used(state, record, held, model, now)
            if evict is None:
                continue
            use = book.use(model, evict)
            if ceiling is not None and use.score(now) >= ceiling:
                continue
            # adapters used about as little (within one request): from the least busy replica, whose
            # seats the requests waiting for this load find free
            busy = _busy(state, model, held, desired, now)
            cost = (1, math.floor(use.score(now)), busy, record.id)
        if best is None or cost < best[0]:
            best = (cost, record, evict)
    if best is None:
        return None
    _, record, evict = best
    if evict is not None:
        desired[record.id].pop(evict, None)
    desired[record.id][adapter] = source
    return Load(record.id, record.attempt, model, adapter, source, evict)


def _busy(
    state: ClusterState, model: str, held: dict[str, str], desired: dict[str, dict[str, str]], now: float
) -> float:
    """A replica's share of its adapters' recent requests: each one's score over its copies."""
    busy = 0.0
    for name in held:
        use = state.adapters.uses.get((model, name))
        if use is not None:
            copies = sum(1 for other in desired.values() if name in other)
            busy += use.score(now) / max(1, copies)
    return busy


def _least_used(
    state: ClusterState, record: ReplicaRecord, held: dict[str, str], model: str, now: float
) -> str | None:
    """The loaded adapter of ``record`` least used lately (its decayed request count; ties: the one used
    longest ago); None when that one was loaded less than :data:`~llmgw.server.state.adapters.RESIDENCY`
    seconds ago (the requests that waited for it are being served: a more used one is not unloaded in its
    stead), or when every one is still loading."""
    book = state.adapters
    observed = book.observed.get(record.id, {})
    loaded = [
        name
        for name in held
        if (seen := observed.get(name)) is not None
        and seen.attempt == record.attempt
        and seen.state == AdapterState.LOADED
    ]
    if not loaded:
        return None

    def used(name: str) -> tuple[float, float]:
        use = book.uses.get((model, name))
        if use is None:
            return (0.0, float("-inf"))
        return (use.score(now), use.last_use if use.last_use is not None else float("-inf"))

    least = min(loaded, key=used)
    if (record.id, record.attempt, least) not in book.counted:  # its load's end is news of this very pass
        return None
    if now - book.loaded_at.get((record.id, least), float("-inf")) < RESIDENCY:
        return None
    return least
