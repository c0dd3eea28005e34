"""The admin API's rollout documents: how each model's outdated replicas are being replaced.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
"""

from __future__ import annotations

import attrs

__all__ = ["RolloutStatus", "RolloutList", "RolloutUndone"]


@attrs.frozen
class RolloutStatus:
    """One model's rollout in ``GET /v1/admin/rollouts`` (``ctl rollout status``)."""

    model: str
    #: ``done`` (nothing outdated), ``rolling``, ``staging`` (the new weights are copied to the
    #: outdated replicas' nodes first), ``waiting`` (no room to surge), or ``paused`` (its
    #: replacements kept failing)
    state: str
    #: the catalog revision in force (what the replicas are rolled to)
    revision: int
    #: the model's replicas (replacements not counted)
    replicas: int
    #: replicas running the catalog's command and ready
    updated: int
    #: replicas still running an older command
    outdated: int
    max_surge: int = 1
    max_unavailable: int = 0
    #: why the rollout waits or paused, for people
    reason: str | None = None
    #: paused: what failed and where (replica, shard, node, exit code, the log line its agent reported)
    failure: str | None = None


@attrs.frozen
class RolloutList:
    """``GET /v1/admin/rollouts``: every model of the catalog in force (or the one asked for)."""

    rollouts: tuple[RolloutStatus, ...] = ()


@attrs.frozen
class RolloutUndone:
    """``POST /v1/admin/rollouts/MODEL/undo``: the catalog revision applied to undo the model's rollout."""

    model: str
    #: the revision whose text was applied again
    restored: int
    #: the new revision it is stored as
    revision: int
    summary: str
