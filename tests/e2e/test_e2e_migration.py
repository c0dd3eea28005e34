"""Streams that survive their replica, across real processes: server, agents, sims, gateway.

16 clients stream long greedy answers through the gateway while one engine
is killed (-9), another is stopped (SIGSTOP), and a node is drained: every
stream goes on from another replica where its own broke, and each client
reads exactly the answer an unbroken replica gives (the sim is
deterministic), with the usage of one answer.
"""

from __future__ import annotations

import os
import signal
import statistics
from pathlib import Path

import httpx
import pytest

from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.load import routed_cluster
from llmgw.testing.metrics import samples
from llmgw.testing.processes import resume
from llmgw.testing.streams import StreamingClients

pytestmark = pytest.mark.timeout(300)

#: seconds of silence before the gateway calls a replica stalled (the default is 10)
STALL = 2.0
#: tokens per answer, and the sims' speed: an answer takes 4 s
TOKENS, RATE = 240, 60
CATALOG = catalog_yaml(
    {"chat": model("{models}/chat", replicas=4)},
    one=sim_profile(1, "--time-to-first-token", "0.02", "--tokens-per-second", str(RATE)),
)
CLIENTS = 16


def test_streams_survive_a_kill_a_stop_and_a_drain(tmp_path: Path):
    """kill -9, SIGSTOP, drain under 16 streaming clients: every stream completes with the unbroken text."""
    stopped: list[int] = []
    with routed_cluster(tmp_path, CATALOG, nodes=3, gateway=["--stall-timeout", str(STALL)]) as cluster:
        try:
            replicas = sorted(cluster.replicas().replicas, key=lambda r: r.id)
            killed, paused, drained = replicas[0], replicas[1], replicas[2]
            with StreamingClients(cluster.gateway_url, CLIENTS, tokens=TOKENS) as clients:
                # each fault hits the streams mid-way: a second of tokens after they began
                clients.wait_events(CLIENTS * RATE, cluster.wait)
                os.kill(killed.shards[0].pid, signal.SIGKILL)
                clients.wait_streams(CLIENTS, cluster.wait)
                clients.wait_events(CLIENTS * RATE, cluster.wait)
                stopped.append(paused.shards[0].pid)
                os.kill(stopped[0], signal.SIGSTOP)
                clients.wait_streams(CLIENTS, cluster.wait)
                drain = cluster.ctl("drain", drained.shards[0].node, "--timeout", "180")
                assert drain.returncode == 0, drain.stdout + drain.stderr
            results = clients.results
            scraped = httpx.get(f"{cluster.gateway_url}/metrics", timeout=10).text
            migrations = samples(scraped, "llmgw_gateway_stream_migrations_total")
            refused = samples(scraped, "llmgw_gateway_streams_not_continued_total")
            carried = samples(scraped, "llmgw_gateway_migrated_tokens_total")
            by_cause = {labels["cause"]: int(v) for labels, v in migrations}
            # a migrated stream's longest gap is its migration's (a token comes every 1/RATE s otherwise):
            # the streams with the longest gaps, as many as there were migrations
            gaps = sorted(r.gap for r in results)[-sum(by_cause.values()) :] if by_cause else []
            broken = clients.broken()
            print(
                f"\n{len(results)} streams, {len(results) - len(broken)} complete and equal to the unbroken "
                f"answer; migrations by cause {by_cause}, tokens carried {int(sum(v for _, v in carried))}; "
                f"gap (the migrated streams' longest, seen by their clients): "
                f"p50 {statistics.median(gaps) if gaps else 0:.3f} s, max {max(gaps, default=0):.3f} s"
            )
            assert not broken, broken[:3]
            assert not refused, refused
            assert by_cause.get("closed", 0) >= 1 and by_cause.get("stalled", 0) >= 1, by_cause
        finally:
            resume(stopped)
