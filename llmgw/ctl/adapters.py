"""``llmgw ctl adapters [MODEL]``: each LoRA adapter of the catalog, where it is loaded, and its use.

Adapters are loaded on demand (the server's adapter controller, on a gateway's held request) and
unloaded under pressure, least recently used first; every load, failure and unload is an event
(``ctl events``: kinds ``adapter_loaded``, ``adapter_failed``, ``adapter_unloaded``).
"""

from __future__ import annotations

import time

from tabulate import tabulate

from llmgw.ctl.output import model_listing
from llmgw.wire import AdapterList

__all__ = ["adapters", "adapter_lines"]


def adapter_lines(data: AdapterList, wide: bool = False) -> list[str]:
    """What ``ctl adapters`` prints: one row per adapter (``wide`` adds its source and load counts), then
    the last failure of each adapter that has one."""
    if not data.adapters:
        return ["(no LoRA adapter in the catalog: give a model `adapters: {name: source}`)"]
    now = time.time()
    rows = []
    for status in data.adapters:
        where = ", ".join(status.loaded) or "-"
        if status.loading:
            where += f" (loading on {', '.join(status.loading)})"
        last = "-" if status.last_use is None else f"{max(0.0, now - status.last_use):.0f} s ago"
        row = [status.model, status.adapter, where, status.hits, status.misses, last]
        if wide:
            row += [status.loads, status.failures, status.source]
        rows.append(row)
    headers = ["model", "adapter", "loaded on", "hits", "misses", "last use"]
    if wide:
        headers += ["loads", "failures", "source"]
    lines = tabulate(rows, headers=headers, tablefmt="simple").splitlines()
    for status in data.adapters:
        if status.failure is not None:
            failure = status.failure
            name = f"{status.model}/{status.adapter}"
            lines.append(f"{name}: last load failed ({failure.cause}): {failure.detail}")
    return lines


adapters = model_listing(
    "adapters",
    "/v1/admin/adapters",
    AdapterList,
    adapter_lines,
    help=(
        "Show each LoRA adapter (of MODEL): the replicas that have it loaded or are loading it, requests "
        "that found it loaded (hits) or waited for a load (misses), and its last use; a failed load's "
        "cause."
    ),
)
