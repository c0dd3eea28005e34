"""Tenants sharing a fleet: priority under a batch burst, fair share, a fleet-wide rpm: ``bench/tenants.py``.

One real local cluster (``llmgw server``, one agent of 8 fake GPUs, 2 replicas
of ``chat`` on sim engines of real capacity: 8 seats each, 0.5 s to the first
token, 20 tokens a second, 16 tokens an answer: 1.3 s an answer, about 12
requests a second for the fleet at full) and ``llmgw gateway`` processes.
Open-loop clients (trio + httpx, streaming) send Poisson arrivals. Printed:

1. **Priority under a burst.** Keys ``critical`` (priority critical) and
   ``standard`` at ``--rate`` requests a second each, ``batch`` (priority
   batch, ``--concurrency`` half the fleet's seats) at the same rate, then
   bursting to 10 times it, for ``--seconds`` each, through a gateway with
   ``--replica-concurrency 8`` (the engines' seats). The ``critical`` key's
   TTFT p50/p99 without the burst and with it (target: p99 within 10%), and,
   for contrast, with the burst of a batch key without limits through the
   same gateway (priority alone: a critical request waits for the next seat
   to free), and through a gateway that does not queue (every request
   straight to the engines, which queue first come first served).
2. **Fair share.** Two ``standard`` keys, one sending 2 times the other's
   rate, both more than half the fleet can serve, through the queueing
   gateway: the tokens each was served in the window, and Jain's fairness
   index of the two shares (target at least 0.95; 1 is equal shares).
3. **A fleet-wide rpm.** A key with ``--rpm N`` (``--rpm``, 120) sending 2N
   a minute, spread over 2 gateways of 2 worker processes each, each request
   on a new connection: after a first burst of 2N at once (the bucket starts
   full) is answered and 10 s more at 2N a minute (what the bucket refilled
   while the burst was answered is spent), the requests admitted in each of
   ``--minutes`` minutes (target: N ± 5%).

Nothing is asserted. On a 2-core machine shared with other work, the default
run printed (part 3 from a run of ``--only rpm`` after its last change):

1. critical TTFT p50 0.506 s, p99 0.509 s steady; with batch at 10x (249 of
   its requests refused 429 by its ``--concurrency``, now counted for the
   fleet): p50 0.506 s, p99 0.507 s, **-0.4%** (standard's p99 0.510 s and
   0.508 s; ``--only priority``, after fleet-wide seats). Contrasts with the
   burst: the queue but an unlimited batch key, critical p99 0.803 s (priority
   alone does not keep a seat free, a critical request waits for the next
   one); no queue and an unlimited batch key, p99 1.531 s;
2. std-a (14/s) 6381 tokens (53.0%), std-b (7/s) 5659 (47.0%) in the window,
   no 503; mean TTFT std-a 15.1 s, std-b 2.9 s (std-a's excess waits);
   **Jain's index 0.996**;
3. ``--rpm 120``: the burst of 240 admitted 120; the first 10 s at 240/min
   29 (what refilled while the burst was answered); then **120 and 120**
   admitted in the two minutes (+0.0%), every other request 429.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import attrs
import httpx
import trio

from llmgw.dev.cluster import LocalCluster
from llmgw.testing.chat import chat_body
from llmgw.testing.processes import free_port

SEATS = 8
SIM_ARGS = f'["--time-to-first-token", "0.5", "--tokens-per-second", "20", "--max-num-seqs", "{SEATS}"]'
MAX_TOKENS = 16
CATALOG = """
profiles:
  one:
    engine: sim
    gpus_per_node: 1
    args: {args}
models:
  chat:
    source: {models}/chat
    profile: one
    replicas: 2
"""


@attrs.frozen
class Answer:
    """One request: its key, when sent, its first token and its end (``time.time()``; None: none), status,
    tokens."""

    key: str
    sent: float
    first: float | None
    status: int | None
    tokens: int
    ended: float = 0.0


async def send(client: httpx.AsyncClient, url: str, key: str, secret: str, out: list[Answer]) -> None:
    """One streamed chat completion now (asking for usage); append how it went to ``out``."""
    body = chat_body("chat", f"hello {random.random()}", MAX_TOKENS, stream=True, usage=True)
    headers = {"authorization": f"Bearer {secret}"}
    sent, first, status, tokens = time.time(), None, None, 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as answer:
            status = answer.status_code
            async for line in answer.aiter_lines():
                if not line.startswith("data: "):
                    continue
                first = first or time.time()
                if '"usage"' in line and '"total_tokens"' in line:
                    tokens = int(line.split('"total_tokens":', 1)[1].split("}", 1)[0].split(",", 1)[0])
    except httpx.HTTPError:
        status = None
    out.append(Answer(key, sent, first if status == 200 else None, status, tokens, time.time()))


async def load(
    url: str | list[str],
    rates: dict[str, float],
    secrets: dict[str, str],
    seconds: float,
    seed: int,
    cut: bool = False,
) -> list[Answer]:
    """Poisson arrivals for ``seconds`` at ``rates`` (key name -> requests a second) through ``url`` (several:
    in turn); every request answered or failed when it returns (``cut``: the ones still waiting then are
    abandoned at ``seconds``, and not in the list)."""
    urls = [url] if isinstance(url, str) else url
    rng = random.Random(seed)
    plan = []
    for key, rate in rates.items():
        at = 0.0
        while True:
            at += rng.expovariate(rate)
            if at >= seconds:
                break
            plan.append((at, key))
    plan.sort()
    out: list[Answer] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client, trio.open_nursery() as nursery:
        start = trio.current_time()
        for index, (at, key) in enumerate(plan):
            await trio.sleep_until(start + at)
            nursery.start_soon(send, client, urls[index % len(urls)], key, secrets[key], out)
        if cut:
            await trio.sleep_until(start + seconds)
            nursery.cancel_scope.cancel()
    return out


async def rpm_load(
    urls: list[str], secret: str, per_minute: float, seconds: float, burst: int
) -> list[Answer]:
    """``burst`` requests of one key at once (key ``burst`` in the answers), and once every one is answered,
    requests evenly at ``per_minute`` for ``seconds`` (key ``rpm``, ``sent`` their planned time), in turn
    through ``urls``, each on a new connection (so a gateway's workers share them): small, unstreamed."""
    out: list[Answer] = []

    async def one(url: str, kind: str, planned: float) -> None:
        body = chat_body("chat", "hi", 1)
        status = None
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                answer = await client.post(
                    f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {secret}"}
                )
            status = answer.status_code
        except httpx.HTTPError:
            pass
        out.append(Answer(kind, planned, None, status, 0, time.time()))

    async with trio.open_nursery() as nursery:
        for index in range(burst):
            nursery.start_soon(one, urls[index % len(urls)], "burst", time.time())
    gap = 60.0 / per_minute
    async with trio.open_nursery() as nursery:
        start, began = trio.current_time(), time.time()
        for index in range(int(seconds / gap)):
            await trio.sleep_until(start + index * gap)
            nursery.start_soon(one, urls[index % len(urls)], "rpm", began + index * gap)
    return out


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; 0 when empty."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def ttfts(answers: list[Answer], key: str) -> tuple[float, float, int, int]:
    """(p50, p99, answered, failed) of ``key``'s time to first token."""
    mine = [a for a in answers if a.key == key]
    seen = [a.first - a.sent for a in mine if a.first is not None]
    return quantile(seen, 0.5), quantile(seen, 0.99), len(seen), len(mine) - len(seen)


def jain(shares: list[float]) -> float:
    """Jain's fairness index of ``shares``: 1 when equal, 1/n when one takes all."""
    return sum(shares) ** 2 / (len(shares) * sum(s * s for s in shares)) if any(shares) else 0.0


def key(cluster: LocalCluster, name: str, *limits: str) -> str:
    """``ctl keys create NAME LIMITS``: its secret."""
    made = cluster.ctl("keys", "create", name, *limits)
    if made.returncode != 0:
        raise SystemExit(made.stderr)
    return made.stdout.strip()


def gateway(cluster: LocalCluster, secret: str, *extra: str) -> str:
    """A new gateway process with keys and ``extra`` flags, answering ``secret``'s request: its URL."""
    cluster.start_gateway(free_port(), keys=True, extra=list(extra))
    url = cluster.gateway_url
    cluster.wait(lambda: served(url, secret), "the gateway to serve chat", 60)
    return url


def served(url: str, secret: str) -> bool:
    """Whether the gateway at ``url`` answers a small request of ``secret`` (200) now."""
    body = chat_body("chat", "hi", 1)
    headers = {"authorization": f"Bearer {secret}"}
    try:
        return (
            httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30).status_code
            == 200
        )
    except httpx.HTTPError:
        return False


def start(root: Path) -> LocalCluster:
    """The cluster: a server, one agent, two ready replicas of ``chat``."""
    (root / "models" / "chat").mkdir(parents=True)
    cluster = LocalCluster(root / "cluster", server_port=free_port(), lost_after=10, poll_timeout=1)
    cluster.say = lambda line: None
    cluster.start(1)
    cluster.apply(CATALOG.format(args=SIM_ARGS, models=root / "models"))
    ready = lambda: cluster.all_ready() and len(cluster.replicas().replicas) == 2  # noqa: E731
    cluster.wait(ready, "2 replicas to be ready", 180)
    return cluster


def priority(cluster: LocalCluster, args: argparse.Namespace) -> None:
    """Part 1: the critical key's TTFT without and with the batch burst, and with it through no queue."""
    half = str(SEATS)  # of the two replicas' 16 seats
    secrets = {
        "critical": key(cluster, "critical", "--priority", "critical"),
        "standard": key(cluster, "standard"),
        "batch": key(cluster, "batch", "--priority", "batch", "--concurrency", half),
        "batch-free": key(cluster, "batch-free", "--priority", "batch"),
    }
    queued = gateway(
        cluster, secrets["standard"], "--replica-concurrency", str(SEATS), "--queue-timeout", "60"
    )
    rate = args.rate
    runs = [
        ("steady", queued, {"critical": rate, "standard": rate, "batch": rate}),
        ("batch at 10x", queued, {"critical": rate, "standard": rate, "batch": 10 * rate}),
    ]
    print(f"\n1. priority: critical and standard at {rate:g}/s, batch at {rate:g}/s then {10 * rate:g}/s "
          f"(--concurrency {half}), {args.seconds:g} s each")  # fmt: skip
    p99s = {}
    for label, url, rates in runs:
        answers = trio.run(load, url, rates, secrets, args.seconds, args.seed)
        p50, p99, ok, failed = ttfts(answers, "critical")
        p99s[label] = p99
        refused = sum(1 for a in answers if a.key == "batch" and a.status == 429)
        standard = ttfts(answers, "standard")[1]
        print(f"  {label:13s} critical TTFT p50 {p50:.3f} s, p99 {p99:.3f} s ({ok} answered, {failed} "
              f"failed); standard p99 {standard:.3f} s; batch 429s {refused}")  # fmt: skip
    change = p99s["batch at 10x"] / p99s["steady"] - 1
    print(f"  critical TTFT p99 with the burst: {change:+.1%} against without (target within 10%)")
    unlimited = {"critical": rate, "standard": rate, "batch-free": 10 * rate}
    for label, url in (("the queue, batch without --concurrency", queued), ("no gateway queue", None)):
        if url is None:  # the same burst straight to the engines, which queue first come first served
            cluster.stop(cluster.gateway)
            url = gateway(cluster, secrets["standard"])
        p50, p99, ok, failed = ttfts(
            trio.run(load, url, unlimited, secrets, args.seconds, args.seed), "critical"
        )
        print(f"  contrast, {label}, batch at 10x: critical TTFT p50 {p50:.3f} s, p99 {p99:.3f} s ({ok} "
              f"answered, {failed} failed)")  # fmt: skip
    cluster.stop(cluster.gateway)


def fairness(cluster: LocalCluster, args: argparse.Namespace) -> None:
    """Part 2: two standard keys, one sending twice the other's rate, both backlogged: their token shares."""
    secrets = {"std-a": key(cluster, "std-a"), "std-b": key(cluster, "std-b")}
    flags = ["--replica-concurrency", str(SEATS), "--queue-timeout", "60", "--queue-size", "4096"]
    url = gateway(cluster, secrets["std-b"], *flags)
    rates = {"std-a": 2 * args.fair_rate, "std-b": args.fair_rate}
    answers = trio.run(load, url, rates, secrets, args.seconds, args.seed, True)
    # shares of the tokens answered while both keys had requests waiting: from 5 s in to the load's end
    began = min(a.sent for a in answers)
    window = (began + 5, began + args.seconds)
    tokens = {
        k: sum(
            a.tokens for a in answers if a.key == k and a.status == 200 and window[0] <= a.ended < window[1]
        )
        for k in rates
    }
    total = sum(tokens.values()) or 1
    shares = [tokens[k] / total for k in rates]
    overflow = sum(1 for a in answers if a.status == 503)
    print(
        f"\n2. fair share: std-a at {rates['std-a']:g}/s, std-b at {rates['std-b']:g}/s, {args.seconds:g} s"
    )
    print(f"  tokens answered from 5 s in to the end: std-a {tokens['std-a']} ({shares[0]:.1%}), std-b "
          f"{tokens['std-b']} ({shares[1]:.1%}); 503s {overflow}")  # fmt: skip
    for k in rates:
        mine = [a for a in answers if a.key == k and a.first is not None and window[0] <= a.ended < window[1]]
        wait = sum(a.first - a.sent for a in mine) / max(1, len(mine))
        print(f"  {k}: {len(mine)} answered in the window, mean TTFT {wait:.2f} s")
    print(f"  Jain's fairness index {jain(shares):.3f} (target >= 0.95)")
    cluster.stop(cluster.gateway)


def rpm(cluster: LocalCluster, args: argparse.Namespace) -> None:
    """Part 3: a key with --rpm N through 2 gateways of 2 workers: admitted per minute after the burst."""
    secret = key(cluster, "rpm", "--rpm", str(args.rpm))
    probe = key(cluster, "probe")
    urls = [gateway(cluster, probe, "--workers", "2") for _ in range(2)]
    settle = 10.0  # what the bucket refilled while the burst was answered is spent within these seconds
    answers = trio.run(rpm_load, urls, secret, 2 * args.rpm, settle + 60 * args.minutes, 2 * args.rpm)
    burst = [a for a in answers if a.key == "burst"]
    steady = [a for a in answers if a.key == "rpm"]
    print(f"\n3. rpm: --rpm {args.rpm}, sent {2 * args.rpm}/min through 2 gateways x 2 workers")
    admitted = sum(1 for a in burst if a.status == 200)
    print(f"  a burst of {len(burst)} at once (the bucket starts full): {admitted} admitted")
    began = min(a.sent for a in steady)
    early = sum(1 for a in steady if a.sent < began + settle and a.status == 200)
    print(f"  then the first {settle:g} s at {2 * args.rpm}/min: {early} admitted (the refill meanwhile)")
    began += settle
    for minute in range(args.minutes):
        low = began + 60 * minute
        window = [a for a in steady if low <= a.sent < low + 60]
        admitted = sum(1 for a in window if a.status == 200)
        other = sum(1 for a in window if a.status not in (200, 429))
        off = admitted / args.rpm - 1
        print(f"  then minute {minute + 1}: {admitted} admitted of {len(window)} ({off:+.1%} against "
              f"{args.rpm}; {other} neither 200 nor 429)")  # fmt: skip


def main() -> None:
    """Parse the flags, start the cluster, run the three parts, stop everything."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60, help="each load run, seconds (default 60)")
    parser.add_argument("--rate", type=float, default=1.0, help="part 1's steady rate per key (default 1/s)")
    parser.add_argument(
        "--fair-rate", type=float, default=7.0, help="part 2's slower key's rate (default 7/s)"
    )
    parser.add_argument("--rpm", type=int, default=120, help="part 3's rpm limit (default 120)")
    parser.add_argument("--minutes", type=int, default=2, help="part 3's minutes measured (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the arrivals (default 1)")
    parser.add_argument("--only", choices=("priority", "fairness", "rpm"), help="one part only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-tenants-") as root:
        cluster = start(Path(root))
        try:
            for name, part in (("priority", priority), ("fairness", fairness), ("rpm", rpm)):
                if args.only in (None, name):
                    part(cluster, args)
        finally:
            cluster.stop_all()


if __name__ == "__main__":
    main()
