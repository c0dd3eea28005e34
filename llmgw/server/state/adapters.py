"""The adapters' book: which LoRA adapters each replica should keep loaded, what agents report of them, and
what gateways saw of their use.

The use counts and wants are kept in memory only, as the autoscaler's book is. What each replica should
keep and has loaded is stored with its row (:mod:`llmgw.server.persist.adapters`): a standby routes it, and
a new leader (failover, or a restart) starts from it (:meth:`AdapterBook.restore`) and adopts what agents
report loaded for the replica attempts it knows (:meth:`AdapterBook.adopt`), so no agent unloads anything
on a leader change. The edges record
into it (:meth:`AdapterBook.observe` from syncs, :meth:`AdapterBook.note_activity` from gateway reports);
the adapter controller (:mod:`llmgw.server.controllers.adapters`) decides on it and the reconciler applies
its intents through the verbs here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from llmgw.wire import AdapterActivity, AdapterCause, AdapterFailure, AdapterState, ObservedAdapter

__all__ = ["AdapterUse", "AdapterBook", "WANT_EXPIRES", "SCORE_DECAY", "RESIDENCY"]

#: seconds a gateway's request for an adapter stays wanted when no replica of its model is ready to load it
WANT_EXPIRES = 600.0
#: seconds over which an adapter's request count decays to 1/e (:meth:`AdapterUse.score`)
SCORE_DECAY = 60.0
#: seconds an adapter stays loaded at least, so the requests that waited for its load are served by it
#: (unloaded at once for a newer one, they found it gone and waited for it again)
RESIDENCY = 1.0


@attrs.define
class AdapterUse:
    """One adapter's use and loads since the server started (``ctl adapters``)."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    failures: int = 0
    #: wall-clock time of its last request at a gateway, or of its last load (None: neither yet)
    last_use: float | None = None
    failure: AdapterFailure | None = None
    #: its requests, each weighed down by :data:`SCORE_DECAY` since (as of ``scored_at``)
    requests: float = 0.0
    scored_at: float = 0.0

    def count(self, requests: int, now: float) -> None:
        """Add ``requests`` seen at ``now`` to its decayed count."""
        self.requests = self.score(now) + requests
        self.scored_at = now

    def score(self, now: float) -> float:
        """Its recent use at ``now``: requests, each weighed ``exp(-age / SCORE_DECAY)``. The adapter of a
        replica with the lowest is unloaded first: a hot adapter stays, however recent a tail one's load."""
        return self.requests * math.exp(-max(0.0, now - self.scored_at) / SCORE_DECAY)


class AdapterBook:
    """See the module docstring. Keys of adapters are ``(model, adapter)``: the catalog model's name."""

    def __init__(self) -> None:
        #: replica id -> (its attempt, adapter name -> source), in the order the loads were decided
        self.desired: dict[str, tuple[int, dict[str, str]]] = {}
        #: replica id -> adapter name -> what its agent last reported
        self.observed: dict[str, dict[str, ObservedAdapter]] = {}
        #: replica id -> the adapters the routes feed says it has loaded
        self.routed: dict[str, frozenset[str]] = {}
        #: (model, adapter) -> its use
        self.uses: dict[tuple[str, str], AdapterUse] = {}
        #: (model, adapter) -> when a gateway first held a request for it (the controller loads it)
        self.wanted: dict[tuple[str, str], float] = {}
        #: (replica id, attempt, adapter) of loads counted as ended (the agent reports them until unloaded)
        self.counted: set[tuple[str, int, str]] = set()
        #: loads that ended since the server's metrics last took them: (model, what the agent reported)
        self.finished: list[tuple[str, ObservedAdapter]] = []
        #: (replica id, adapter) -> when its last load on that replica ended (see :data:`RESIDENCY`)
        self.loaded_at: dict[tuple[str, str], float] = {}
        #: ready replicas as this server loaded them from the store, whose agent's report of the adapters
        #: they hold is not yet adopted (the controller adopts it once their rank 0's node has synced)
        self.adopting: set[str] = set()

    def use(self, model: str, adapter: str) -> AdapterUse:
        """The use record of ``(model, adapter)``, made on first need."""
        return self.uses.setdefault((model, adapter), AdapterUse())

    # -- inputs from the edges ---------------------------------------------------------------------

    def observe(self, replicas: Iterable[str], adapters: Iterable[ObservedAdapter]) -> bool:
        """Record what a node's agent reported of the adapters of the replicas whose rank 0 it runs.

        Called for every sync, with the node's rank-0 ``replicas`` (their previous reports are replaced).

        :returns: whether a load ended or an adapter left (the reconciler should run); a load that only
            began changes nothing the controller acts on.
        """
        fresh: dict[str, dict[str, ObservedAdapter]] = {}
        for adapter in adapters:
            fresh.setdefault(adapter.replica_id, {})[adapter.name] = adapter
        changed = False
        for replica in set(replicas) | fresh.keys():
            now = fresh.get(replica, {})
            gone = {c for c in self.counted if c[0] == replica and c[2] not in now}
            self.counted -= gone  # reported no more (unloaded, or a failure let go): a new load counts
            before = self.observed.get(replica, {})
            if before != now:
                changed = (
                    changed
                    or any(
                        seen.state != AdapterState.LOADING and before.get(name) != seen
                        for name, seen in now.items()
                    )
                    or bool(before.keys() - now.keys())
                )
                if now:
                    self.observed[replica] = now
                else:
                    self.observed.pop(replica, None)
        return changed

    def note_activity(
        self, model_of: dict[str, str], adapters: Iterable[AdapterActivity], now: float
    ) -> bool:
        """Count a gateway's report; a held request makes its adapter wanted.

        :param model_of: a served model name -> its catalog name.
        :returns: whether some adapter is now wanted that was not (the reconciler should run at once).
        """
        wanted = False
        for seen in adapters:
            model = model_of.get(seen.model)
            if model is None:
                continue
            use = self.use(model, seen.adapter)
            use.hits += seen.hits
            use.misses += seen.misses
            use.count(seen.hits + seen.misses, now)
            if seen.hits or seen.misses or seen.held:
                use.last_use = now
            if seen.held and (model, seen.adapter) not in self.wanted:
                self.wanted[(model, seen.adapter)] = now
                wanted = True
        return wanted

    # -- the controller's verbs --------------------------------------------------------------------

    def load(self, replica: str, attempt: int, model: str, adapter: str, source: str, now: float) -> None:
        """Ask ``replica`` to load ``adapter``: it joins the replica's desired set; it is no longer wanted."""
        held = self.desired.get(replica)
        if held is None or held[0] != attempt:
            held = self.desired[replica] = (attempt, {})
        held[1][adapter] = source
        self.wanted.pop((model, adapter), None)
        self.use(model, adapter).last_use = now

    def unload(self, replica: str, adapter: str) -> None:
        """Take ``adapter`` out of ``replica``'s desired set (its agent unloads it)."""
        held = self.desired.get(replica)
        if held is not None:
            held[1].pop(adapter, None)
            self.counted.discard((replica, held[0], adapter))

    def forget(self, replica: str) -> None:
        """``replica`` is no longer ready, or runs a new attempt: it holds nothing."""
        self.adopting.discard(replica)
        self.desired.pop(replica, None)
        self.routed.pop(replica, None)
        self.observed.pop(replica, None)
        self.loaded_at = {k: v for k, v in self.loaded_at.items() if k[0] != replica}
        self.counted = {c for c in self.counted if c[0] != replica}

    def ended(self, replica: str, observed: ObservedAdapter, model: str, now: float) -> bool:
        """Count a load that ended (loaded or failed) once; a failure leaves the desired set.

        :returns: whether it was not counted before.
        """
        key = (replica, observed.attempt, observed.name)
        if key in self.counted:
            return False
        self.counted.add(key)
        use = self.use(model, observed.name)
        if observed.state == AdapterState.FAILED:
            use.failures += 1
            cause = observed.cause or AdapterCause.REFUSED
            count = use.failure.count + 1 if use.failure is not None else 1
            use.failure = AdapterFailure(cause, observed.detail or cause.value, count)
            held = self.desired.get(replica)
            if held is not None:
                held[1].pop(observed.name, None)
        else:
            use.loads += 1
            self.loaded_at[(replica, observed.name)] = now
        return True

    def route(self, replica: str, loaded: frozenset[str]) -> None:
        """The routes feed says ``replica`` has ``loaded``."""
        if loaded:
            self.routed[replica] = loaded
        else:
            self.routed.pop(replica, None)

    def restore(self, replica: str, attempt: int, desired: dict[str, str], loaded: frozenset[str]) -> None:
        """Put back what the store holds of ``replica`` at ``attempt`` (as the server loads it): its desired
        adapters (name -> source) and those routed as loaded, whose loads are counted already."""
        if desired:
            self.desired[replica] = (attempt, dict(desired))
        if loaded:
            self.routed[replica] = loaded
        self.counted |= {(replica, attempt, name) for name in loaded}

    def adopt(self, replica: str, attempt: int, adapters: dict[str, str], loaded: frozenset[str]) -> None:
        """Keep on ``replica`` at ``attempt`` the ``adapters`` (name -> source) its agent reports holding
        though this server never asked (a new leader); ``loaded`` of them are routed, their loads counted
        already. Its adoption is over."""
        self.adopting.discard(replica)
        if adapters:
            held = self.desired.get(replica)
            if held is None or held[0] != attempt:
                held = self.desired[replica] = (attempt, {})
            held[1].update(adapters)
        if loaded:
            self.routed[replica] = self.routed.get(replica, frozenset()) | loaded
        self.counted |= {(replica, attempt, name) for name in loaded}

    def expire_wants(self, now: float) -> None:
        """Drop the wants older than :data:`WANT_EXPIRES` (no replica came to load them)."""
        for key, since in list(self.wanted.items()):
            if now - since > WANT_EXPIRES:
                del self.wanted[key]
