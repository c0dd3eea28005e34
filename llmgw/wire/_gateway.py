"""What a gateway reports to the server: stalled replicas, and the models it served.

``POST /v1/gateway/suspect`` and ``POST /v1/gateway/activity``.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
"""

from __future__ import annotations

import attrs

from llmgw.models import bounded
from llmgw.wire._adapters import AdapterActivity

__all__ = ["GatewayActivity", "ModelActivity", "RoutesHeld", "SuspectReport", "SuspectRecorded"]


@attrs.frozen
class SuspectReport:
    """A gateway found ``replica`` stalled (``--stall-timeout``); ``reason`` says what it saw."""

    replica: str = attrs.field(validator=bounded(text=253))
    reason: str = attrs.field(validator=bounded(text=2000))


@attrs.frozen
class SuspectRecorded:
    """The server's answer: the report is recorded as an event; the agent's liveness canary decides."""

    replica: str
    #: the replica's state at the server (``ready``, ``failed``, ...), ``unknown`` when it has no such replica
    state: str


@attrs.frozen
class RoutesHeld:
    """Which routes one gateway process serves from: ``POST /v1/gateway/routes-held``, sent when a new
    routes table arrives and every few seconds. The leader stops a replica that left the routes only
    once every gateway process it heard from lately holds a table without it (or a bounded wait ran out).
    """

    #: a token the gateway process drew when it started; the server keeps it under the certificate's name
    process: str = attrs.field(validator=bounded(text=64))
    #: the :attr:`~llmgw.wire.RouteTable.generation` of the table it routes by now
    generation: int


@attrs.frozen
class ModelActivity:
    """What one gateway process saw of one model: ``POST /v1/gateway/activity``."""

    model: str = attrs.field(validator=bounded(text=253))
    #: seconds since the last request for the model reached this gateway (None: none since it started)
    idle: float | None = None
    #: requests held now because the model has no ready replica (it is scaled to zero)
    held: int = 0
    #: seconds to the first token of the streamed answers since the last report: 95th percentile, and how
    #: many streams (None, 0: none streamed)
    ttft_p95: float | None = None
    streams: int = 0


@attrs.frozen
class GatewayActivity:
    """A gateway's report of the models it served: sent every few seconds, and at once when it holds a
    request for a model scaled to zero (the autoscaler wakes the model; idle models go to zero; a
    ``ttft_p95`` target reads the time to first token)."""

    models: tuple[ModelActivity, ...] = attrs.field(converter=tuple, default=())
    #: the LoRA adapters requested since the last report (held ones: the server loads them at once)
    adapters: tuple[AdapterActivity, ...] = attrs.field(converter=tuple, default=(), validator=bounded(4096))
