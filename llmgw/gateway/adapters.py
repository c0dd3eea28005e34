"""Requests for LoRA adapters: which adapter a request names, held while no replica has it loaded.

A client names an adapter as its model (``"model": "sql"``) or under its base (``"chat:sql"``); the
routes feed's :attr:`~llmgw.wire.RouteTable.adapters` lists each adapter with its base model and the
ready replicas that have it loaded. A request for an adapter loaded somewhere is a hit: it goes to one
of those replicas, by the gateway's routing rule. Otherwise it is a miss: :meth:`AdapterDemand.hold`
keeps it (``--hold-timeout``, ``--hold-queue`` per adapter, as for a model at zero replicas) and the
activity report goes to the server at once; the server's adapter controller has a replica load it and
the routes feed brings it. A load that fails answers the held requests with the adapter, the cause
(:class:`~llmgw.wire.AdapterCause`) and the engine's word.

Each request body is sent with the fields the replica's engine wants for the adapter
(:func:`adapter_body`; vLLM's and the sim's: ``model`` set to the adapter's name). A request for the base
model gets the fields the routes feed's :attr:`~llmgw.wire.RouteTable.base_fields` give for its replica
(:func:`base_body`; llama.cpp's: every adapter at scale 0, since some builds apply an adapter loaded at
start to every request that does not say otherwise).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import trio

from llmgw.wire import AdapterActivity, AdapterFailure, AdapterRoutes, RouteTable

__all__ = ["AdapterDemand", "adapter_body", "base_body", "request_body", "resolve"]


def resolve(table: RouteTable, model: str) -> tuple[str, str] | None:
    """``(base model, adapter)`` when ``model`` names an adapter of the routes feed (``sql`` or
    ``chat:sql``); None when it names none. Called for each request whose model is not a served model."""
    entry = table.adapters.get(model)
    if entry is not None:
        return entry.model, model
    base, sep, adapter = model.partition(":")
    entry = table.adapters.get(adapter) if sep else None
    if entry is not None and entry.model == base:
        return base, adapter
    return None


def adapter_body(body: bytes, requested: str, fields: Mapping[str, Any] | None, adapter: str) -> bytes:
    """The request ``body`` with the engine's ``fields`` for ``adapter`` set (None: ``model`` = adapter);
    unchanged, not parsed, when those are only the ``model`` the client already sent. Called for each
    attempt of a request for an adapter."""
    wanted = dict(fields) if fields is not None else {"model": adapter}
    if wanted == {"model": requested}:
        return body
    data = json.loads(body)
    data.update(wanted)
    return json.dumps(data, separators=(",", ":")).encode()


def base_body(body: bytes, fields: Mapping[str, Any] | None) -> bytes:
    """The base-model request ``body`` with its replica's ``fields`` set (replacing keys they name);
    unchanged, not parsed, when there are none. Called for each attempt of a request for a base model."""
    if not fields:
        return body
    data = json.loads(body)
    data.update(fields)
    return json.dumps(data, separators=(",", ":")).encode()


def request_body(body: bytes, fields: Mapping[str, Any] | None, adapter: str | None, requested: str) -> bytes:
    """The body to send a replica for a request: with the ``fields`` its engine wants for ``adapter``
    (:func:`adapter_body`), or for the base model when ``adapter`` is None (:func:`base_body`).
    Called for each attempt; ``requested`` is the model as the client named it."""
    if adapter is not None:
        return adapter_body(body, requested, fields, adapter)
    return base_body(body, fields)


class AdapterDemand:
    """Hits, misses and held requests per adapter, reported with the gateway's activity.

    :param hold_timeout: seconds a request waits for its adapter to be loaded.
    :param hold_queue: requests held at once per adapter; more are refused.
    :param report_now: called when a request is held (the activity report goes at once).
    """

    def __init__(self, hold_timeout: float, hold_queue: int, report_now: Callable[[], None]) -> None:
        self.hold_timeout = hold_timeout
        self.hold_queue = hold_queue
        self.report_now = report_now
        #: (model, adapter) -> requests since the last report that found it loaded / not loaded
        self.hits: Counter[tuple[str, str]] = Counter()
        self.misses: Counter[tuple[str, str]] = Counter()
        #: (model, adapter) -> requests held now
        self.held: Counter[tuple[str, str]] = Counter()
        #: adapter -> its entry in the last routes table
        self.entries: Mapping[str, AdapterRoutes] = {}
        self._changed = trio.Event()

    def routes_changed(self, table: RouteTable) -> None:
        """Take a new routes table; held requests look again. Called by the routes watcher's callback."""
        self.entries = table.adapters
        self._changed.set()
        self._changed = trio.Event()

    def hit(self, model: str, adapter: str) -> None:
        """A request for ``adapter`` found it loaded."""
        self.hits[(model, adapter)] += 1

    async def hold(
        self, model: str, adapter: str, routed: Callable[[], bool]
    ) -> tuple[str, AdapterFailure | None]:
        """Hold a request for ``adapter`` (of ``model``) until ``routed()``, its load fails, or the hold ends.

        :returns: ``("", None)`` once routed; else why not, and the load's failure when that is why.
        """
        key = (model, adapter)
        self.misses[key] += 1
        if self.held[key] >= self.hold_queue:
            why = (
                f"adapter `{adapter}` of model `{model}` is being loaded and {self.held[key]} requests wait "
                f"for it already (--hold-queue {self.hold_queue}); retry later"
            )
            return why, None
        entry = self.entries.get(adapter)
        seen = entry.failure.count if entry is not None and entry.failure is not None else 0
        self.held[key] += 1
        self.report_now()
        try:
            with trio.move_on_after(self.hold_timeout):
                while not routed():
                    entry = self.entries.get(adapter)
                    failure = entry.failure if entry is not None else None
                    if failure is not None and failure.count > seen:
                        why = (
                            f"adapter `{adapter}` of model `{model}` could not be loaded "
                            f"({failure.cause.value}): {failure.detail}"
                        )
                        return why, failure
                    await self._changed.wait()
                return "", None
        finally:
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]
        return (
            f"adapter `{adapter}` of model `{model}` was not loaded within {self.hold_timeout:g} s "
            "(--hold-timeout); retry later"
        ), None

    def activity(self) -> tuple[AdapterActivity, ...]:
        """What to report, and start a new window: each adapter requested or held since the last report."""
        keys = sorted(self.hits.keys() | self.misses.keys() | self.held.keys())
        out = tuple(
            AdapterActivity(m, a, self.hits[(m, a)], self.misses[(m, a)], self.held[(m, a)]) for m, a in keys
        )
        self.hits.clear()
        self.misses.clear()
        return out
