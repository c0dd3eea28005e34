"""Streams under a loop of engine kills, and what continuing them costs: ``python bench/migration.py``.

It starts a server, ``--nodes`` agents running the sim engine, a model of
``--replicas`` single-node replicas, and two gateways on the same routes:
one continuing broken streams (``--migration-limit 3``, the default) and one
that does not (``--migration-limit 0``: the relay as it was before, each
event passed on as read).

1. CPU per relayed event, before and after, in one run: ``--rounds``
   interleaved rounds of ``--clients`` clients streaming through each gateway
   in turn for ``--round-seconds``, no faults; the gateway process's CPU time
   (``/proc``) over the events its clients read.
2. Kills: ``--clients`` clients stream long greedy answers through the
   continuing gateway for ``--seconds`` while an engine is killed (``kill -9``)
   every ``--kill-every`` seconds (the agent rebuilds it). Every stream is
   compared with the sim's unbroken answer.

It prints streams completed (equal to the unbroken answer, usage of one
answer) and broken, migrations by cause, tokens carried over, the gap the
migrated streams' clients saw (p50, p99, max), and the CPU per relayed event
of both gateways.

A default run on this machine (2 cores shared with other work; 3 nodes, 4
replicas, 16 clients, 400 tokens at 100 tokens/s, a kill every 10 s for 180 s)::

    180 s, 18 engine kills (one every 10 s), 16 clients, 400 tokens per answer at 100 tokens/s
    streams: 736 completed equal to the unbroken answer, 0 broken (100.0% complete)
    migrations by cause {'closed': 80}; not continued none; tokens carried over 14343
    gap in migrated streams: p50 57 ms, p99 92 ms, max 93 ms
    gateway CPU per relayed event, before (--migration-limit 0): median 122.5 µs over 3 rounds
    gateway CPU per relayed event, after (--migration-limit 3): median 121.0 µs over 3 rounds

The CPU per event here is that of a sim sending each token as it comes (one
read and one write per event); against ``bench/fastbackend.py``, whose events
arrive together and are relayed in one write, it is a few µs (``bench/gateway.py``).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.load import gateway_models, ready_cluster
from llmgw.testing.metrics import samples
from llmgw.testing.processes import free_port
from llmgw.testing.streams import StreamingClients


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_event(url: str, pid: int, args: argparse.Namespace) -> float:
    """Microseconds of the gateway's CPU per event its clients read in one round of streaming."""
    before = cpu_seconds(pid)
    with StreamingClients(url, args.clients, tokens=args.tokens) as clients:
        time.sleep(args.round_seconds)  # the round's length is the measure
    return (cpu_seconds(pid) - before) / max(1, clients.events) * 1e6


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def run(args: argparse.Namespace, root: Path) -> int:
    catalog = catalog_yaml(
        {"chat": model("{models}/chat", replicas=args.replicas)},
        one=sim_profile(1, "--time-to-first-token", "0.02", "--tokens-per-second", str(args.rate)),
    )
    stall = ["--stall-timeout", str(args.stall_timeout)]
    with ready_cluster(root, catalog, nodes=args.nodes, gateway=stall) as cluster:
        after_url, after_pid = cluster.gateway_url, cluster.gateway.pid
        before = cluster.start_gateway(free_port(), extra=[*stall, "--migration-limit", "0"])
        before_url, before_pid = cluster.gateway_url, before.pid
        cluster.wait(lambda: gateway_models(before_url) == ["chat"], "the second gateway to route chat", 30)
        costs: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            costs["before"].append(cpu_per_event(before_url, before_pid, args))
            costs["after"].append(cpu_per_event(after_url, after_pid, args))

        kills = 0
        with StreamingClients(after_url, args.clients, tokens=args.tokens) as clients:
            clients.wait_events(args.clients * args.rate, cluster.wait)
            deadline = time.monotonic() + args.seconds
            while time.monotonic() < deadline:
                ready = [r for r in cluster.replicas().replicas if r.state == "ready" and r.shards[0].pid]
                if len(ready) > 1:
                    os.kill(random.choice(ready).shards[0].pid, signal.SIGKILL)
                    kills += 1
                time.sleep(args.kill_every)  # the kills' pace is the benchmark's setting
        text = httpx.get(f"{after_url}/metrics", timeout=10).text
        by_cause = {
            labels["cause"]: int(v) for labels, v in samples(text, "llmgw_gateway_stream_migrations_total")
        }
        refused = {
            labels["reason"]: int(v)
            for labels, v in samples(text, "llmgw_gateway_streams_not_continued_total")
        }
        carried = sum(v for _, v in samples(text, "llmgw_gateway_migrated_tokens_total"))
        results, broken = clients.results, clients.broken()
        migrated = sum(by_cause.values())
        # a migrated stream's longest gap is its migration's: the longest gaps, as many as migrations
        gaps = sorted(r.gap for r in results)[-migrated:] if migrated else []
        print(
            f"{args.seconds:g} s, {kills} engine kills (one every {args.kill_every:g} s), "
            f"{args.clients} clients, {args.tokens} tokens per answer at {args.rate} tokens/s"
        )
        print(
            f"streams: {len(results) - len(broken)} completed equal to the unbroken answer, {len(broken)} "
            f"broken ({100 * (len(results) - len(broken)) / max(1, len(results)):.1f}% complete)"
        )
        print(
            f"migrations by cause {by_cause}; not continued {refused or 'none'}; "
            f"tokens carried over {int(carried)}"
        )
        print(
            f"gap in migrated streams: p50 {percentile(gaps, 50) * 1000:.0f} ms, "
            f"p99 {percentile(gaps, 99) * 1000:.0f} ms, max {max(gaps, default=0) * 1000:.0f} ms"
        )
        for name, values in costs.items():
            print(
                f"gateway CPU per relayed event, {name} (--migration-limit {0 if name == 'before' else 3}): "
                f"median {statistics.median(values):.1f} µs over {args.rounds} rounds "
                f"({', '.join(f'{v:.1f}' for v in values)})"
            )
        for stream, problem in broken[:5]:
            print(f"  broken: {stream.content!r}: {problem}")
        return 1 if broken else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=400, help="tokens per answer")
    parser.add_argument("--rate", type=int, default=100, help="the sims' tokens per second")
    parser.add_argument("--seconds", type=float, default=180.0, help="how long the kills go on")
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--stall-timeout", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved CPU rounds per gateway")
    parser.add_argument("--round-seconds", type=float, default=8.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-migration-") as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
