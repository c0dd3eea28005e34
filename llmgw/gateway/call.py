"""One client request on its way to a replica, and what the gateway learns of it as it goes."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from llmgw.gateway.admission import Ticket
from llmgw.gateway.balancer import Upstream
from llmgw.gateway.metrics import NO_KEY
from llmgw.gateway.usage import estimated_usage

__all__ = ["Call"]


@attrs.define
class Call:
    """One client request on its way to a replica."""

    model: str
    #: ``chat/completions``, ``completions`` or ``embeddings``
    endpoint: str
    path: str
    body: bytes
    request_id: str
    session: str | None
    #: trio time the request arrived
    start: float
    #: the replica that answered, once one did
    replica: Upstream | None = None
    #: called once the response to the client is over (:attr:`llmgw.net.server.Response.after`)
    after: Callable[[], object] | None = None
    #: the prompt's prefix keys, for prefix-aware routing (empty: not used)
    prefix: tuple[bytes, ...] = ()
    #: the API key's name (:data:`llmgw.gateway.metrics.NO_KEY` without keys)
    key: str = NO_KEY
    #: (prompt, completion) tokens from the engine's usage, once seen
    usage: tuple[int, int] | None = None
    #: seconds from arrival to the first chunk of a stream
    ttft: float | None = None
    #: the key's admission (:class:`llmgw.gateway.admission.Ticket`), ended with the response; None: unlimited
    ticket: Ticket | None = None
    #: events of a streamed answer so far
    events: int = 0
    #: characters of the prompt's text, measured for keys whose tokens are charged
    prompt_chars: int = 0
    #: times a broken stream went on from another replica (:mod:`llmgw.gateway.migration`)
    migrations: int = 0
    #: continuations tried (bounded by ``migration_limit``)
    migration_attempts: int = 0
    #: the longest gap in the stream from a migration: seconds from the broken replica's last event
    #: to the next one's first
    migration_gap: float | None = None
    #: it holds a seat in its model's queue (:mod:`llmgw.gateway.queue`), freed when its answer ends
    seated: bool = False
    #: the LoRA adapter it asks for (:mod:`llmgw.gateway.adapters`); :attr:`model` is then the base model
    adapter: str | None = None
    #: the model as the client named it (``sql``, ``chat:sql``)
    requested: str = ""
    #: replicas that answered 404 for :attr:`adapter` (unloaded there before this gateway's routes said so)
    adapter_gone: list[str] = attrs.field(factory=list)
    #: replica id -> the request fields its engine wants for :attr:`adapter` (None: ``model`` = adapter),
    #: or for the base model when :attr:`adapter` is None (None: none)
    fields_of: Callable[[str], Mapping[str, object] | None] | None = None

    @property
    def routed_as(self) -> str:
        """The name the balancer chooses a replica by: the adapter (replicas that have it loaded), or the
        model."""
        return self.adapter if self.adapter is not None else self.model

    def charged_usage(self) -> tuple[int, int] | None:
        """(prompt, completion) tokens to charge the key once the answer ended: the engine's usage, or for
        a stream that carried none an estimate (:func:`llmgw.gateway.usage.estimated_usage`)."""
        if self.usage is not None or not self.events:
            return self.usage
        return estimated_usage(self.prompt_chars, self.events)
