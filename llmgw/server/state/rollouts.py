"""The rollouts' record: which models roll, wait, stage or paused, and why (the rollout controller's memory).

:mod:`llmgw.server.controllers.rollout` decides; ``ctl rollout status`` reads
this (:mod:`llmgw.server.views.rollouts`); the paused rollouts and the models
rolling are stored as settings rows, so a restart neither retries a paused
rollout nor forgets one under way.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["Pause", "RolloutBook"]


@attrs.frozen
class Pause:
    """A paused rollout: what it was rolling to, and why it stopped."""

    #: a short digest of the command the failing replacements ran
    target: str
    #: what ``ctl rollout status`` says, and the failure it names (node, exit, log line)
    reason: str
    failure: str
    at: float


class RolloutBook:
    """Every model's rollout as last decided; see the module docstring."""

    def __init__(self) -> None:
        #: model -> why its rollout paused; persisted (a setting row) so a restart does not retry it
        self.paused: dict[str, Pause] = {}
        #: model -> why its rollout waits for room (said once per reason)
        self.waiting: dict[str, str] = {}
        #: models with a rollout under way (for the start and done events)
        self.rolling: set[str] = set()
        #: model -> (outdated replicas, updated ones ready, bytes copied) and since when: progress is a change
        self.progress: dict[str, tuple[tuple[int, int, int], float]] = {}
        #: model -> node id -> the new source it copies ahead of the rollout (``SyncReply.stage_sources``)
        self.staging: dict[str, dict[str, str]] = {}
        #: nodes whose sources to stage changed since the reconciler last looked (their long-polls wake)
        self.stage_changed: set[str] = set()
        #: :meth:`stage_sources`' answer, made once per step (read by every sync answer)
        self.stage_by_node: dict[str, tuple[str, ...]] = {}

    def stage_sources(self) -> dict[str, tuple[str, ...]]:
        """Node id -> the sources it should copy ahead of the rollouts under way (its sync answer's)."""
        return self.stage_by_node

    def set_staging(self, staging: dict[str, dict[str, str]]) -> None:
        """Record where each model's new weights are copied ahead; note the nodes whose list changed."""
        before = self.stage_by_node
        self.staging = staging
        out: dict[str, set[str]] = {}
        for stage in staging.values():
            for node_id, source in stage.items():
                out.setdefault(node_id, set()).add(source)
        after = self.stage_by_node = {node_id: tuple(sorted(s)) for node_id, s in out.items()}
        self.stage_changed |= {n for n in before.keys() | after.keys() if before.get(n) != after.get(n)}

    def take_stage_changed(self) -> set[str]:
        """The nodes whose sources to stage changed since the last call (the reconciler wakes them)."""
        changed, self.stage_changed = self.stage_changed, set()
        return changed

    def saved(self) -> dict[str, list[Any]]:
        """The paused rollouts as a setting value (JSON)."""
        return {m: [p.target, p.reason, p.failure, p.at] for m, p in sorted(self.paused.items())}

    def load(self, value: dict[str, list[Any]]) -> None:
        """Restore the paused rollouts from :meth:`saved`'s value, as the server starts."""
        self.paused = {m: Pause(*fields) for m, fields in value.items()}
