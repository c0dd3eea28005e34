"""LoRA adapters on the wire: what the server asks a replica to keep loaded, what the agent reports, where
the routes feed says each is loaded, what gateways saw, and ``ctl adapters``.

- :class:`DesiredAdapters` in :class:`~llmgw.wire.SyncReply` (server -> agent of rank 0's node);
- :class:`ObservedAdapter` in :class:`~llmgw.wire.SyncRequest` (agent -> server), with an
  :class:`AdapterCause` when a load failed;
- :class:`AdapterRoutes` in :class:`~llmgw.wire.RouteTable` (server -> gateways);
- :class:`AdapterActivity` in :class:`~llmgw.wire.GatewayActivity` (gateway -> server): hits, misses and
  requests held for an adapter no replica has loaded (the server loads it);
- :class:`AdapterList` for ``GET /v1/adapters`` (``llmgw ctl adapters``).

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from llmgw.models import bounded

__all__ = [
    "AdapterCause",
    "AdapterState",
    "ObservedAdapter",
    "DesiredAdapters",
    "AdapterFailure",
    "AdapterRoutes",
    "AdapterActivity",
    "AdapterStatus",
    "AdapterList",
]


class AdapterState(enum.StrEnum):
    """An adapter on one replica, as its agent reports it; the value is the JSON spelling."""

    #: being staged (fetched to the node) or loaded into the engine
    LOADING = "loading"
    #: the engine serves it
    LOADED = "loaded"
    #: the load failed (:class:`AdapterCause` says why); the replica serves the others
    FAILED = "failed"


class AdapterCause(enum.StrEnum):
    """Why an adapter load failed: the metric label, the event and the client's error code."""

    #: the adapter's files could not be fetched or found on the node
    STAGING = "staging"
    #: the engine answered the load with an error (a bad adapter, a rank over the limit, no slot)
    REFUSED = "refused"
    #: the engine did not answer the load within its call's timeout, or the connection broke
    UNREACHABLE = "unreachable"
    #: the replica's engine does not serve adapters
    UNSUPPORTED = "unsupported"


@attrs.frozen
class ObservedAdapter:
    """One adapter on one replica (its rank 0's node reports it), in a sync."""

    replica_id: str = attrs.field(validator=bounded(text=253))
    #: the replica's attempt the engine belongs to: a restarted replica starts with none loaded
    attempt: int
    name: str = attrs.field(validator=bounded(text=253))
    state: AdapterState
    cause: AdapterCause | None = None
    #: what the engine or the staging said, for the operator and the client's error
    detail: str | None = attrs.field(default=None, validator=bounded(text=2000))
    #: seconds the load took (staging and the engine's call), once loaded or failed
    seconds: float | None = None


@attrs.frozen
class DesiredAdapters:
    """The adapters one replica should keep loaded (the server's word), with their sources."""

    replica_id: str
    attempt: int
    #: adapter name -> its source (a local path, or one the agent stages as weights)
    adapters: Mapping[str, str] = attrs.field(converter=dict, factory=dict)


@attrs.frozen
class AdapterFailure:
    """The last failed load of an adapter: why, and a count that moves with each failure (a gateway
    holding a request answers it when the count moves past the one it saw)."""

    cause: AdapterCause
    detail: str
    count: int


def _loaded(value: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {replica: dict(fields) for replica, fields in value.items()}


@attrs.frozen
class AdapterRoutes:
    """One adapter in the routes feed: its base model, and the ready replicas that have it loaded."""

    #: the base model's served name
    model: str
    #: replica id -> the request body fields that make its engine answer with the adapter
    #: (:meth:`llmgw.engine.Engine.lora_request_fields`); empty when it is loaded nowhere
    loaded: Mapping[str, Mapping[str, Any]] = attrs.field(converter=_loaded, factory=dict)
    failure: AdapterFailure | None = None


@attrs.frozen
class AdapterActivity:
    """What one gateway saw of one adapter since its last report."""

    model: str = attrs.field(validator=bounded(text=253))
    adapter: str = attrs.field(validator=bounded(text=253))
    #: requests that found a replica with it loaded
    hits: int = 0
    #: requests that found none (each waited for a load)
    misses: int = 0
    #: requests waiting now for it to be loaded: the server loads it
    held: int = 0


@attrs.frozen
class AdapterStatus:
    """One adapter for ``ctl adapters``: where it is loaded, how it is used."""

    model: str
    adapter: str
    source: str
    #: replica ids with it loaded
    loaded: tuple[str, ...] = ()
    #: replica ids loading it now
    loading: tuple[str, ...] = ()
    hits: int = 0
    misses: int = 0
    loads: int = 0
    failures: int = 0
    #: wall-clock time of its last request at a gateway (None: none since the server started)
    last_use: float | None = None
    #: the last failure's cause and detail
    failure: AdapterFailure | None = None


@attrs.frozen
class AdapterList:
    """``GET /v1/adapters[?model=M]``."""

    adapters: tuple[AdapterStatus, ...] = ()
