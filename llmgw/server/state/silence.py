"""The mass-silence episode the state keeps: which silent nodes to declare lost, or to suspect the network.

A node that misses its syncs for ``lost_after`` seconds is lost and its
replicas are rebuilt elsewhere. When many nodes fall silent together, the
likelier cause is the control plane's own network; evicting them all would
tear down a healthy fleet (GPUStack's users report exactly that), so the
server spares them until syncs return or an operator says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from llmgw.server.state.records import NodeRecord


@attrs.define
class Verdict:
    """What one look at the nodes decided: who is lost (and after how many silent seconds), what to say."""

    lost: list[tuple[str, float]] = attrs.field(factory=list)
    messages: list[str] = attrs.field(factory=list)


@attrs.define
class SilenceWatch:
    """Remembers a mass-silence episode between reconciles (not stored: a restarted server judges anew)."""

    #: silent nodes not declared lost because too many went silent at once
    spared: frozenset[str] = frozenset()
    #: the nodes the events of the current episode named
    announced: frozenset[str] = frozenset()
    #: nodes still silent when the last episode ended -> when it ended: their silence counts from then
    ended: dict[str, float] = attrs.field(factory=dict)

    def judge(
        self, nodes: Iterable[NodeRecord], lost_after: float, max_fraction: float, now: float
    ) -> Verdict:
        """Decide which of ``nodes`` (those not lost) are lost now; called at every reconcile.

        A node is due when it has not synced for ``lost_after`` seconds. When a
        node is due while more than ``max_fraction`` of the live nodes (and at
        least two) are late (no sync for half of ``lost_after``: they stopped
        within the same window), none is declared lost: they are
        :attr:`spared` and one event says so. The episode ends when one of them
        syncs again: none is declared lost then (nodes released together do not
        sync in the same instant), and the silence of each node still silent
        counts from the episode's end, so it is lost only when it has not
        synced for ``lost_after`` after it, by the usual rule.

        :returns: the nodes to declare lost (sorted) and the events to record.
        """
        verdict = Verdict()
        live = [node for node in nodes if not node.lost]
        self.ended = {
            node.node_id: self.ended[node.node_id]
            for node in live
            if node.node_id in self.ended and node.last_seen < self.ended[node.node_id]
        }
        quiet = {n.node_id: now - max(n.last_seen, self.ended.get(n.node_id, 0.0)) for n in live}
        silent = {node_id: seconds for node_id, seconds in quiet.items() if seconds > lost_after}
        late = [node_id for node_id, seconds in quiet.items() if seconds > lost_after / 2]
        if self.spared:
            returned = sorted(n for n in self.spared if n in quiet and n not in silent)
            self.spared = frozenset(n for n in self.spared if n in silent)
            if returned:
                self._end(returned, silent, lost_after, now, verdict)
                return verdict
            if self.spared:
                self._spare(silent, late, len(live), max_fraction, verdict)
                return verdict
        if silent and len(late) >= 2 and len(late) > max_fraction * len(live):
            self._spare(silent, late, len(live), max_fraction, verdict)
            return verdict
        verdict.lost = sorted(silent.items())
        return verdict

    def _end(
        self, returned: list[str], silent: dict[str, float], lost_after: float, now: float, verdict: Verdict
    ) -> None:
        """End the episode: the nodes still silent get ``lost_after`` from ``now``; one event says so."""
        still = sorted(silent)
        self.spared = frozenset()
        self.ended.update((node_id, now) for node_id in still)
        message = f"syncs are back ({', '.join(returned)}): the silence is over and no node was declared lost"
        if still:
            message += (
                f"; still silent: {', '.join(still)}, each declared lost if it does not sync "
                f"within {lost_after:.0f} s"
            )
        verdict.messages.append(message)

    def _spare(
        self, silent: dict[str, float], late: list[str], live: int, max_fraction: float, verdict: Verdict
    ) -> None:
        """Keep the ``silent`` nodes out of the lost; an event names the late nodes not named yet."""
        if not self.spared:
            self.announced = frozenset()
        self.spared = self.spared | set(silent)
        new = sorted(set(late) - self.announced)
        if not new:
            return
        if self.announced:
            message = f"also stopped syncing: {', '.join(new)}; still none is declared lost"
        else:
            message = (
                f"{len(late)} of {live} nodes stopped syncing together ({', '.join(new)}): more than "
                f"{max_fraction:.0%} at once looks like the server's own network, so none is declared lost "
                "and their replicas stay until syncs return; `llmgw ctl nodes lost NODE...` declares one lost"
            )
        self.announced = self.announced | set(new)
        verdict.messages.append(message)
