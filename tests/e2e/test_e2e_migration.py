"""Streams that survive their replica, across real processes: server, agents, sims, gateway.

16 clients stream long greedy answers through the gateway while one engine
is killed (-9), another is stopped (SIGSTOP), and a node is drained: every
stream goes on from another replica where its own broke, and each client
reads exactly the answer an unbroken replica gives (the sim is
deterministic), with the usage of one answer.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx
import pytest
from llmgw_engine_sim.generate import count_tokens, generate
from prometheus_client.parser import text_string_to_metric_families

from llmgw.testing.catalogs import catalog_yaml, model, sim_profile
from llmgw.testing.load import routed_cluster

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


@attrs.frozen
class Streamed:
    """One stream as its client read it."""

    content: str
    text: str
    finish: str | None
    usage: dict | None
    error: str | None
    #: the longest wait between two events, seconds
    gap: float


def reference(content: str) -> str:
    """What an unbroken sim answers ``content`` (greedy, to ``TOKENS``)."""
    return generate(f"user: {content}\nassistant: ", TOKENS, answer="", ignore_eos=True).text


def stream_once(http: httpx.Client, content: str, tick: Callable[[], None]) -> Streamed:
    """Stream one answer to ``content``; ``tick()`` at every event read."""
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, finish, usage, error, gap = [], None, None, None, 0.0
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Streamed(content, "", None, None, f"status {response.status_code}", 0.0)
            last = time.monotonic()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                tick()
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                    continue
                for choice in event.get("choices") or ():
                    text.append(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Streamed(content, "".join(text), finish, usage, error, gap)


def gateway_samples(url: str, name: str) -> dict[tuple, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def test_streams_survive_a_kill_a_stop_and_a_drain(tmp_path: Path):
    """kill -9, SIGSTOP, drain under 16 streaming clients: every stream completes with the unbroken text."""
    stopped: list[int] = []
    with routed_cluster(tmp_path, CATALOG, nodes=3, gateway=["--stall-timeout", str(STALL)]) as cluster:
        try:
            results: list[Streamed] = []
            events = [0]
            lock = threading.Lock()
            stop = threading.Event()

            def tick() -> None:
                with lock:
                    events[0] += 1

            def mid_stream(what: str) -> None:
                """Wait until the clients read a second of tokens more: the next fault hits mid-stream."""
                mark = events[0]
                cluster.wait(lambda: events[0] >= mark + CLIENTS * RATE, f"a second of tokens {what}", 60)

            def client(index: int) -> None:
                with httpx.Client(base_url=cluster.gateway_url, timeout=60) as http:
                    turn = 0
                    while not stop.is_set():
                        answer = stream_once(
                            http, f"client {index} turn {turn}: tell me about the fleet", tick
                        )
                        turn += 1
                        with lock:
                            results.append(answer)

            replicas = sorted(cluster.replicas().replicas, key=lambda r: r.id)
            killed, paused, drained = replicas[0], replicas[1], replicas[2]
            threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
            for thread in threads:
                thread.start()
            mid_stream("before the kill")
            os.kill(killed.shards[0].pid, signal.SIGKILL)
            cluster.wait(lambda: len(results) >= CLIENTS, "a round of streams after the kill", 60)
            mid_stream("before the stop")
            stopped.append(paused.shards[0].pid)
            os.kill(stopped[0], signal.SIGSTOP)
            done = len(results)
            cluster.wait(lambda: len(results) >= done + CLIENTS, "a round of streams after the stop", 60)
            node = drained.shards[0].node
            drain = cluster.ctl("drain", node, "--timeout", "180")
            assert drain.returncode == 0, drain.stdout + drain.stderr
            stop.set()
            for thread in threads:
                thread.join(60)
            assert not any(thread.is_alive() for thread in threads)

            bad = [
                r
                for r in results
                if r.error
                or r.text != reference(r.content)
                or r.finish != "length"
                or r.usage
                != {
                    "prompt_tokens": count_tokens(r.content),
                    "completion_tokens": TOKENS,
                    "total_tokens": count_tokens(r.content) + TOKENS,
                }
            ]
            migrations = gateway_samples(cluster.gateway_url, "llmgw_gateway_stream_migrations_total")
            refused = gateway_samples(cluster.gateway_url, "llmgw_gateway_streams_not_continued_total")
            carried = gateway_samples(cluster.gateway_url, "llmgw_gateway_migrated_tokens_total")
            by_cause = {dict(labels)["cause"]: int(v) for labels, v in migrations.items()}
            # a migrated stream's longest gap is its migration's (a token comes every 1/RATE s otherwise):
            # the streams with the longest gaps, as many as there were migrations
            gaps = sorted(r.gap for r in results)[-sum(by_cause.values()) :] if by_cause else []
            print(
                f"\n{len(results)} streams, {len(results) - len(bad)} complete and equal to the unbroken "
                f"answer; migrations by cause {by_cause}, tokens carried {int(sum(carried.values()))}; "
                f"gap (the migrated streams' longest, seen by their clients): "
                f"p50 {statistics.median(gaps) if gaps else 0:.3f} s, max {max(gaps, default=0):.3f} s"
            )
            assert not bad, bad[:3]
            assert not refused, refused
            assert by_cause.get("closed", 0) >= 1 and by_cause.get("stalled", 0) >= 1, by_cause
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
