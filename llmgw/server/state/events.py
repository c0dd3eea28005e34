"""The events the server records for ``ctl events``, before they are stored."""

from __future__ import annotations

import time
from collections.abc import Callable

from llmgw.server.state.records import Event, EventKind

__all__ = ["EventLog", "REPEATING_KINDS", "REPEAT_WINDOW"]

#: event kinds a peer can cause over and over (a misconfigured node retrying): repeats are folded
REPEATING_KINDS = frozenset({EventKind.REFUSAL})
#: seconds within which a repeated event is counted instead of stored
REPEAT_WINDOW = 600.0


class EventLog:
    """Events waiting to be stored, with repeats folded.

    Events of the kinds a peer can repeat at will (:data:`REPEATING_KINDS`)
    are aggregated: the same event again within :data:`REPEAT_WINDOW` seconds
    is counted, not stored; the next one after the window says how many were
    folded into it. Every other event is kept as it is.
    """

    def __init__(self) -> None:
        self.pending: list[Event] = []
        self._repeats: dict[tuple[str, str, str], list] = {}
        #: called with every event recorded, repeats included (the server's metrics count them)
        self.listeners: list[Callable[[Event], None]] = []

    def record(self, event: Event) -> None:
        """Keep ``event`` for the next :meth:`take` (or count it as a repeat)."""
        for listener in self.listeners:
            listener(event)
        if event.kind in REPEATING_KINDS:
            key = (event.kind, event.subject, event.message)
            seen = self._repeats.get(key)
            if seen is not None and event.at - seen[0] < REPEAT_WINDOW:
                seen[1] += 1
                return
            if seen is not None and seen[1]:
                since = time.strftime("%H:%M:%S", time.localtime(seen[0]))
                message = f"{event.message} ({seen[1]} more since {since})"
                event = Event(event.at, event.kind, event.subject, message)
            if len(self._repeats) >= 10_000:
                self._repeats = {k: v for k, v in self._repeats.items() if event.at - v[0] < REPEAT_WINDOW}
            self._repeats[key] = [event.at, 0]
        self.pending.append(event)

    def take(self) -> list[Event]:
        """The events recorded since the last call, oldest first (the server stores them)."""
        events, self.pending = self.pending, []
        return events

    def put_back(self, events: tuple[Event, ...]) -> None:
        """Return events :meth:`take` gave out whose write failed: the next take has them first."""
        self.pending[:0] = events
