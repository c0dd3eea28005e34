"""The admin API's autoscaling document: each autoscaled model's replicas, signals and last decision.

Re-exported by :mod:`llmgw.wire`; read and written through its one converter.
"""

from __future__ import annotations

import attrs

__all__ = ["AutoscaleSignal", "AutoscaleStatus", "AutoscaleList"]


@attrs.frozen
class AutoscaleSignal:
    """One target of a model and what its ready replicas report for it."""

    #: the catalog's key: ``waiting_per_replica``, ``kv_cache_usage``
    name: str
    target: float
    #: None: no ready replica reported it in the last 15 s
    value: float | None = None


@attrs.frozen
class AutoscaleStatus:
    """One autoscaled model in ``GET /v1/admin/autoscale`` (``ctl autoscale``)."""

    model: str
    #: the model's replicas (a drain's or rollout's replacements not counted), and the ready ones among them
    replicas: int
    ready: int
    #: what the autoscaler asks for
    desired: int
    min: int
    max: int
    signals: tuple[AutoscaleSignal, ...] = ()
    #: the last decision: its direction (``up``, ``down``, ``hold``), cause (``over-target``,
    #: ``stabilizing``, ...), when (epoch seconds) and why, for people; None before the first pass
    direction: str | None = None
    cause: str | None = None
    decided_at: float | None = None
    reason: str | None = None
    #: the last change of the count, for people (``1 → 3: 10 waiting per replica > target 2``), and when
    changed: str | None = None
    changed_at: float | None = None
    #: when the autoscaler may change the count next (the cooldown's or the stabilization window's end);
    #: None: it may now
    next_at: float | None = None
    #: a model whose ``min`` is 0: its ``idle_after``, when a gateway last saw a request for it (epoch
    #: seconds; None: none since this server leads), and the requests gateways hold for it now
    idle_after: float | None = None
    last_request_at: float | None = None
    held: int = 0


@attrs.frozen
class AutoscaleList:
    """``GET /v1/admin/autoscale[?model=NAME]``: every autoscaled model of the catalog in force."""

    models: tuple[AutoscaleStatus, ...] = ()
