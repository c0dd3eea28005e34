"""What the gateway costs: the same workload sent to a backend directly and through a gateway.

Run with ``python bench/gateway.py`` (about two minutes; ``--rounds``,
``--seconds`` and ``--backend`` change that). It starts a backend, an
in-process fake routes feed pointing at it, and ``llmgw gateway --no-keys``
(``--workers N`` passed on) as its own process group; then, for concurrency 1
and 64, non-streamed and streamed chat completions, it loads the backend
directly and through the gateway. Two backends:

- ``fast``: ``bench/fastbackend.py``, a fixed-body asyncio+httptools server
  much faster than the gateway, so that the gateway's own cost shows;
- ``uvicorn``: the same answers from uvicorn with httptools (slower than
  ``fast``; the backend the gateway issue's figures were taken against);
- ``sim``: one ``llmgw-sim`` replica with no generation delays (16 tokens), a
  backend slower than the gateway, as engines are.

The load generator is ``wrk`` (one thread, keep-alive) when it is on PATH, else
an in-process h11 client (which then competes with the gateway for CPU: the
report says which ran). Every case runs ``--rounds`` times, interleaved, so
that other work on the machine weighs on direct and gateway cases alike; the
rounds of a case are pooled (their p50/p99 are the medians over rounds; every
other round runs the cases in the reverse order). It
prints per case requests per second, p50/p99 latency (a streamed request
counts until its last byte) and CPU use, then the gateway's added p50/p99, its
throughput as a fraction of direct and its CPU microseconds per proxied
request (all its processes, from ``/proc/<pid>/stat``).

With the ``fast`` backend it also runs the token-stream case: 64 clients
streaming answers of ``--events`` token events (256), each event its own
write from the backend, direct and through the gateway in interleaved rounds;
the client is a process of its own (``--token-client``) that notes when each
chunk arrives. It prints events per second, whole-stream p50/p99 and the
inter-token gap each client sees (p50, p99, max). Three rounds of 3 s on this
machine (2 cores shared with other work), with ``--before`` the gateway of the
commit before mid-stream migration (its relay passed each chunk on as read)::

    target    events/s whole p50 ms whole p99 ms gap p50 ms gap p99 ms gap max ms
    direct      209957         77.8        108.6       1.29       9.74       30.7
    gateway     130989        131.6        200.4       6.80      48.81      223.3
    before      132975        127.6        230.3       6.78      52.90      264.0

With this client (a process of its own, 64 trio tasks on h11) the whole-stream
p99 through the gateway is 1.8-2x direct's here (1.2x in a quieter run), not
the 1.0-1.7 s of issue 28's measurement; events/s are 0.6-0.9x direct's and
the gap p99 about 5x: the gateway is CPU-bound at this load (one core), and
the tail of the gaps is what remains to bound. Gen-2 garbage collections pause
it 18-38 ms (every ~130 collections); ``gc.freeze()`` after the imports brings
the longest pause to 5.5 ms but did not move the gap p99: not the main cause.

``--tokens-only`` runs the token-stream case alone; it also prints the first
byte's p99 apart (the gaps are then between chunks after the first), each
target's CPU per event, and ratios against direct from the same run. With
``--before`` the commit before "every stream gets its turn" (issue 28 item 4:
a large read relayed 4 KiB at a time, the transcript read every 64 KiB,
``gc.freeze()`` at start), ``--tokens-only --rounds 10 --seconds 3``, load
average 13-18 on the 2 cores (four other sessions' tests)::

    target    events/s whole p50 ms whole p99 ms first p99 gap p50 ms gap p99 ms gap max ms  us/event
    direct       57784        298.1        411.4      46.2      10.58      35.04       58.6      3.94
    gateway      43627        350.8        667.9     302.4      26.20      68.42       91.4      4.79
    before       40526        395.4        771.8     400.1      31.01     106.47      150.6      4.67
    against direct: gateway 0.75x events/s, whole p99 1.62x, gap p99 1.95x, gap max 1.56x
                    before  0.70x events/s, whole p99 1.88x, gap p99 3.04x, gap max 2.57x

Two runs before it (8 and 6 rounds, load 8-28) read gap p99 3.17x and 2.60x
against before's 3.87x and 3.26x, gap max 1.85x and 2.46x against 2.37x and
3.17x, but whole p99 2.14x and 1.74x against 1.81x and 1.47x. The A/A run
(``--before`` the same commit, 6 rounds, load 16-26) shows what the method
reads where there is no difference: whole p99 1.54x vs 1.18x, gap p99 2.32x
vs 1.78x, gap max 1.74x vs 1.22x, events/s 0.66x vs 0.85x, 4.54 vs 4.44 us
per event. So on this machine the gaps' tail is shorter, by about the
method's noise; the whole-stream p99 is not shown better (a stream whose
whole answer was waiting in its socket used to go out in two or three turns;
it now takes its turns like the others); the CPU per event moved +2.6%,
within the A/A run's 2.3%. A fourth run after them (8 rounds, load 9-16):
gateway whole p99 1.48x, gap p99 2.20x, gap max 1.96x, first p99 307 ms,
4.71 us per event; before 2.01x, 2.50x, 2.29x, 872 ms, 4.99 us; events/s
0.82x and 0.88x. The effect is plain where streams burst beside
paced ones (``tests/gateway/test_gateway_fairness.py``: a paced stream's
largest gap 0.54-1.3 s before, 0.06-0.15 s after, at 20 ms a token).

``--before DIR`` adds a second gateway run from the ``llmgw`` package in DIR
(an older commit), measured interleaved with the current one: on a machine
shared with other work, only figures taken side by side compare.

``--keys`` runs the gateways with API keys: the feed hands out one key with
every rate limit (rpm, tpm, concurrency, far above what the load reaches),
and every request sends it, so that admission's cost shows (against a
``--before`` from before limits, which only checks the key); it also prints
admission's and the model queue's CPU per request timed in-process, which a
machine shared with other work does not blur.
``--gateway-args "..."`` passes more flags to the current gateway only (e.g.
``--replica-concurrency 64``, the model queue's seats).

``--admission`` measures what admission adds, in one run against the ``fast``
backend: one gateway with API keys, fed by an in-process feed that also lends
the limited keys' rates as the server does (:class:`~llmgw.server.state.allowances.Lender`),
loaded in interleaved rounds with two keys: ``plain``, a key without limits
(admission's look-up finds nothing: the baseline), and ``limited``, a key with
rpm, tpm (far above what the load reaches: never refused), concurrency and
priority ``critical``, whose requests take leased requests and whose tokens
are charged. Same process, same rounds: only the key differs. Concurrency 64
only (streamed and not), so that a run has many short rounds: on a shared
machine, only the median of many back-to-back pairs is steady. It prints, per
case, the gateway's CPU microseconds per request with each key and the
median over rounds of their difference (each round's pair measured back to
back), and req/s with each. ``--aa`` gives the second key no limits either:
the same figures then show what the method reads where there is no difference.
On this machine (2 cores shared with four other sessions' tests; the gateway
got about half a core), ``--admission --rounds 12 --seconds 4`` printed::

    conc stream plain us/req limited us/req added us/req   (rounds: min..max) plain req/s limited req/s
      64     no        329.0          345.9        +11.0         -11.6..+90.5        1564          1451
      64    yes        361.1          388.7        +24.1        -79.4..+177.3        1529          1302
    lease exchanges per second: direct rounds 0.3, plain rounds 1.0, limited rounds 4.0

and the A/A run (``--aa``, same flags) right after it::

      64     no        279.9          277.5         -3.0         -22.6..+14.2        2524          2664
      64    yes        314.6          322.7        +15.7         -24.3..+42.2        2435          2252

So the method reads ±15 µs and ±8% of throughput where there is no
difference: the +11 and +24 µs are within about one such width of it, and
neither the 20 µs bound nor "no lower throughput" is shown or refuted here.
On the same machine quiet (nothing else running; ``wrk`` on PATH), the same
flags printed::

      64     no        326.7          330.2         +4.0         -18.5..+17.7        3061          3026
      64    yes        367.5          380.6        +13.4          -9.1..+46.2        2718          2629

and the A/A run right after it::

      64     no        329.6          327.3         -0.8         -19.3..+11.1        3033          3052
      64    yes        380.9          366.0        -15.7         -37.8..+20.1        2620          2733

Admission adds 4 and 13 µs per request (bound 20); the limited key's
throughput is 1.1% and 3.3% below the plain key's, less than the A/A run's
own differences (0.6% and 4.3%) between two identical keys.
In-process, the limited key's admission with its leases (``seen``, ``take``,
the ticket, the charge, the usage report) costs 3.5 µs against 0.5 µs for a
key without limits; the extra lease exchanges (4 a second instead of 1) are
the key's ramp after each idle gap between its rounds (the gateway asks for
what the key took in the last period: after an idle one, for the requests
waiting, doubling per exchange). A second run (20 rounds of 3 s) read +20.6
and +10.0 µs, 2064 vs 1861 and 1777 vs 1716 req/s. Sampling the gateway with
py-spy (200 Hz, 6 s of c=64 per key, twice) put 2.75% of its samples in
admission and leases with the limited key against 0.83% with the plain one:
some 6 µs of its 320 µs per request.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from llmgw.gateway.admission import Admission
from llmgw.gateway.leases import ALLOWANCES_PATH
from llmgw.gateway.queue import Queues, QueueSettings
from llmgw.net.client import ConnectionPool
from llmgw.net.server import Request, Response
from llmgw.server.state.allowances import Lender
from llmgw.testing.gateway import FakeRoutesFeed, sim_argv, wait_healthy
from llmgw.testing.processes import ManagedProcess, free_port, start
from llmgw.wire import AllowanceRequest, KeyLimits, Priority, from_json, to_json

TICKS = os.sysconf("SC_CLK_TCK")
WARM_UP = 1
HERE = Path(__file__).resolve().parent
BODY = {"model": "m", "messages": [{"role": "user", "content": "benchmark the gateway"}], "max_tokens": 16}
#: the API key sent with --keys, and its limits (far above what the load reaches: admission runs, admits all)
SECRET = "sk-bench-0123456789abcdef"
LIMITS = KeyLimits(rpm=10**11, tpm=10**12, concurrency=10**6)
#: --admission: the key without limits, and the limited key's limits (never refused; priority critical)
PLAIN_SECRET = "sk-bench-plain-0123456789abcdef"
ADMISSION_LIMITS = attrs.evolve(LIMITS, priority=Priority.CRITICAL)
#: the API key each target of a run sends (any other: SECRET)
TARGET_SECRETS = {"plain": PLAIN_SECRET}
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [[%s]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('\\nRESULT {"requests":%%d,"errors":%%d,"p50":%%d,"p99":%%d,"us":%%d}\\n',
    summary.requests, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99), summary.duration))
end
"""


def cpu_seconds(pid: int | str) -> float:
    """User plus system CPU time so far of a process and its children (``"all"``: the whole machine)."""
    if pid == "all":
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / TICKS  # all but idle and iowait
    total = 0.0
    for pid_dir in [f"/proc/{pid}", *_children(int(pid))]:
        try:
            fields = Path(pid_dir, "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def _children(parent: int) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(Path(entry, "stat").read_text().rpartition(")")[2].split()[1]) == parent:
                    found.append(str(entry))
            except OSError:
                continue
    return found


@attrs.frozen
class Result:
    backend: str
    target: str
    concurrency: int
    stream: bool
    requests: int
    errors: int
    seconds: float
    p50: float
    p99: float
    cpu: dict[str, float]

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @classmethod
    def pooled(cls, rounds: list[Result]) -> Result:
        """The rounds of one case: counts added up, CPU averaged over time, median p50 and p99."""
        seconds = sum(r.seconds for r in rounds)
        cpu = {name: sum(r.cpu[name] * r.seconds for r in rounds) / seconds for name in rounds[0].cpu}
        first = rounds[0]
        return cls(
            first.backend,
            first.target,
            first.concurrency,
            first.stream,
            sum(r.requests for r in rounds),
            sum(r.errors for r in rounds),
            seconds,
            statistics.median(r.p50 for r in rounds),
            statistics.median(r.p99 for r in rounds),
            cpu,
        )

    def per_request(self, name: str) -> float:
        """CPU microseconds ``name`` spent per request."""
        return self.cpu[name] * self.seconds / max(1, self.requests) * 1e6


def run_wrk(
    url: str, concurrency: int, stream: bool, seconds: float, secret: str = SECRET
) -> tuple[int, int, float, float, float]:
    """One wrk run: (requests, errors, p50 ms, p99 ms, seconds)."""
    body = json.dumps({**BODY, "stream": stream})
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % (body, secret))
    try:
        argv = [
            "wrk",
            "-t1",
            f"-c{concurrency}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "10s",
            "-s",
            script.name,
            url,
        ]
        output = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(script.name)
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    data = json.loads(line.removeprefix("RESULT "))
    return data["requests"], data["errors"], data["p50"] / 1000, data["p99"] / 1000, data["us"] / 1e6


async def run_h11(url: str, concurrency: int, stream: bool, seconds: float, secret: str = SECRET) -> tuple:
    """The in-process fallback load client: (requests, errors, p50 ms, p99 ms, seconds)."""
    body, headers = _request(secret, stream=stream)
    latencies: list[float] = []
    errors = 0

    async def worker(pool: ConnectionPool) -> None:
        nonlocal errors
        while True:
            started = time.perf_counter()
            async with pool.stream("POST", url, headers=headers, body=body) as response:
                async for _ in response:
                    pass
            if response.status == 200:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1

    elapsed = await _for_seconds(concurrency, seconds, worker)
    return len(latencies), errors, _ms(latencies, 0.5), _ms(latencies, 0.99), elapsed


def _request(secret: str, **fields: object) -> tuple[bytes, list[tuple[str, str]]]:
    """The body (:data:`BODY` with ``fields``) and the headers (with ``secret``) of a client's request."""
    body = json.dumps({**BODY, **fields}).encode()
    return body, [("content-type", "application/json"), ("authorization", f"Bearer {secret}")]


async def _for_seconds(
    concurrency: int, seconds: float, worker: Callable[[ConnectionPool], Awaitable[None]]
) -> float:
    """Run ``concurrency`` copies of ``worker`` on one connection pool for ``seconds``; returns the seconds
    they ran."""
    async with ConnectionPool(max_idle_per_host=concurrency) as pool:
        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker, pool)
            await trio.sleep(seconds)
            nursery.cancel_scope.cancel()
        return time.perf_counter() - began


def _ms(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (seconds), in milliseconds."""
    ordered = sorted(values) or [0.0]
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


TOKEN_CONCURRENCY = 64


async def token_client(url: str, concurrency: int, events: int, seconds: float) -> dict:
    """``concurrency`` clients streaming ``events``-token answers from ``url`` for ``seconds``: events per
    second, whole-stream p50/p99 (ms) and the inter-token gap p50/p99/max (ms) each client saw."""
    body, headers = _request(SECRET, stream=True, bench_events=events)  # the key: for --keys
    wholes: list[float] = []
    gaps: list[float] = []
    firsts: list[float] = []
    received = 0

    async def worker(pool: ConnectionPool) -> None:
        nonlocal received
        while True:
            started = last = time.perf_counter()
            first = True
            async with pool.stream("POST", url, headers=headers, body=body) as response:
                async for chunk in response:
                    now = time.perf_counter()
                    (firsts if first else gaps).append(now - last)
                    last, first = now, False
                    received += chunk.count(b"data:")
            wholes.append(time.perf_counter() - started)

    elapsed = await _for_seconds(concurrency, seconds, worker)
    return {
        "events": received,
        "events_per_second": received / elapsed,
        "streams": len(wholes),
        "whole_p50": _ms(wholes, 0.5),
        "whole_p99": _ms(wholes, 0.99),
        "first_p50": _ms(firsts, 0.5),
        "first_p99": _ms(firsts, 0.99),
        "gap_p50": _ms(gaps, 0.5),
        "gap_p99": _ms(gaps, 0.99),
        "gap_max": _ms(gaps, 1.0),
    }


def run_token_client(url: str, events: int, seconds: float) -> dict:
    """:func:`token_client` in a process of its own (so that it does not share the bench's CPU)."""
    argv = [sys.executable, __file__, "--token-client", url, "--events", str(events)]
    argv += ["--seconds", str(seconds)]
    output = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def token_report(measured: dict[str, list[dict]], events: int) -> None:
    """The token-stream case: medians over rounds, per target."""
    print(f"\ntoken streams: {TOKEN_CONCURRENCY} clients, {events} events per answer, each its own write:")
    print(
        f"{'target':8} {'events/s':>9} {'whole p50 ms':>12} {'whole p99 ms':>12} "
        f"{'first p99':>9} {'gap p50 ms':>10} {'gap p99 ms':>10} {'gap max ms':>10} {'us/event':>9}"
    )
    print("(us/event: CPU of the target's process (the backend's for direct) per event, over all rounds)")
    medians = {}
    for target, rounds in measured.items():
        m = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        events_relayed = sum(r["events"] for r in rounds)
        m["us_per_event"] = sum(r["cpu"] for r in rounds) / max(1, events_relayed) * 1e6
        medians[target] = m
        print(
            f"{target:8} {m['events_per_second']:>9.0f} {m['whole_p50']:>12.1f} {m['whole_p99']:>12.1f} "
            f"{m['first_p99']:>9.1f} {m['gap_p50']:>10.2f} {m['gap_p99']:>10.2f} {m['gap_max']:>10.1f} "
            f"{m['us_per_event']:>9.2f}"
        )
    direct = medians["direct"]
    print("against direct (this run):")
    print(f"{'target':8} {'events/s':>9} {'whole p99':>9} {'gap p99':>9} {'gap max':>9}")
    for target, m in medians.items():
        if target != "direct":
            print(
                f"{target:8} {m['events_per_second'] / direct['events_per_second']:>8.2f}x "
                f"{m['whole_p99'] / direct['whole_p99']:>8.2f}x {m['gap_p99'] / direct['gap_p99']:>8.2f}x "
                f"{m['gap_max'] / direct['gap_max']:>8.2f}x"
            )


async def run_case(
    backend: str, target: str, url: str, concurrency: int, stream: bool, seconds: float, processes: dict
) -> Result:
    """Load ``url`` for ``seconds`` and measure the processes' CPU meanwhile."""
    cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    secret = TARGET_SECRETS.get(target, SECRET)
    began = time.perf_counter()
    if shutil.which("wrk"):
        requests, errors, p50, p99, elapsed = await trio.to_thread.run_sync(
            run_wrk, url, concurrency, stream, seconds, secret
        )
    else:
        requests, errors, p50, p99, elapsed = await run_h11(url, concurrency, stream, seconds, secret)
    wall = time.perf_counter() - began
    cpu = {name: (cpu_seconds(pid) - cpu_before[name]) / wall for name, pid in processes.items()}
    return Result(backend, target, concurrency, stream, requests, errors, elapsed, p50, p99, cpu)


def report(results: list[Result], workers: int) -> None:
    client = "wrk -t1" if shutil.which("wrk") else "in-process h11 client (wrk not on PATH)"
    print(f"\n{os.cpu_count()} CPU cores shared by the load client ({client}), the gateway")
    print(f"({workers} worker process{'es' if workers > 1 else ''}) and the backend. CPU: CPU seconds per")
    print("wall second (1.00 = one core busy); 'machine' counts every process, other work included.\n")
    header = f"{'backend':7} {'target':8} {'conc':>4} {'stream':>6} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7}"
    header += f" {'errors':>6} {'backend CPU':>11} {'gw CPU':>6} {'machine':>7}"
    print(header)
    for r in results:
        through = r.target != "direct"
        print(
            f"{r.backend:7} {r.target:8} {r.concurrency:>4} {'yes' if r.stream else 'no':>6} {r.rate:>7.0f} "
            f"{r.p50:>7.2f} {r.p99:>7.2f} {r.errors:>6} {r.cpu['backend']:>11.2f} "
            f"{r.cpu[r.target] if through else 0:>6.2f} {r.cpu['all']:>7.2f}"
        )
    print("\nthrough the gateway vs direct:")
    print(
        f"{'backend':7} {'gateway':8} {'conc':>4} {'stream':>6} {'added p50 ms':>12} {'added p99 ms':>12} "
        f"{'throughput':>10} {'gw us/req':>9}"
    )
    by_key = {(r.backend, r.target, r.concurrency, r.stream): r for r in results}
    for (backend, target, concurrency, stream), gateway in by_key.items():
        if target == "direct":
            continue
        direct = by_key[(backend, "direct", concurrency, stream)]
        print(
            f"{backend:7} {target:8} {concurrency:>4} {'yes' if stream else 'no':>6} "
            f"{gateway.p50 - direct.p50:>+12.2f} {gateway.p99 - direct.p99:>+12.2f} "
            f"{gateway.rate / direct.rate:>9.0%} {gateway.per_request(target):>9.0f}"
        )


def admission_report(measured: dict[tuple, list[Result]]) -> None:
    """--admission: the gateway's CPU per request with the plain and the limited key, their difference
    (the median over rounds of each round's pair), and the throughput with each."""
    print("\nadmission (one gateway, key 'plain' without limits vs 'limited' with rpm, tpm, concurrency,")
    print("priority critical; interleaved rounds):")
    print(
        f"{'conc':>4} {'stream':>6} {'plain us/req':>12} {'limited us/req':>14} {'added us/req':>12} "
        f"{'(rounds: min..max)':>20} {'plain req/s':>11} {'limited req/s':>13}"
    )
    for (target, _base, concurrency, stream), rounds in measured.items():
        if target != "limited":
            continue
        plain_rounds = next(
            found for (t, _, c, s), found in measured.items() if (t, c, s) == ("plain", concurrency, stream)
        )
        added = [
            limited.per_request("limited") - plain.per_request("plain")
            for plain, limited in zip(plain_rounds, rounds, strict=True)
        ]
        plain, limited = Result.pooled(plain_rounds), Result.pooled(rounds)
        print(
            f"{concurrency:>4} {'yes' if stream else 'no':>6} {plain.per_request('plain'):>12.1f} "
            f"{limited.per_request('limited'):>14.1f} {statistics.median(added):>+12.1f} "
            f"{f'{min(added):+.1f}..{max(added):+.1f}':>20} {plain.rate:>11.0f} {limited.rate:>13.0f}"
        )


class LendingFeed(FakeRoutesFeed):
    """The fake routes feed, also lending the limited keys' rates as the leading server does."""

    def __init__(self) -> None:
        super().__init__()
        self.lender = Lender()
        #: lease exchanges answered
        self.exchanges = 0

    async def handle(self, request: Request) -> Response:
        if request.path == ALLOWANCES_PATH and request.method == "POST":
            asked = from_json(request.json(), AllowanceRequest)
            self.exchanges += 1
            return Response.json(200, to_json(self.lender.lend(self.limits, asked, trio.current_time())))
        return await super().handle(request)


def admission_cost(count: int = 200_000) -> tuple[float, float]:
    """CPU microseconds per request of admission (a key with every rate limit: its checks, its ticket and
    the charge of its tokens) and of the model queue's way in and out with a free seat, in this process
    alone: what the gateway adds per request for them, without the noise of a shared machine."""
    admission = Admission(time.monotonic)
    admission.update({"bench": LIMITS})

    def admit() -> None:
        admission.forbidden("bench", "m")
        ticket = admission.admit("bench", "m")
        admission.priority("bench")
        ticket.done((10, 16))

    began = time.process_time()
    for _ in range(count):
        admit()
    admitted = (time.process_time() - began) / count * 1e6
    queues = Queues(QueueSettings(replica_concurrency=64), lambda _model: 1)

    async def seat() -> float:
        began = time.process_time()
        for _ in range(count):
            await queues.enter("m", "bench", Priority.STANDARD)
            queues.leave("m", "bench", 26)
        return (time.process_time() - began) / count * 1e6

    return admitted, trio.run(seat)


def backend_argv(backend: str, port: int) -> list[str]:
    if backend == "fast":
        return [sys.executable, str(HERE / "fastbackend.py"), "--port", str(port)]
    if backend == "uvicorn":
        return [sys.executable, str(HERE / "fastbackend.py"), "--port", str(port), "--uvicorn"]
    return sim_argv(port)


async def main(
    backends: list[str],
    seconds: float,
    rounds: int,
    workers: int,
    before: str | None,
    events: int = 256,
    keys: bool = False,
    gateway_args: tuple[str, ...] = (),
    admission: bool = False,
    unlimited: bool = False,
    tokens_only: bool = False,
) -> list[Result]:
    logs = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    started: list[ManagedProcess] = []
    results: list[Result] = []
    try:
        async with trio.open_nursery() as nursery:
            feed = LendingFeed() if admission else FakeRoutesFeed()
            feed_url = await nursery.start(feed.serve)
            if admission:
                keys_of = {SECRET: "limited", PLAIN_SECRET: "plain"}
                feed.set(keys=keys_of, limits={} if unlimited else {"limited": ADMISSION_LIMITS})
            elif keys:
                feed.set(keys={SECRET: "bench"}, limits={"bench": LIMITS})
            open_door = [] if keys else ["--no-keys"]
            for backend in backends:
                backend_port, gateway_port = free_port(), free_port()
                server = start(backend_argv(backend, backend_port), name=backend, log_dir=logs)
                started.append(server)
                backend_url = f"http://127.0.0.1:{backend_port}"
                feed.set(routes={"m": [("m-0", backend_url)]})
                argv = [sys.executable, "-m", "llmgw.gateway", "--server", feed_url, *open_door]
                argv += [
                    "--listen",
                    f"127.0.0.1:{gateway_port}",
                    *([] if workers == 1 else ["--workers", str(workers)]),
                    *gateway_args,
                ]
                gateway = start(argv, name=f"gateway-{backend}", log_dir=logs)
                started.append(gateway)
                targets = {"direct": backend_url, "gateway": f"http://127.0.0.1:{gateway_port}"}
                processes = {"backend": server.pid, "gateway": gateway.pid, "all": "all"}
                if admission:  # one gateway, two keys
                    through = targets["gateway"]
                    targets = {"direct": backend_url, "plain": through, "limited": through}
                    processes = {**processes, "plain": gateway.pid, "limited": gateway.pid}
                    del processes["gateway"]
                if before is not None:  # the same gateway command from older sources, interleaved
                    before_port = free_port()
                    argv = [sys.executable, "-m", "llmgw.gateway", "--server", feed_url, *open_door]
                    argv += ["--listen", f"127.0.0.1:{before_port}"]
                    older = start(
                        argv,
                        name=f"before-{backend}",
                        log_dir=logs,
                        extra_env={"PYTHONPATH": before},
                        cwd=before,
                    )
                    started.append(older)
                    targets["before"] = f"http://127.0.0.1:{before_port}"
                    processes["before"] = older.pid
                with trio.fail_after(20):
                    await wait_healthy(targets.values())
                cases = [
                    (target, base, concurrency, stream)
                    for concurrency in ((64,) if admission else (1, 64))
                    for stream in (False, True)
                    for target, base in targets.items()
                    if not tokens_only
                ]
                for _, base, _, stream in cases:  # warm up: connections, caches
                    await run_case(backend, "", f"{base}/v1/chat/completions", 64, stream, WARM_UP, processes)
                measured: dict[tuple, list[Result]] = {case: [] for case in cases}
                #: --admission: target -> (lease exchanges during its rounds, their seconds)
                lent: dict[str, tuple[int, float]] = {}
                for round_number in range(1, rounds + 1):
                    # every other round in the reverse order: a drift of the machine's load weighs on both
                    # sides of a comparison alike
                    for case in cases if round_number % 2 else cases[::-1]:
                        target, base, concurrency, stream = case
                        url = f"{base}/v1/chat/completions"
                        exchanges = getattr(feed, "exchanges", 0)
                        result = await run_case(backend, target, url, concurrency, stream, seconds, processes)
                        measured[case].append(result)
                        if admission:
                            lent[target] = (
                                lent.get(target, (0, 0.0))[0] + feed.exchanges - exchanges,
                                lent.get(target, (0, 0.0))[1] + result.seconds,
                            )
                        print(
                            f"  {backend} round {round_number}: {target} c={concurrency} stream={stream}: "
                            f"{result.rate:.0f} req/s",
                            file=sys.stderr,
                        )
                results += [Result.pooled(rounds) for rounds in measured.values()]
                if admission:
                    admission_report(measured)
                    print("lease exchanges per second: " + ", ".join(
                        f"{target} rounds {count / elapsed:.1f}" for target, (count, elapsed) in lent.items()
                    ))  # fmt: skip
                if backend == "fast" and events:
                    tokens: dict[str, list[dict]] = {target: [] for target in targets}
                    if tokens_only:  # no request cases warmed the connections up
                        for base in targets.values():
                            url = f"{base}/v1/chat/completions"
                            await trio.to_thread.run_sync(run_token_client, url, events, WARM_UP)
                    for round_number in range(1, rounds + 1):
                        order = list(targets.items())
                        for target, base in order if round_number % 2 else order[::-1]:
                            url = f"{base}/v1/chat/completions"
                            pid = processes.get(target, processes["backend"])
                            cpu_before = cpu_seconds(pid)
                            measured_round = await trio.to_thread.run_sync(
                                run_token_client, url, events, seconds
                            )
                            measured_round["cpu"] = cpu_seconds(pid) - cpu_before
                            tokens[target].append(measured_round)
                            print(
                                f"  token round {round_number}: {target}: "
                                f"{measured_round['events_per_second']:.0f} events/s, "
                                f"gap max {measured_round['gap_max']:.1f} ms",
                                file=sys.stderr,
                            )
                    token_report(tokens, events)
                gateway.kill_group()
                server.kill_group()
            nursery.cancel_scope.cancel()
        return results
    finally:
        for process in started:
            process.kill_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=2, help="measured seconds per round (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every case, interleaved (default 3)")
    parser.add_argument(
        "--backend",
        default="fast,sim",
        help="comma-separated backends among fast, uvicorn (needs uvicorn installed), sim (default fast,sim)",
    )
    parser.add_argument("--workers", type=int, default=1, help="the gateway's --workers (default 1)")
    parser.add_argument(
        "--before",
        metavar="DIR",
        help="also measure, interleaved, the gateway of the llmgw package in DIR (e.g. an older commit's "
        "`git archive COMMIT llmgw | tar -x -C DIR`), as target 'before'",
    )
    parser.add_argument("--events", type=int, default=256, help="token events per answer (0: no token case)")
    parser.add_argument("--token-client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument(
        "--tokens-only", action="store_true", help="only the token-stream case (fast backend)"
    )
    parser.add_argument("--keys", action="store_true", help="API keys on, one key with every rate limit")
    parser.add_argument("--gateway-args", default="", help="more flags for the current gateway only")
    parser.add_argument(
        "--admission",
        action="store_true",
        help="admission's cost in one run: a key without limits vs a limited one, one gateway (fast backend)",
    )
    parser.add_argument(
        "--aa",
        action="store_true",
        help="with --admission: the 'limited' key without limits too (an A/A run: the method's noise)",
    )
    args = parser.parse_args()
    if args.token_client:
        result = trio.run(token_client, args.token_client, TOKEN_CONCURRENCY, args.events, args.seconds)
        print(json.dumps(result))
        sys.exit(0)
    began = time.monotonic()
    chosen = ["fast"] if args.admission or args.tokens_only else args.backend.split(",")
    extra = tuple(shlex.split(args.gateway_args))
    events = 0 if args.admission else args.events
    measured = trio.run(
        main,
        chosen,
        args.seconds,
        args.rounds,
        args.workers,
        args.before,
        events,
        args.keys or args.admission,
        extra,
        args.admission,
        args.aa,
        args.tokens_only,
    )
    if not args.tokens_only:
        report(measured, args.workers)
    if args.keys or args.admission:
        admitted, seated = admission_cost()
        print(f"\nin this process alone: admission {admitted:.1f} us CPU per request, the model queue's "
              f"way in and out (a free seat) {seated:.1f} us")  # fmt: skip
    print(
        f"\n{args.rounds} rounds of {args.seconds:g}s per case, interleaved; "
        f"{time.monotonic() - began:.0f}s in all"
    )
