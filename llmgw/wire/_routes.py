"""The routes feed (server -> gateway): ``GET /v1/routes``, which replicas serve each model.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from llmgw.wire._adapters import AdapterRoutes
from llmgw.wire._keys import KeyLimits

__all__ = ["Route", "RouteTable"]


def _http_url(_: Any, attribute: attrs.Attribute, value: str) -> None:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{attribute.name}: expected an http(s) URL, got {value!r}")


@attrs.frozen
class Route:
    """One ready replica of a served model: its id, the base URL of its rank 0, and what its engine can do."""

    replica: str
    url: str = attrs.field(converter=lambda url: url.rstrip("/"), validator=_http_url)
    #: its engine (at the version its node runs, with its profile's arguments) continues a chat's final
    #: assistant message (:meth:`llmgw.engine.Engine.continues_final_message`): the gateway may continue
    #: a stream broken elsewhere on it
    continues: bool = False


def _routes(routes: Mapping[str, Any]) -> dict[str, tuple[Route, ...]]:
    return {model: tuple(entries) for model, entries in routes.items() if entries}


@attrs.frozen
class RouteTable:
    """One answer of the routes feed: ``GET /v1/routes?revision=N&wait=1``.

    The server answers when its routes revision differs from N, or after its
    poll timeout. A model with routes is always among :attr:`models`; a model
    with no ready replica has no entry in :attr:`routes`.
    """

    revision: int
    #: every served model name in the catalog, ready or not (sorted)
    models: tuple[str, ...] = attrs.field(converter=lambda m: tuple(sorted(m)), default=())
    #: served model name -> its ready replicas
    routes: Mapping[str, tuple[Route, ...]] = attrs.field(converter=_routes, factory=dict)
    #: sha256 hex (lowercase) of an API key -> the key's name; None when the feed has no keys at all
    keys: Mapping[str, str] | None = attrs.field(
        converter=lambda keys: None if keys is None else {k.lower(): v for k, v in keys.items()},
        default=None,
    )
    #: models that may be at zero replicas and wake on demand (``replicas.min: 0``): with no route, a
    #: gateway holds their requests (``--hold-timeout``) and reports them, instead of answering 503 at once
    wake_on_demand: tuple[str, ...] = attrs.field(converter=lambda m: tuple(sorted(m)), default=())
    #: an API key's name -> its limits, for the keys that have any (a key not named here is unlimited)
    limits: Mapping[str, KeyLimits] = attrs.field(converter=dict, factory=dict)
    #: replica id -> the fields a gateway sets in a request for the *base* model sent to that replica, so
    #: that none of its adapters answers (:meth:`llmgw.engine.Engine.lora_base_request_fields`: llama.cpp's
    #: adapters at scale 0); only replicas that need some are listed
    base_fields: Mapping[str, Mapping[str, Any]] = attrs.field(
        converter=lambda value: {replica: dict(fields) for replica, fields in value.items()}, factory=dict
    )
    #: LoRA adapter name -> its base model and the ready replicas that have it loaded. Adapters are
    #: apart from :attr:`routes`: a load or an unload changes no replica's :class:`Route` (the
    #: gateway's breakers and requests in flight are keyed by it)
    adapters: Mapping[str, AdapterRoutes] = attrs.field(converter=dict, factory=dict)
    #: moves, in every server's numbering alike, whenever a replica left or joined :attr:`routes`: stored
    #: with the replicas, so a standby's table has the generation of the state it was read from. A
    #: gateway says which it holds (:class:`~llmgw.wire.RoutesHeld`); 0 from a server that numbers none
    generation: int = 0
    #: seconds the answering server holds a long-poll with no change: past twice that and 2 s the
    #: gateway takes the server for silent and moves on (None: it learns the wait from unchanged answers)
    poll_timeout: float | None = None

    def __attrs_post_init__(self) -> None:
        if not set(self.routes) <= set(self.models):
            object.__setattr__(self, "models", tuple(sorted(set(self.models) | set(self.routes))))

    def summary(self) -> str:
        """One line for the log: each model and how many replicas are ready."""
        parts = [f"{model}: {len(self.routes.get(model, ()))} ready" for model in self.models]
        return ", ".join(parts) or "no models"
