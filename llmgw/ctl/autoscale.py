"""``llmgw ctl autoscale [MODEL]``: each autoscaled model's replicas, signals and the last decision.

A model is autoscaled when its catalog ``replicas:`` is a mapping (see the
README's "Autoscaling"); the server's autoscaler changes its desired
replicas from what its engines report, and every change is an event.
"""

from __future__ import annotations

import time

from tabulate import tabulate

from llmgw.ctl.output import model_listing
from llmgw.wire import AutoscaleList, AutoscaleSignal, AutoscaleStatus

__all__ = ["autoscale", "autoscale_lines"]


def autoscale_lines(data: AutoscaleList, wide: bool = False) -> list[str]:
    """What ``ctl autoscale`` prints: a table of models, then each one's last decision and why.

    ``wide`` adds the decision's direction and cause as columns.
    """
    if not data.models:
        return ["(no autoscaled model in the catalog: give a model's replicas as {min, max, target})"]
    now = time.time()
    rows = []
    for status in data.models:
        row = [
            status.model,
            f"{status.ready}/{status.replicas}",
            status.desired,
            f"{status.min}..{status.max}",
            ", ".join(_signal(s) for s in status.signals) or "-",
            _next(status, now),
        ]
        if wide:
            row += [status.direction or "-", status.cause or "-"]
        rows.append(row)
    headers = ["model", "ready", "desired", "min..max", "signals (value/target)", "may act"]
    if wide:
        headers += ["last", "cause"]
    lines = tabulate(rows, headers=headers, tablefmt="simple").splitlines()
    for status in data.models:
        if status.changed and status.changed_at:
            lines.append(f"{status.model}: last change {now - status.changed_at:.0f} s ago: {status.changed}")
        if status.reason and status.reason != status.changed:
            lines.append(f"{status.model}: now: {status.reason}")
        if status.idle_after is not None:
            seen = (
                f"last request {now - status.last_request_at:.0f} s ago"
                if status.last_request_at is not None
                else "no request since this server leads"
            )
            held = f", {status.held} held at the gateways" if status.held else ""
            lines.append(f"{status.model}: {seen}{held}; to zero after {status.idle_after:g} s idle")
    return lines


def _signal(signal: AutoscaleSignal) -> str:
    value = "-" if signal.value is None else f"{signal.value:.3g}"
    return f"{signal.name} {value}/{signal.target:g}"


def _next(status: AutoscaleStatus, now: float) -> str:
    return "now" if status.next_at is None else f"in {max(0.0, status.next_at - now):.0f} s"


autoscale = model_listing(
    "autoscale",
    "/v1/admin/autoscale",
    AutoscaleList,
    autoscale_lines,
    help=(
        "Show each autoscaled model (or MODEL): replicas ready, desired, min..max, each signal against "
        "its target, when the autoscaler may change the count next, and its last decision and why."
    ),
)
