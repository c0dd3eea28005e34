"""What a gateway reports to the server: ``POST /v1/gateway/suspect``.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
"""

from __future__ import annotations

import attrs

from llmgw.models import bounded

__all__ = ["SuspectReport", "SuspectRecorded"]


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
