"""Rank 0's liveness: a real request beside the health check, judged with the engine's own counters.

A health path can answer 200 while every request hangs (vLLM's API server
with a dead EngineCore, llama.cpp with a hung RPC worker, ``llmgw-sim
--hang-after-requests``). So once rank 0 is ready the supervisor runs
:func:`watch_liveness`: every ``interval`` seconds it sends the engine's
:class:`~llmgw.engine.LivenessProbe` (by default a one-token completion of
the served model) and waits ``timeout`` seconds for any HTTP answer.

A probe with no answer in time may only have waited behind a full batch. When
the engine names its token counters (:class:`~llmgw.engine.ProgressMetrics`),
they are read every :data:`TICK` seconds while the probe waits and once its
time is up: if they moved within the last :data:`STILL_SHARE` of the timeout,
the engine is busy and the probe is tried again at the next interval; if they
stood still that long (or cannot be read), the engine is hung. So requests
that were already streaming when an engine hung (they drain for a few
seconds) do not buy it a second round.

The timeout is counted in the engine's time, not the wall clock's: a tick of
the agent's own clock that fires late (a loaded machine) charges the engine
at most :data:`LATE_SLACK` of the lateness. A look at the clock later than
the probe interval plus :data:`PAUSE_MARGIN` means the agent itself was
paused (SIGSTOP, a frozen VM): that round says nothing of the engine, and
the canary is re-armed. A probe whose HTTP client times out is unanswered,
not broken.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import attrs
import httpx
import trio

from llmgw.engine import LivenessProbe, ProgressMetrics

__all__ = ["Progress", "parse_samples", "read_progress", "read_samples", "watch_liveness"]

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


async def read_samples(
    client: httpx.AsyncClient, url: str, names: Iterable[str], within: float
) -> dict[str, float] | str:
    """GET an engine's metrics at ``url`` within ``within`` seconds: the samples in ``names`` (summed over
    their labels, as :func:`parse_samples`), or why there are none (no answer, not 200)."""
    with trio.move_on_after(within):
        try:
            response = await client.get(url, timeout=within + 1)
        except httpx.HTTPError as exc:
            return f"GET {url} failed: {str(exc) or type(exc).__name__}"
        if response.status_code != 200:
            return f"GET {url}: HTTP {response.status_code}"
        return parse_samples(response.text, names)
    return f"GET {url}: no answer within {within:g} s"


async def read_progress(
    client: httpx.AsyncClient, base_url: str, metrics: ProgressMetrics, within: float
) -> Progress | str:
    """Read ``metrics`` from rank 0 within ``within`` seconds.

    :returns: the reading, or why there is none (no answer, not 200, no token counter found).
    """
    url = base_url + metrics.path
    samples = await read_samples(client, url, (*metrics.tokens, *metrics.running), within)
    if isinstance(samples, str):
        return samples
    tokens = [samples[name] for name in metrics.tokens if name in samples]
    if not tokens:
        return f"GET {url} has none of {', '.join(metrics.tokens)}"
    running = [samples[name] for name in metrics.running if name in samples]
    return Progress(sum(tokens), sum(running) if running else None)


#: seconds between two readings of the engine's counters while a canary waits (at most a fifth of its timeout)
TICK = 1.0
#: seconds of a tick's lateness still charged to the engine; the rest is the agent's own scheduling delay
LATE_SLACK = 0.05
#: a tick later than the probe interval plus this many seconds: the agent was paused, not the engine
PAUSE_MARGIN = 1.0
#: an unanswered canary is a hang once the counters stood still for this share of the probe's timeout
STILL_SHARE = 0.5


@attrs.define
class _Round:
    """One canary: its answer, the engine time charged so far, the counters read meanwhile."""

    #: [] while unanswered; [None] when answered; [why] when the connection broke
    answer: list[str | None] = attrs.Factory(list)
    engine_time: float = 0.0
    #: (engine time, reading) in the order read
    readings: list[tuple[float, Progress | str]] = attrs.Factory(list)
    #: seconds the agent's clock jumped, when it was paused
    paused: float | None = None
    done: trio.Event = attrs.Factory(trio.Event)


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
    only when the engine's token counters stood still (see the module docstring).
    ``outcome`` (if given) is called with each probe's result: ``ok`` (answered),
    ``busy`` (no answer, but tokens were produced), ``failed`` (the connection broke)
    or ``hung``; a round the agent's own pause cut short has none.
    """
    said = outcome or (lambda result: None)
    url = base_url + probe.path
    body = probe.request_body(served_name)
    what = f"liveness probe {probe.method} {url}"
    pause_after = probe.interval + PAUSE_MARGIN
    tick = min(TICK, probe.timeout / 5)
    while True:
        slept_from = trio.current_time()
        await trio.sleep(probe.interval)
        if trio.current_time() - slept_from - probe.interval > pause_after:
            _rearm(shard, trio.current_time() - slept_from)
            continue
        round_ = _Round()
        async with trio.open_nursery() as canary:
            canary.start_soon(_ask, client, probe, url, body, round_)
            canary.start_soon(_charge, round_, tick, probe.timeout, pause_after)
            if probe.progress is not None:
                canary.start_soon(_sample, client, base_url, probe.progress, metrics_timeout, tick, round_)
            await round_.done.wait()
            if not round_.answer and round_.paused is None and probe.progress is not None:
                # read once more while the probe still waits: it counts among the running requests
                final = await read_progress(client, base_url, probe.progress, metrics_timeout)
                round_.readings.append((round_.engine_time, final))
            canary.cancel_scope.cancel()
        if round_.paused is not None:
            _rearm(shard, round_.paused)
            continue
        if round_.answer and round_.answer[0] is not None:
            said("failed")
            report(f"{what} failed: {round_.answer[0]}")
            return
        if round_.answer:
            said("ok")
            continue
        if probe.progress is None:
            said("hung")
            report(
                f"{what} got no answer within {probe.timeout:g} s "
                "(health still passes: a hung engine or a hung peer)"
            )
            return
        verdict = _judge(round_, probe.timeout)
        if verdict is None:
            log.info(
                "shard %s: %s waited %g s unanswered, but the engine made tokens meanwhile: busy, not hung",
                shard,
                what,
                probe.timeout,
            )
            said("busy")
            continue
        said("hung")
        report(f"{what} got no answer within {probe.timeout:g} s and {verdict}")
        return


def _rearm(shard: str, jump: float) -> None:
    log.warning(
        "shard %s: this agent was paused (its clock jumped %.1f s): the liveness canary starts again, "
        "the engine is not judged on it",
        shard,
        jump,
    )


async def _charge(round_: _Round, tick: float, limit: float, pause_after: float) -> None:
    """Count the engine's time while the canary waits; ``done`` at ``limit``, or when the agent was paused.

    A tick that fires late charges the engine at most :data:`LATE_SLACK` of its lateness.
    """
    while round_.engine_time < limit:
        wanted = min(tick, limit - round_.engine_time)
        before = trio.current_time()
        await trio.sleep(wanted)
        gap = trio.current_time() - before
        if gap - wanted > pause_after:
            round_.paused = gap
            break
        round_.engine_time += min(gap, wanted + LATE_SLACK)
    round_.done.set()


async def _sample(
    client: httpx.AsyncClient,
    base_url: str,
    metrics: ProgressMetrics,
    within: float,
    tick: float,
    round_: _Round,
) -> None:
    """Read the engine's counters every ``tick`` seconds into ``round_.readings`` (until cancelled)."""
    while True:
        reading = await read_progress(client, base_url, metrics, within)
        round_.readings.append((round_.engine_time, reading))
        await trio.sleep(tick)


def _judge(round_: _Round, timeout: float) -> str | None:
    """None when the counters moved in the last :data:`STILL_SHARE` of ``timeout``; else why it is hung."""
    readings = [(at, r) for at, r in round_.readings if isinstance(r, Progress)]
    last = round_.readings[-1][1] if round_.readings else "no reading"
    if isinstance(last, str) or len(readings) < 2:
        why = last if isinstance(last, str) else "only one reading"
        return f"its progress cannot be read ({why}): hung"
    moved = [at for (_, a), (at, b) in zip(readings, readings[1:], strict=False) if b.tokens > a.tokens]
    still = round_.engine_time - moved[-1] if moved else None
    if still is not None and still < STILL_SHARE * timeout:
        return None
    assert isinstance(last, Progress)
    running = f" with {last.running:.0f} requests running" if last.running is not None else ""
    when = "meanwhile" if still is None else f"in its last {still:.1f} s"
    return f"no token was produced {when}{running} (health still passes): hung"


async def _ask(
    client: httpx.AsyncClient, probe: LivenessProbe, url: str, body: object, round_: _Round
) -> None:
    """Send the probe; note None (any HTTP answer) or what broke in ``round_.answer``, and end the round.

    An HTTP client timeout is no answer (the round's own clock judges that), not a broken connection.
    """
    try:
        await client.request(probe.method, url, json=body, timeout=None)
    except httpx.TimeoutException:
        return
    except httpx.HTTPError as exc:
        round_.answer.append(str(exc) or type(exc).__name__)
    else:
        round_.answer.append(None)
    round_.done.set()
