"""What the gateway costs: the same workload sent to a sim engine directly and through a gateway.

Run with ``python bench/gateway.py`` (about 45 s; ``--rounds`` and
``--seconds`` change that). It starts one ``llmgw-sim`` replica with no
generation delays, an in-process fake routes feed pointing at it, and
``llmgw gateway --no-keys`` as its own process; then, for concurrency 1 and
64, non-streamed and streamed chat completions (16 tokens), it runs an h11
load client (``llmgw.net.client``, keep-alive) against the sim directly and
through the gateway. Every case runs ``--rounds`` times, interleaved, so that
other work on the machine weighs on direct and gateway cases alike; the
rounds of a case are pooled. It prints:

- requests per second and p50/p99 latency of each case (a streamed request
  counts until its last byte);
- the gateway's added latency (p50 and p99 through it minus direct);
- throughput through the gateway as a fraction of direct;
- how busy each process was: CPU seconds over the case's wall time from
  ``/proc/<pid>/stat`` (1.0 = one core), so a reader sees whether the sim was
  the bottleneck. The machine's core count is printed too: client, gateway and
  sim share it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import attrs
import trio

from llmgw.net.client import ConnectionPool
from llmgw.testing.gateway import FakeRoutesFeed, sim_argv, wait_healthy
from llmgw.testing.processes import ManagedProcess, free_port, start

TICKS = os.sysconf("SC_CLK_TCK")
WARM_UP = 0.3
BODY = {"model": "m", "messages": [{"role": "user", "content": "benchmark the gateway"}], "max_tokens": 16}


def cpu_seconds(pid: int | str) -> float:
    """User plus system CPU time of a process so far (``"all"``: of the whole machine, every core)."""
    if pid == "all":
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / TICKS  # all but idle and iowait
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@attrs.frozen
class Result:
    target: str
    concurrency: int
    stream: bool
    requests: int
    errors: int
    seconds: float
    latencies: tuple[float, ...]
    cpu: dict[str, float]

    @property
    def rate(self) -> float:
        return self.requests / self.seconds

    @classmethod
    def pooled(cls, rounds: list[Result]) -> Result:
        """The rounds of one case as one result: counts and latencies added up, CPU averaged over time."""
        seconds = sum(r.seconds for r in rounds)
        cpu = {name: sum(r.cpu[name] * r.seconds for r in rounds) / seconds for name in rounds[0].cpu}
        latencies = tuple(latency for r in rounds for latency in r.latencies)
        first = rounds[0]
        return cls(
            first.target,
            first.concurrency,
            first.stream,
            sum(r.requests for r in rounds),
            sum(r.errors for r in rounds),
            seconds,
            latencies,
            cpu,
        )

    def per_request(self, name: str) -> float:
        """CPU microseconds ``name`` spent per request."""
        return self.cpu[name] * self.seconds / max(1, self.requests) * 1e6

    @property
    def others(self) -> float:
        """Cores busy with processes other than these three (other work on the machine)."""
        ours = self.cpu["sim"] + self.cpu["client"] + self.cpu.get("gateway", 0.0)
        return max(0.0, self.cpu["all"] - ours)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run_case(
    url: str, concurrency: int, stream: bool, seconds: float, processes: dict[str, int | str], target: str
) -> Result:
    """Run ``concurrency`` keep-alive workers against ``url`` for ``seconds`` (after a short warm-up)."""
    body = json.dumps({**BODY, "stream": stream}).encode()
    headers = [("content-type", "application/json")]
    latencies: list[float] = []
    errors = 0
    measuring = False
    async with ConnectionPool(max_idle_per_host=concurrency) as pool:

        async def worker() -> None:
            nonlocal errors
            while True:
                started = time.perf_counter()
                async with pool.stream("POST", url, headers=headers, body=body) as response:
                    async for _ in response:
                        pass
                    ok = response.status == 200
                if measuring:
                    if ok:
                        latencies.append(time.perf_counter() - started)
                    else:
                        errors += 1

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
            await trio.sleep(WARM_UP)  # connections opened, caches hot
            cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
            measuring = True
            began = time.perf_counter()
            await trio.sleep(seconds)
            measuring = False
            elapsed = time.perf_counter() - began
            cpu = {name: (cpu_seconds(pid) - cpu_before[name]) / elapsed for name, pid in processes.items()}
            nursery.cancel_scope.cancel()
    return Result(target, concurrency, stream, len(latencies), errors, elapsed, tuple(latencies), cpu)


def report(results: list[Result]) -> None:
    print(f"\n{os.cpu_count()} CPU cores shared by the load client, the gateway and the sim")
    print("CPU: CPU seconds per wall second over the case (1.00 = one core busy); 'other' is the rest")
    print("of the machine (other work running meanwhile); us/req: CPU microseconds per request\n")
    header = f"{'target':8} {'conc':>4} {'stream':>6} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}"
    header += f" {'sim CPU':>7} {'gw CPU':>6} {'client':>6} {'other':>5} {'sim us/req':>10} {'gw us/req':>9}"
    print(header)
    for r in results:
        through = r.target == "gateway"
        gateway_cpu = f"{r.cpu['gateway']:.2f}" if through else "-"
        gateway_cost = f"{r.per_request('gateway'):.0f}" if through else "-"
        print(
            f"{r.target:8} {r.concurrency:>4} {'yes' if r.stream else 'no':>6} {r.rate:>7.0f} "
            f"{r.percentile(0.50):>7.2f} {r.percentile(0.99):>7.2f} {r.errors:>6} "
            f"{r.cpu['sim']:>7.2f} {gateway_cpu:>6} {r.cpu['client']:>6.2f} {r.others:>5.2f} "
            f"{r.per_request('sim'):>10.0f} {gateway_cost:>9}"
        )
    print("\nthrough the gateway vs direct:")
    print(f"{'conc':>4} {'stream':>6} {'added p50 ms':>12} {'added p99 ms':>12} {'throughput':>10}")
    by_key = {(r.target, r.concurrency, r.stream): r for r in results}
    for (target, concurrency, stream), gateway in by_key.items():
        if target != "gateway":
            continue
        direct = by_key[("direct", concurrency, stream)]
        print(
            f"{concurrency:>4} {'yes' if stream else 'no':>6} "
            f"{gateway.percentile(0.50) - direct.percentile(0.50):>+12.2f} "
            f"{gateway.percentile(0.99) - direct.percentile(0.99):>+12.2f} "
            f"{gateway.rate / direct.rate:>9.0%}"
        )


async def main(seconds: float, rounds: int) -> list[Result]:
    logs = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    started: list[ManagedProcess] = []
    try:
        sim_port, gateway_port = free_port(), free_port()
        sim = start(sim_argv(sim_port), name="sim", log_dir=logs)
        started.append(sim)
        sim_url = f"http://127.0.0.1:{sim_port}"
        async with trio.open_nursery() as nursery:
            feed = FakeRoutesFeed()
            feed_url = await nursery.start(feed.serve)
            feed.set(routes={"m": [("m-0", sim_url)]})
            argv = [sys.executable, "-m", "llmgw.gateway", "--server", feed_url, "--no-keys"]
            gateway = start([*argv, "--listen", f"127.0.0.1:{gateway_port}"], name="gateway", log_dir=logs)
            started.append(gateway)
            gateway_url = f"http://127.0.0.1:{gateway_port}"
            with trio.fail_after(20):
                await wait_healthy([sim_url, gateway_url])
            processes = {"sim": sim.pid, "gateway": gateway.pid, "client": "self", "all": "all"}
            cases = [
                (target, base, concurrency, stream)
                for concurrency in (1, 64)
                for stream in (False, True)
                for target, base in (("direct", sim_url), ("gateway", gateway_url))
            ]
            measured: dict[tuple, list[Result]] = {case: [] for case in cases}
            for round_number in range(1, rounds + 1):
                for case in cases:
                    target, base, concurrency, stream = case
                    url = f"{base}/v1/chat/completions"
                    result = await run_case(url, concurrency, stream, seconds, processes, target)
                    measured[case].append(result)
                    print(
                        f"  round {round_number}: {target} c={concurrency} stream={stream}: "
                        f"{result.rate:.0f} req/s",
                        file=sys.stderr,
                    )
            nursery.cancel_scope.cancel()
        return [Result.pooled(rounds) for rounds in measured.values()]
    finally:
        for process in started:
            process.kill_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="measured seconds per round (default 1.5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every case, interleaved (default 3)")
    args = parser.parse_args()
    began = time.monotonic()
    report(trio.run(main, args.seconds, args.rounds))
    print(
        f"\n{args.rounds} rounds of {args.seconds:g}s per case (each after {WARM_UP:g}s of warm-up); "
        f"{time.monotonic() - began:.0f}s in all"
    )
