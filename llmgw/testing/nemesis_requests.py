"""The nemesis's explanation of failed client requests: each must follow an injected fault that explains it.

:func:`check_requests` is the checker of :class:`~llmgw.testing.nemesis_checks.Invariant`
``EXPLAINED_REQUESTS``: a request failed on a replica a fault hit, or while its model had no other
ready replica; anything else is a violation naming the request and the faults around it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence

import attrs

from llmgw.testing.nemesis import CONTROL_PLANE, DATA_PATH, Fault
from llmgw.testing.nemesis_checks import AFTERMATH, SLACK, EngineFailure, Invariant, Violation

__all__ = ["ROUTES_LAG", "FailedRequest", "check_requests"]

#: seconds a replica the leader newly sees ready takes to reach the gateway's routes (the feed's
#: long-poll answer and the gateway's swap; longer when the leader just changed and the gateway is still
#: finding it): a replica counts as "another ready replica" only once sampled ready this long
ROUTES_LAG = 1.0


# -- client requests -------------------------------------------------------------------------------


@attrs.frozen
class FailedRequest:
    """A client request that failed: its model, the replica that answered (if any), when, why."""

    model: str
    replica: str
    began: float
    ended: float
    failure: str


def check_requests(
    failed: Iterable[FailedRequest],
    faults: Sequence[Fault],
    ready: Sequence[tuple[float, Mapping[str, frozenset[str]]]],
    served: Sequence[float] = (),
    engines: Sequence[EngineFailure] = (),
) -> tuple[list[Violation], list[str]]:
    """Every failed request is explained by a fault and the model having no other ready replica then.

    A fault explains a request that was in flight on the replica it hit, or any request while it made
    the model have no ready replica but those it hit (per ``ready``: (time, model -> ready replica ids)
    as sampled, oldest first; a replica counts from :data:`ROUTES_LAG` seconds after it was sampled
    ready, when the gateway can know of it). A gateway's own fault explains every request from its
    start until the gateway served a request again after its healing (``served``: when successful
    requests ended, oldest first), however long it took to load its routes.
    Control-plane faults explain nothing (the gateway keeps its routes).
    An unexplained failure that follows a replica's failure of the same model (``engines``) names it:
    the request failed because of that engine, itself a violation unless a fault explains it.
    :returns: the violations, and one line per explained failure naming the fault that explains it.
    """
    found, explained = [], []
    served = sorted(served)
    for request in failed:
        window = [
            f for f in faults
            if f.kind not in CONTROL_PLANE and f.start <= request.ended + SLACK
            and _effect_end(f, served, ready, request.model) >= request.began
        ]  # fmt: skip
        reason = _explain(request, window, ready)
        stamp = f"{request.model} request at {request.began:.3f} ({request.failure[:120]})"
        if reason is None:
            names = ", ".join(f"{f.kind.value} {f.target}" for f in window) or "no fault"
            hit = frozenset().union(*(f.replicas for f in window))
            other = _ready_for_gateway(ready, request) - hit
            before = [
                e for e in engines
                if e.replica.rpartition("-")[0] == request.model and e.at - AFTERMATH <= request.began
                and request.began <= e.at + AFTERMATH
            ]  # fmt: skip
            if before:
                names += f"; after {before[-1].replica} {before[-1].message[:100]}"
            found.append(
                Violation(
                    Invariant.EXPLAINED_REQUESTS, request.began,
                    f"{stamp} failed with {', '.join(sorted(other)) or 'no replica'} ready; "
                    f"faults then: {names}",
                )
            )  # fmt: skip
        else:
            explained.append(f"{stamp}: {reason}")
    return found, explained


def _effect_end(
    fault: Fault,
    served: Sequence[float],
    ready: Sequence[tuple[float, Mapping[str, frozenset[str]]]],
    model: str,
) -> float:
    """Until when a fault may explain a failed request for ``model``.

    A gateway's: until the gateway served again and its routes could be current (:data:`ROUTES_LAG`
    after its healing). One that hit replicas of ``model``: until ``model`` had a ready replica again
    (however long the rebuild took) and the gateway could know of it. Any other: :data:`AFTERMATH`
    seconds.
    """
    if fault.end is None:
        return float("inf")
    if fault.kind in DATA_PATH:
        # a gateway back from a pause serves on its old routes until the feed's next answer reaches it
        again = bisect.bisect_left(served, fault.end)
        return max(served[again] + SLACK, fault.end + ROUTES_LAG) if again < len(served) else float("inf")
    if any(r.rpartition("-")[0] == model for r in fault.replicas):
        back = next((at for at, models in ready if at >= fault.end and models.get(model)), float("inf"))
        return max(back + ROUTES_LAG, fault.end + AFTERMATH)
    return fault.end + AFTERMATH


def _explain(
    request: FailedRequest, window: list[Fault], ready: Sequence[tuple[float, Mapping[str, frozenset[str]]]]
) -> str | None:
    for fault in window:
        if fault.kind in DATA_PATH:
            return f"{fault.kind.value} {fault.target}: in flight through it, or sent before it served again"
        if request.replica and request.replica in fault.replicas:
            return f"{fault.kind.value} {fault.target} hit {request.replica}, which served it"
    hit = frozenset().union(*(f.replicas for f in window)) if window else frozenset()
    others = _ready_for_gateway(ready, request) - hit
    if window and not others:
        return f"{window[-1].kind.value} {window[-1].target}, and {request.model} had no other ready replica"
    return None


def _ready_for_gateway(
    ready: Sequence[tuple[float, Mapping[str, frozenset[str]]]], request: FailedRequest
) -> frozenset[str]:
    """The replicas of the request's model ready when it began and already :data:`ROUTES_LAG` s before."""
    now = _ready_at(ready, request.began).get(request.model, frozenset())
    return now & _ready_at(ready, request.began - ROUTES_LAG).get(request.model, frozenset())


def _ready_at(
    ready: Sequence[tuple[float, Mapping[str, frozenset[str]]]], at: float
) -> Mapping[str, frozenset[str]]:
    """The ready replicas last sampled at or before ``at`` (the first sample when none was before)."""
    seen: Mapping[str, frozenset[str]] = ready[0][1] if ready else {}
    for when, models in ready:
        if when > at:
            break
        seen = models
    return seen
