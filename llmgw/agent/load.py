"""Rank 0's load: the engine's own gauges of its queue and KV cache, read for the autoscaler.

Once rank 0 is ready, its supervisor runs :func:`watch_load`: every
:data:`LOAD_INTERVAL` seconds it reads the engine's
:class:`~llmgw.engine.LoadMetrics` from its metrics path and keeps the last
reading, which the agent sends with every sync (:class:`~llmgw.wire.ShardLoad`).
A reading that fails (no answer, no such gauge) is dropped: the server then
has no signal from that replica, and says so, rather than a stale one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httpx
import trio

from llmgw.agent.liveness import read_samples
from llmgw.engine import LoadMetrics
from llmgw.wire import ShardLoad

__all__ = ["LOAD_INTERVAL", "read_load", "watch_load"]

log = logging.getLogger("llmgw.agent")

#: seconds between two readings of an engine's load gauges
LOAD_INTERVAL = 2.0


async def read_load(
    client: httpx.AsyncClient,
    base_url: str,
    metrics: LoadMetrics,
    replica_id: str,
    attempt: int,
    within: float,
) -> ShardLoad | str:
    """Read ``metrics`` from rank 0 at ``base_url`` within ``within`` seconds.

    :returns: the reading, or why there is none (no answer, not 200, no waiting gauge found).
    """
    url = base_url + metrics.path
    samples = await read_samples(
        client, url, (*metrics.waiting, *metrics.running, *metrics.kv_cache_usage), within
    )
    if isinstance(samples, str):
        return samples
    waiting = _first(samples, metrics.waiting)
    if waiting is None:
        return f"GET {url} has none of {', '.join(metrics.waiting)}"
    return ShardLoad(
        replica_id=replica_id,
        attempt=attempt,
        waiting=waiting,
        running=_first(samples, metrics.running),
        kv_cache_usage=_first(samples, metrics.kv_cache_usage),
    )


def _first(samples: dict[str, float], names: tuple[str, ...]) -> float | None:
    """The value of the first of ``names`` the engine serves (engines rename gauges between versions)."""
    return next((samples[name] for name in names if name in samples), None)


async def watch_load(
    client: httpx.AsyncClient,
    base_url: str,
    metrics: LoadMetrics,
    replica_id: str,
    attempt: int,
    keep: Callable[[ShardLoad | None], None],
    *,
    within: float = 5.0,
) -> None:
    """Read the load every :data:`LOAD_INTERVAL` seconds and ``keep`` it (None after a failed reading).

    Runs until cancelled (the shard stops or is no longer ready); logs a failure once until a reading
    works again.
    """
    failing = False
    while True:
        reading = await read_load(client, base_url, metrics, replica_id, attempt, within)
        if isinstance(reading, str):
            if not failing:
                log.info("shard %s/%d: cannot read its load: %s", replica_id, attempt, reading)
            failing = True
            keep(None)
        else:
            failing = False
            keep(reading)
        await trio.sleep(LOAD_INTERVAL)
