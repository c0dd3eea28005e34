"""Rank 0's liveness: a real request beside the health check, judged with the engine's own counters.

A health path can answer 200 while every request hangs (vLLM's API server
with a dead EngineCore, llama.cpp with a hung RPC worker, ``llmgw-sim
--hang-after-requests``). So once rank 0 is ready the supervisor runs
:func:`watch_liveness`: every ``interval`` seconds it sends the engine's
:class:`~llmgw.engine.LivenessProbe` (by default a one-token completion of
the served model) and waits ``timeout`` seconds for any HTTP answer.

A probe with no answer in time may only have waited behind a full batch. When
the engine names its token counters (:class:`~llmgw.engine.ProgressMetrics`),
they are read before the probe is sent and once its time is up: if they
grew, the engine is busy and the probe is tried again at the next interval;
if they did not (or cannot be read), the engine is hung.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import attrs
import httpx
import trio

from llmgw.engine import LivenessProbe, ProgressMetrics

__all__ = ["Progress", "parse_samples", "read_progress", "watch_liveness"]

log = logging.getLogger("llmgw.agent")


@attrs.frozen
class Progress:
    """One reading of an engine's progress metrics."""

    #: the sum of the token counters
    tokens: float
    #: the sum of the running-request gauges (None when the engine names none, or none was found)
    running: float | None


def parse_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """The sum of each sample named in ``names`` over all its label sets, in Prometheus' text format.

    Names absent from ``text`` are absent from the result; comment lines and
    values that are not numbers are skipped.
    """
    wanted = set(names)
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        name = name.strip()
        if name not in wanted:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        found[name] = found.get(name, 0.0) + value
    return found


async def read_progress(
    client: httpx.AsyncClient, base_url: str, metrics: ProgressMetrics, within: float
) -> Progress | str:
    """Read ``metrics`` from rank 0 within ``within`` seconds.

    :returns: the reading, or why there is none (no answer, not 200, no token counter found).
    """
    url = base_url + metrics.path
    with trio.move_on_after(within):
        try:
            response = await client.get(url, timeout=within + 1)
        except httpx.HTTPError as exc:
            return f"GET {url} failed: {str(exc) or type(exc).__name__}"
        if response.status_code != 200:
            return f"GET {url}: HTTP {response.status_code}"
        samples = parse_samples(response.text, (*metrics.tokens, *metrics.running))
        tokens = [samples[name] for name in metrics.tokens if name in samples]
        if not tokens:
            return f"GET {url} has none of {', '.join(metrics.tokens)}"
        running = [samples[name] for name in metrics.running if name in samples]
        return Progress(sum(tokens), sum(running) if running else None)
    return f"GET {url}: no answer within {within:g} s"


async def watch_liveness(
    client: httpx.AsyncClient,
    base_url: str,
    probe: LivenessProbe,
    served_name: str,
    report: Callable[[str], None],
    *,
    metrics_timeout: float = 5.0,
    shard: str = "",
    outcome: Callable[[str], None] | None = None,
) -> None:
    """Probe rank 0 at ``base_url`` until it is judged hung; then ``report(why)`` and return.

    Runs beside the health check once the shard is ready; cancelled with it.
    A broken connection is reported at once; a probe with no answer in time
    only when the engine's token counters did not grow meanwhile.
    ``outcome`` (if given) is called with each probe's result: ``ok`` (answered),
    ``busy`` (no answer, but tokens were produced), ``failed`` (the connection broke)
    or ``hung``.
    """
    said = outcome or (lambda result: None)
    url = base_url + probe.path
    body = probe.request_body(served_name)
    what = f"liveness probe {probe.method} {url}"
    while True:
        await trio.sleep(probe.interval)
        before = await _progress(client, base_url, probe, metrics_timeout)
        answer: list[str | None] = []
        answered = trio.Event()
        async with trio.open_nursery() as canary:
            canary.start_soon(_ask, client, probe, url, body, answer, answered)
            with trio.move_on_after(probe.timeout):
                await answered.wait()
            # read the counters while the probe still waits: it counts among the running requests
            after = None if answer else await _progress(client, base_url, probe, metrics_timeout)
            canary.cancel_scope.cancel()
        if answer and answer[0] is not None:
            said("failed")
            report(f"{what} failed: {answer[0]}")
            return
        if answer:
            said("ok")
            continue
        if probe.progress is None:
            said("hung")
            report(
                f"{what} got no answer within {probe.timeout:g} s "
                "(health still passes: a hung engine or a hung peer)"
            )
            return
        if isinstance(before, Progress) and isinstance(after, Progress) and after.tokens > before.tokens:
            log.info(
                "shard %s: %s waited %g s unanswered, but the engine produced %d tokens meanwhile: "
                "busy, not hung",
                shard,
                what,
                probe.timeout,
                after.tokens - before.tokens,
            )
            said("busy")
            continue
        said("hung")
        report(f"{what} got no answer within {probe.timeout:g} s and {_stalled(before, after)}")
        return


async def _ask(
    client: httpx.AsyncClient,
    probe: LivenessProbe,
    url: str,
    body: object,
    answer: list[str | None],
    answered: trio.Event,
) -> None:
    """Send the probe; append None (any HTTP answer) or what failed to ``answer``, then set ``answered``."""
    try:
        await client.request(probe.method, url, json=body, timeout=probe.timeout + 1)
    except httpx.HTTPError as exc:
        answer.append(str(exc) or type(exc).__name__)
    else:
        answer.append(None)
    answered.set()


async def _progress(
    client: httpx.AsyncClient, base_url: str, probe: LivenessProbe, within: float
) -> Progress | str | None:
    if probe.progress is None:
        return None
    return await read_progress(client, base_url, probe.progress, within)


def _stalled(before: Progress | str | None, after: Progress | str | None) -> str:
    """Why the engine counts as hung, for the shard's detail."""
    for reading in (after, before):
        if isinstance(reading, str):
            return f"its progress cannot be read ({reading}): hung"
    assert isinstance(after, Progress)
    running = f" with {after.running:.0f} requests running" if after.running is not None else ""
    return f"no token was produced meanwhile{running} (health still passes): hung"
