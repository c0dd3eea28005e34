"""Autoscaled against static peak provisioning, on a day of recorded shape: ``python bench/autoscale.py``.

It replays ``bench/traces/diurnal.csv`` (a working day of three models: a
night trough, a day plateau, bursts; ``digest`` asleep but for short batches)
compressed to ``--minutes`` of real time (default 6; ``--quick``: 2), twice in
one invocation, each on a fresh real local cluster (``llmgw server``, 2 agents
of 8 fake GPUs running sim engines of real capacity: 8 seats, 5 tokens a
second, 16 tokens an answer, so 3.25 s an answer and about 2.5 requests a
second per replica at full, and ``llmgw gateway``):

- **autoscaled**: ``chat`` 1..4 and ``code`` 1..3 replicas on a KV-cache
  target (the share of seats taken; ``--kv-target``, 0.6) and a queue target
  (2 waiting per replica), a stabilization window of ``--scale-down-after``
  (10 s: 40 minutes of the day at 6 minutes) and a cooldown of 3 s;
  ``digest`` 0..2 with ``idle_after`` 8 s (it starts asleep; the gateway
  holds its requests while it wakes);
- **static**: every model at the replicas its peak needs (4, 3 and 2).

Open-loop clients (trio + httpx, streaming) send Poisson arrivals at the
trace's rates through the gateway, whatever the answers do. Printed per run:

- SLO attainment for each ``--slo`` (TTFT p95 at most 1 s, and 2 s): the
  share of (model, window) pairs that meet it, over every model and over the
  always-on ones (a wake from zero costs an engine start, about a second).
  Windows are ``--window`` real seconds (10 s by default: 40 minutes of the
  trace's day at 6 minutes; one-minute windows would be 6 a day); a window
  without a request of the model does not count; a failed request counts as
  an infinite TTFT;
- GPU-seconds: the GPUs of starting and ready replicas (``GET
  /v1/admin/replicas`` every second) integrated over the trace;
- scale decisions (``autoscale`` events): ups, downs, the most changes of
  direction within any ``scale_down_after`` of one model (flapping);
- failed requests (and the first few failures);
- for ``digest``, each wake: when the replica was ready after the first
  held request, and that request's first token against that ready time.

Then the ratio of GPU-seconds autoscaled/static. Nothing is asserted.

On a 2-core machine (two helper sessions' tests beside it, load average 2 to
6), the default run (6 minutes, seed 1) printed:

- autoscaled: 1508 requests, 0 failed; TTFT p95 at most 1 s in 88/91 of every
  model's windows (96.7%) and 70/71 of chat's and code's (98.6%), at most 2 s
  in 90/91 (98.9%); 1919 GPU-seconds (mean 5.3 GPUs, peak 9); 29 scale-ups
  and 22 scale-downs (11 wakes, 11 sleeps); at most 1 change of direction
  within one 10 s window on the signals for every model (digest 2 counting a
  sleep and the wake of the next batch 8.5 s later: those follow requests,
  ``idle_after`` 8 s); each woken replica was ready 0.7 to 2.5 s after its first
  held request and answered it 0.06 to 0.07 s after it was ready;
- static: 1508 requests, 0 failed; TTFT p95 at most 1 s in 90/91 windows
  (98.9%: chat's burst at 13:20 missed it even on 4 replicas, p95 1.28 s), at
  most 2 s in all; 3240 GPU-seconds (9 GPUs all day);
- GPU-seconds autoscaled/static: 0.59.

The run before the flapping fixes (same seed) had 2 changes of direction in
one window for chat (4 → 3 → 4 in 5 s on one reading just over the target).
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import attrs
import httpx
import trio

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.load import gateway_models
from llmgw.testing.processes import free_port
from llmgw.wire import EventEntry, EventList

TRACE = Path(__file__).parent / "traces" / "diurnal.csv"
MODELS = ("chat", "code", "digest")
#: each model's peak replicas: the static run's count, the autoscaled run's max
PEAK = {"chat": 4, "code": 3, "digest": 2}
SIM_ARGS = '["--time-to-first-token", "0.05", "--tokens-per-second", "5", "--max-num-seqs", "8"]'
MAX_TOKENS = 16
PROFILES = f"""
profiles:
  one:
    engine: sim
    gpus_per_node: 1
    args: {SIM_ARGS}
models:
"""
STATIC = """
  {name}:
    source: {models}/{name}
    profile: one
    replicas: {peak}
"""
SCALED = """
  {name}:
    source: {models}/{name}
    profile: one
    priority: {priority}{idle}
    replicas:
      min: {low}
      max: {peak}
      target: {{kv_cache_usage: {kv:g}, waiting_per_replica: 2}}
      scale_down_after: {down}
      cooldown: {cooldown}
      max_step: 2
"""
#: a replica holding GPUs: starting (or copying weights) or serving
HOLDING = ("staging", "starting", "ready")


@attrs.frozen
class Request:
    """One request of the replay: when sent, its first token and end (``time.time()``), why it failed."""

    model: str
    sent: float
    first: float | None
    ended: float
    failure: str | None


def read_trace(path: Path) -> list[tuple[float, dict[str, float]]]:
    """The trace's rows, in order: (hour of the day, {model: requests per second}). Called once per run."""
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return [(float(row.pop("hour")), {m: float(v) for m, v in row.items()}) for row in csv.DictReader(lines)]


def arrivals(trace: list[tuple[float, dict[str, float]]], day: float, seed: int) -> list[tuple[float, str]]:
    """Poisson arrivals at the trace's rates, a day lasting ``day`` real seconds: sorted (offset s, model)."""
    rng = random.Random(seed)
    out = []
    ends = [hour for hour, _ in trace[1:]] + [24.0]
    for (hour, rates), end in zip(trace, ends, strict=True):
        start, stop = hour / 24 * day, end / 24 * day
        for model, rate in rates.items():
            t = start
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= stop:
                    break
                out.append((t, model))
    return sorted(out)


async def send(client: httpx.AsyncClient, url: str, model: str, out: list[Request]) -> None:
    """Send one streamed chat completion now; append how it went to ``out``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    sent, first, failure = time.time(), None, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                failure = f"{response.status_code}: {(await response.aread())[:200]!r}"
            else:
                last = ""
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        first = first or time.time()
                        last = line
                        if '"error"' in line:
                            failure = f"error event: {line[:200]}"
                if last != "data: [DONE]" and failure is None:
                    failure = f"stream ended without [DONE]: {last[:200]}"
    except httpx.HTTPError as exc:
        failure = f"{type(exc).__name__}: {exc}"
    out.append(Request(model, sent, first, time.time(), failure))


async def sample(
    cluster: LocalCluster, samples: list[tuple[float, dict[str, int]]], done: trio.Event
) -> None:
    """Every second until ``done``: the GPUs each model's starting and ready replicas hold, as (time, {model:
    GPUs}); raises when a process of the cluster died."""
    while not done.is_set():
        listed = await trio.to_thread.run_sync(cluster.replicas)
        held: dict[str, int] = defaultdict(int)
        for replica in listed.replicas:
            if replica.state in HOLDING:
                held[replica.model] += sum(len(shard.gpus) for shard in replica.shards)
        samples.append((time.time(), dict(held)))
        cluster.check()
        with trio.move_on_after(1):
            await done.wait()


async def replay(
    cluster: LocalCluster, plan: list[tuple[float, str]], day: float
) -> tuple[float, list[Request], list[tuple[float, dict[str, int]]]]:
    """Send ``plan``'s requests at their offsets while sampling the replicas; called once per run.

    :returns: when the trace started (``time.time()``), every request, and the samples.
    """
    requests: list[Request] = []
    samples: list[tuple[float, dict[str, int]]] = []
    done = trio.Event()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=180, limits=limits) as client, trio.open_nursery() as outer:
        outer.start_soon(sample, cluster, samples, done)
        began, clock0 = time.time(), trio.current_time()
        async with trio.open_nursery() as nursery:
            for offset, model in plan:
                await trio.sleep_until(clock0 + offset)
                nursery.start_soon(send, client, cluster.gateway_url, model, requests)
            await trio.sleep_until(clock0 + day)
        done.set()
    return began, requests, samples


def catalog(scaled: bool, models: Path, args: argparse.Namespace) -> str:
    """The catalog of a run: every model at its peak (static), or autoscaled with ``digest`` from zero."""
    text = PROFILES
    for priority, name in enumerate(reversed(MODELS)):
        if not scaled:
            text += STATIC.format(name=name, models=models, peak=PEAK[name])
            continue
        idle = f"\n    idle_after: {args.idle_after:g}" if name == "digest" else ""
        text += SCALED.format(
            name=name, models=models, priority=priority * 10, idle=idle, low=0 if name == "digest" else 1,
            peak=PEAK[name], kv=args.kv_target, down=args.scale_down_after, cooldown=args.cooldown,
        )  # fmt: skip
    return text


def start(root: Path, scaled: bool, args: argparse.Namespace) -> LocalCluster:
    """A cluster serving the run's catalog: every replica it starts with ready, the gateway listing every
    model (``digest`` asleep in the autoscaled run)."""
    for name in MODELS:
        (root / "models" / name).mkdir(parents=True)
    cluster = LocalCluster(root / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    cluster.say = lambda line: None
    cluster.start(2)
    cluster.start_gateway(free_port(), extra=["--hold-timeout", "120"])
    cluster.apply(catalog(scaled, root / "models", args))
    wanted = 2 if scaled else sum(PEAK.values())
    ready = lambda: cluster.all_ready() and len(cluster.replicas().replicas) == wanted  # noqa: E731
    cluster.wait(ready, f"{wanted} replicas to be ready", 180)
    cluster.wait(lambda: gateway_models(cluster.gateway_url) == sorted(MODELS), "the gateway's models", 60)
    for name in MODELS if not scaled else ("chat", "code"):
        cluster.wait(
            lambda name=name: answered(cluster.gateway_url, name), f"the gateway to answer {name}", 60
        )
    return cluster


def answered(url: str, model: str) -> bool:
    """Whether the gateway at ``url`` answers a request for ``model`` (200) now."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def p95(values: list[float]) -> float:
    """The 95th percentile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def slo(
    requests: list[Request], began: float, args: argparse.Namespace, target: float
) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Per model: (windows whose TTFT p95 is at most ``target``, windows with a request), by the time sent;
    and a line for each window that misses it."""
    windows: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in requests:
        ttft = math.inf if r.failure is not None or r.first is None else r.first - r.sent
        windows[r.model, int((r.sent - began) // args.window)].append(ttft)
    met: dict[str, tuple[int, int]] = {}
    missed = []
    hour = args.minutes * 60 / 24
    for (model, index), ttfts in sorted(windows.items()):
        good, total = met.get(model, (0, 0))
        ok = p95(ttfts) <= target
        met[model] = (good + ok, total + 1)
        if not ok:
            at = index * args.window
            missed.append(
                f"{model} {at:.0f}-{at + args.window:.0f} s (hour {at / hour:.1f}): TTFT p95 "
                f"{p95(ttfts):.2f} s over {len(ttfts)} requests"
            )
    return met, missed


def gpu_seconds(samples: list[tuple[float, dict[str, int]]], began: float, ended: float) -> dict[str, float]:
    """Per model: GPUs held integrated over [began, ended] (each sample holds until the next)."""
    total: dict[str, float] = defaultdict(float)
    points = [(max(t, began), held) for t, held in samples if t <= ended]
    for (t, held), (nxt, _) in zip(points, [*points[1:], (ended, {})], strict=True):
        for model, gpus in held.items():
            total[model] += gpus * max(0.0, nxt - t)
    return total


STEP = re.compile(r"^(\d+) → (\d+): ")
#: a step that follows requests rather than a signal: a sleep (``idle_after``) or a wake (held requests)
DEMAND_STEP = re.compile(r": (woken|idle): ")


def changes(events: list[EventEntry]) -> dict[str, list[tuple[float, int, int, str]]]:
    """The autoscaler's changes per model, oldest first: (at, before, after, message)."""
    out: dict[str, list[tuple[float, int, int, str]]] = defaultdict(list)
    for event in events:
        found = STEP.match(event.message) if event.kind == "autoscale" else None
        if found:
            out[event.subject].append((event.at, int(found[1]), int(found[2]), event.message))
    return out


def flapping(steps: list[tuple[float, int, int, str]], window: float) -> int:
    """The most changes of direction (up after down, down after up) within any ``window`` seconds."""
    turns = [b[0] for a, b in zip(steps, steps[1:], strict=False) if (a[2] > a[1]) != (b[2] > b[1])]
    return max((sum(1 for u in turns if t <= u < t + window) for t in turns), default=0)


def wakes(events: list[EventEntry], requests: list[Request]) -> list[str]:
    """For each wake of ``digest``: its first held request, the replica's ready time, that request's first
    token against it. One line each."""
    lines = []
    woken = [e.at for e in events if e.kind == "autoscale" and e.subject == "digest" and "woken" in e.message]
    ready = [
        e.at
        for e in events
        if e.kind == "replica" and e.subject.startswith("digest") and "ready on" in e.message
    ]
    slept = [e.at for e in events if e.kind == "autoscale" and e.subject == "digest" and "→ 0:" in e.message]
    for at in woken:
        became = next((r for r in ready if r >= at), None)
        since = max((s for s in slept if s < at), default=0.0)
        held = sorted(
            (r for r in requests if r.model == "digest" and since <= r.sent <= (became or at)),
            key=lambda r: r.sent,
        )
        if became is None or not held:
            lines.append(f"woken at {at:.1f}: no ready event or no held request found")
            continue
        first = held[0]
        if first.first is None:
            lines.append(f"first request after {first.sent:.1f} failed: {first.failure}")
            continue
        lines.append(
            f"{len(held)} held; ready {became - first.sent:.2f} s after the first request, which had its "
            f"first token {first.first - became:+.2f} s from ready (TTFT {first.first - first.sent:.2f} s)"
        )
    return lines


def run(scaled: bool, args: argparse.Namespace, root: Path) -> float:
    """One replay on a fresh cluster; prints its figures and returns its GPU-seconds."""
    label = "autoscaled" if scaled else "static"
    day = args.minutes * 60
    plan = arrivals(read_trace(args.trace), day, args.seed)
    cluster = start(root, scaled, args)
    if args.keep:
        print(f"{root}: the {label} run's cluster, logs in {cluster.logs}")
    try:
        began, requests, samples = trio.run(replay, cluster, plan, day)
        ended = began + day
        listed = cluster.client.request("GET", "/v1/admin/events", EventList, params={"limit": "10000"})
        events = [e for e in listed.events if began - 5 <= e.at <= ended + 60]
    finally:
        cluster.stop_all()
    print_run(label, args, requests, samples, began)
    if scaled:
        print_scaling(args, events, requests, began)
    return sum(gpu_seconds(samples, began, ended).values())


def print_run(
    label: str, args: argparse.Namespace, requests: list[Request], samples: list, began: float
) -> None:
    """Print a run's requests, SLO attainment (every model, the always-on ones, each) and GPU-seconds."""
    day = args.minutes * 60
    gpus = gpu_seconds(samples, began, began + day)
    failed = [r for r in requests if r.failure is not None]
    print(f"\n{label}: {len(requests)} requests in {day:.0f} s, {len(failed)} failed")
    for target in args.slo:
        met, missed = slo(requests, began, args, target)
        shares = []
        for what, names in (("every model", MODELS), ("chat and code", MODELS[:2])):
            good, total = (sum(met.get(m, (0, 0))[i] for m in names) for i in (0, 1))
            shares.append(f"{what} {good}/{total} = {good / max(total, 1):.1%}")
        each = ", ".join(f"{m} {met.get(m, (0, 0))[0]}/{met.get(m, (0, 0))[1]}" for m in MODELS)
        print(f"  SLO TTFT p95 <= {target:g} s, windows met: {'; '.join(shares)} ({each})")
        for line in missed if args.verbose else ():
            print(f"    missed: {line}")
    for model in MODELS:
        ttfts = sorted(r.first - r.sent for r in requests if r.model == model and r.first is not None)
        median, high = (ttfts[len(ttfts) // 2], p95(ttfts)) if ttfts else (0, 0)
        print(
            f"  {model:7s} TTFT p50 {median:.2f} s, p95 {high:.2f} s, max "
            f"{ttfts[-1] if ttfts else 0:.2f} s; {gpus.get(model, 0):.0f} GPU-s"
        )
    total = sum(gpus.values())
    peak = max((sum(held.values()) for _, held in samples), default=0)
    print(f"  GPU-seconds {total:.0f} (mean {total / day:.2f} GPUs, peak {peak})")
    for r in failed[:5]:
        print(f"  failed: {r.model} at {r.sent - began:.1f} s: {r.failure}")


def print_scaling(
    args: argparse.Namespace, events: list[EventEntry], requests: list[Request], began: float
) -> None:
    """Print the autoscaled run's decisions (each with ``--verbose``), flapping, and digest's wakes."""
    steps = changes(events)
    ups = sum(1 for s in steps.values() for _, a, b, _ in s if b > a)
    downs = sum(1 for s in steps.values() for _, a, b, _ in s if b < a)
    # sleeps and wakes follow requests (idle_after, held requests), not the engines' signals
    on_signals = {
        m: [step for step in s if not DEMAND_STEP.search(step[3])] for m, s in sorted(steps.items())
    }
    flaps = {m: flapping(s, args.scale_down_after) for m, s in on_signals.items()}
    with_demand = {m: flapping(s, args.scale_down_after) for m, s in sorted(steps.items())}
    def listed(counts: dict[str, int]) -> str:
        return ", ".join(f"{m} {n}" for m, n in counts.items())

    print(
        f"  scale decisions: {ups} up, {downs} down; most direction changes within one "
        f"{args.scale_down_after:g} s window, on the signals: {listed(flaps)}; "
        f"with sleeps and wakes: {listed(with_demand)}"
    )
    for model in MODELS:
        path = " ".join(f"{b}@{at - began:.0f}" for at, _, b, _ in steps.get(model, []))
        print(f"    {model:7s} replicas@s: {path or '-'}")
        for at, _, _, message in steps.get(model, []) if args.verbose else ():
            print(f"      {at - began:6.1f} s {message}")
    print("  digest from zero:")
    for line in wakes(events, requests):
        print(f"    {line}")


def main() -> None:
    """Parse the flags, run the autoscaled replay then the static one, print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=6, help="real minutes the day lasts (default 6)")
    parser.add_argument("--quick", action="store_true", help="a 2-minute day")
    parser.add_argument("--seed", type=int, default=1, help="seed of the arrivals (default 1)")
    parser.add_argument(
        "--trace", type=Path, default=TRACE, help="the trace (default bench/traces/diurnal.csv)"
    )
    parser.add_argument(
        "--slo", type=float, nargs="+", default=[1.0, 2.0], help="TTFT p95 targets, seconds (default 1 2)"
    )
    parser.add_argument("--kv-target", type=float, default=0.6, help="KV-cache usage target (default 0.6)")
    parser.add_argument("--window", type=float, default=10, help="SLO window, real seconds (default 10)")
    parser.add_argument(
        "--scale-down-after", type=float, default=10, help="stabilization window (default 10)"
    )
    parser.add_argument("--cooldown", type=float, default=3, help="autoscaler cooldown, s (default 3)")
    parser.add_argument("--idle-after", type=float, default=8, help="digest's idle_after, s (default 8)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every scale decision")
    parser.add_argument("--keep", action="store_true", help="keep the clusters' folders (logs) and say where")
    parser.add_argument("--only", choices=("autoscaled", "static"), help="one run only")
    args = parser.parse_args()
    if args.quick:
        args.minutes = 2
    hour = args.minutes * 60 / 24
    print(f"a day of {args.minutes:g} min: an hour is {hour:.1f} s; a {args.window:g} s window is "
          f"{args.window / hour * 60:.0f} minutes of the day")  # fmt: skip
    used = {}
    for scaled in (True, False):
        if args.only and args.only != ("autoscaled" if scaled else "static"):
            continue
        if args.keep:
            used[scaled] = run(scaled, args, Path(tempfile.mkdtemp(prefix="llmgw-bench-autoscale-")))
            continue
        with tempfile.TemporaryDirectory(prefix="llmgw-bench-autoscale-") as root:
            used[scaled] = run(scaled, args, Path(root))
    if len(used) == 2:
        print(f"\nGPU-seconds autoscaled/static: {used[True] / used[False]:.2f}")


if __name__ == "__main__":
    main()
